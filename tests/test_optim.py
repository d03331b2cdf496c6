import itertools

import pytest
import torch
import torch.nn.functional as F

from mtrain.core.config import TrainConfig
from mtrain.core.distributed import Group
from mtrain.data.tokenizer import PAD_ID
from mtrain.training.coordinator import Coordinator
from mtrain.training.optim import LinearSchedule, Schedule, build_optimizer, loss_fn, lr_factor


def linear(warmup: int, total: int | None) -> Schedule:
    """A linear schedule of a small model's optimizer."""
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    return Schedule(optimizer, LinearSchedule(warmup, total))


def test_lr_warms_up_then_decays():
    factors = [lr_factor(done, 100) for done in range(999)]  # updates 1 to 999
    assert factors[0] == pytest.approx(0.01)
    assert max(factors) == pytest.approx(1.0) and factors.index(max(factors)) == 99
    assert all(a < b for a, b in itertools.pairwise(factors[:100]))
    assert all(a > b for a, b in itertools.pairwise(factors[99:]))
    assert lr_factor(399, 100) == pytest.approx(0.5)


def test_every_warmup_update_gets_its_own_learning_rate():
    model = torch.nn.Linear(2, 2)
    optimizer, schedule = build_optimizer(
        model, TrainConfig(lr=1.0, warmup_steps=4, lr_schedule="inverse_sqrt")
    )
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])  # the rate this update uses
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx([0.25, 0.5, 0.75, 1.0, (4 / 5) ** 0.5, (4 / 6) ** 0.5])


def test_loss_ignores_padding_and_label_smoothing_zero_is_cross_entropy():
    logits = torch.randn(2, 3, 7)
    tgt = torch.tensor([[4, 5, PAD_ID], [6, PAD_ID, PAD_ID]])
    expected = torch.nn.functional.cross_entropy(
        torch.stack([logits[0, 0], logits[0, 1], logits[1, 0]]), torch.tensor([4, 5, 6])
    )
    torch.testing.assert_close(loss_fn(logits, tgt, 0.0), expected)
    torch.testing.assert_close(loss_fn(logits, tgt, 0.0, "sum"), 3 * expected)
    assert loss_fn(logits, tgt, 0.1) != loss_fn(logits, tgt, 0.0)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_and_its_gradient_equal_torch_cross_entropy(eps, reduction):
    gen = torch.Generator().manual_seed(0)
    tgt = torch.randint(1, 50, (3, 9), generator=gen)
    tgt[0, 5:], tgt[2, 1:] = PAD_ID, PAD_ID
    logits = (3 * torch.randn(3, 9, 50, generator=gen, dtype=torch.float64)).requires_grad_()
    expected = F.cross_entropy(
        logits.flatten(0, 1),
        tgt.flatten(),
        ignore_index=PAD_ID,
        label_smoothing=eps,
        reduction=reduction,
    )
    (expected_grad,) = torch.autograd.grad(2 * expected, logits)
    mine = loss_fn(logits, tgt, eps, reduction)
    (grad,) = torch.autograd.grad(2 * mine, logits)
    torch.testing.assert_close(mine.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)
    assert grad[0, 5:].abs().sum() == 0 and grad[2, 1:].abs().sum() == 0


def test_loss_of_bf16_logits_is_computed_in_fp32_and_returns_a_bf16_gradient():
    gen = torch.Generator().manual_seed(1)
    tgt = torch.randint(1, 300, (4, 7), generator=gen)
    logits = torch.randn(4, 7, 300, generator=gen).bfloat16().requires_grad_()
    loss = loss_fn(logits, tgt, 0.1, "sum")
    loss.backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    expected = F.cross_entropy(
        logits.float().flatten(0, 1), tgt.flatten(), label_smoothing=0.1, reduction="sum"
    )
    torch.testing.assert_close(loss, expected)


def test_linear_schedule_decays_to_zero_at_the_last_update_and_resumes_its_plan():
    model = torch.nn.Linear(2, 2)
    cfg = TrainConfig(lr=1.0, warmup_steps=4, max_steps=10, max_minutes=0, lr_schedule="linear")
    optimizer, schedule = build_optimizer(model, cfg)
    rates = []
    for _ in range(12):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a > b for a, b in itertools.pairwise(rates[3:10]))
    assert rates[9] == pytest.approx(1 / 7) and rates[10:] == [0.0, 0.0]

    # Under a time budget the end is planned later; a resumed run keeps the plan.
    budgeted = TrainConfig(lr=1.0, warmup_steps=4, max_minutes=5, lr_schedule="linear")
    optimizer, schedule = build_optimizer(model, budgeted)
    assert schedule.total is None
    schedule.end_at(2, 10)
    _, resumed = build_optimizer(model, budgeted)
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.total == 10


def test_the_budget_plan_ends_the_linear_decay_when_the_time_runs_out():
    cfg = TrainConfig(warmup_steps=4, max_steps=1000, max_minutes=10, lr_schedule="linear")
    schedule = linear(cfg.warmup_steps, None)
    coordinator = Coordinator(cfg, Group(), step=0, minutes=0.0, schedule=schedule)
    coordinator.plan(step=3, minutes=1.5)  # still warming up: nothing planned
    assert schedule.total is None and coordinator.last_step == 1000
    coordinator.reserve = 1.0  # a validation takes a minute: keep room for the last one
    coordinator.plan(step=4, minutes=2.0)  # 2 steps a minute, 7 minutes left
    assert schedule.total == 4 + 14 == coordinator.last_step
    coordinator.plan(step=5, minutes=2.1)  # not a validation step: the plan stands
    assert schedule.total == 18
    assert (
        schedule.factor(4) == 1.0
        and schedule.factor(17) == pytest.approx(1 / 14)
        and schedule.factor(18) == 0.0
    )


def test_the_plan_follows_a_machine_that_slows_down_without_a_jump_in_the_rate():
    cfg = TrainConfig(warmup_steps=4, max_steps=1000, max_minutes=10, eval_every=2)
    schedule = linear(cfg.warmup_steps, None)
    coordinator = Coordinator(cfg, Group(), step=0, minutes=0.0, schedule=schedule)
    coordinator.plan(step=4, minutes=2.0)  # 2 steps a minute, 8 minutes left
    assert schedule.total == 20
    planned = [schedule.factor(n) for n in range(20)]  # 1 at update 5, 1/16 at update 20
    coordinator.plan(step=7, minutes=5.0)  # not a validation step
    assert schedule.total == 20
    coordinator.plan(step=8, minutes=6.0)  # 4 steps in the last 4 minutes, 4 left: 4 more
    assert schedule.total == 12 == coordinator.last_step
    rates = [schedule.factor(n) for n in range(8, 13)]  # updates 9 to 13: a straight line to 0
    assert rates[0] == planned[8] == pytest.approx(12 / 16)  # no jump at the new plan
    assert rates[-1] == 0.0 and rates[-2] > 0
    steps = [a - b for a, b in itertools.pairwise(rates[:-1])]
    assert steps == pytest.approx([steps[0]] * len(steps))

    # A resumed run goes on along the same line.
    budgeted = TrainConfig(lr=1.0, warmup_steps=4, max_minutes=5, lr_schedule="linear")
    _, scheduler = build_optimizer(torch.nn.Linear(2, 2), budgeted)
    scheduler.linear.__dict__.update(schedule.linear.__dict__)
    _, resumed = build_optimizer(torch.nn.Linear(2, 2), budgeted)
    resumed.load_state_dict(scheduler.state_dict())
    assert [resumed.factor(n) for n in range(8, 13)] == rates


def test_without_a_time_budget_the_linear_schedule_ends_at_max_steps():
    cfg = TrainConfig(warmup_steps=4, max_steps=50, max_minutes=0, eval_every=2)
    schedule = linear(cfg.warmup_steps, cfg.max_steps)
    coordinator = Coordinator(cfg, Group(), step=0, minutes=0.0, schedule=schedule)
    for step in range(1, 50):  # validation steps included: nothing to plan, nothing to raise
        coordinator.plan(step, minutes=step / 10)
    assert schedule.total == 50 == coordinator.last_step


def test_a_plan_needs_updates_to_time_so_a_skipped_update_keeps_the_plan():
    cfg = TrainConfig(warmup_steps=4, max_steps=1000, max_minutes=10, eval_every=2)
    schedule = linear(cfg.warmup_steps, None)
    coordinator = Coordinator(cfg, Group(), step=0, minutes=0.0, schedule=schedule)
    coordinator.plan(step=4, minutes=2.0)
    assert schedule.total == 20
    # The update after a validation step was skipped: the same step comes again, with no
    # update done since the plan. Planning from no updates would end the run at the next step.
    coordinator.plan(step=4, minutes=2.1)
    assert schedule.total == 20 == coordinator.last_step


def test_a_resumed_run_without_a_budget_decays_to_its_new_max_steps():
    cfg = TrainConfig(warmup_steps=4, max_steps=10, max_minutes=0, lr_schedule="linear")
    schedule = linear(cfg.warmup_steps, cfg.max_steps)
    reached = schedule.factor(6)  # the factor of update 7, where the run was interrupted
    raised = TrainConfig(warmup_steps=4, max_steps=20, max_minutes=0, lr_schedule="linear")
    coordinator = Coordinator(raised, Group(), step=6, minutes=1.0, schedule=schedule)
    assert schedule.total == 20 == coordinator.last_step
    rates = [schedule.factor(n) for n in range(6, 21)]
    assert rates[0] == reached and rates[-2] > 0 and rates[-1] == 0.0
    steps = [a - b for a, b in itertools.pairwise(rates[:-1])]
    assert steps == pytest.approx([steps[0]] * len(steps))
    # The same limit again changes nothing: a resume equals the uninterrupted run.
    before = dict(schedule.linear.__dict__)
    Coordinator(raised, Group(), step=8, minutes=1.0, schedule=schedule)
    assert schedule.linear.__dict__ == before


def test_a_run_resumed_without_its_time_budget_before_its_first_plan_decays_to_max_steps():
    budgeted = TrainConfig(warmup_steps=4, max_steps=20, max_minutes=5, lr_schedule="linear")
    unbudgeted = TrainConfig(warmup_steps=4, max_steps=20, max_minutes=0, lr_schedule="linear")
    for step in (2, 6):  # during warmup, and after it but before a plan
        schedule = linear(budgeted.warmup_steps, None)
        Coordinator(unbudgeted, Group(), step=step, minutes=1.0, schedule=schedule)
        assert schedule.total == 20
        assert schedule.factor(20) == 0.0 and 0 < schedule.factor(19) < schedule.factor(
            step
        )  # update 20 is the last
