"""Interrupted training loses nothing and resumes exactly; bad checkpoints are refused."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mtrain.core import config, jsonl, runtime
from mtrain.run.directory import (
    TRAIN_LOG,
    CheckpointError,
    load_checkpoint,
    load_run,
    run_config,
    save_checkpoint,
    save_copy,
    step_checkpoints,
    write_config,
)
from mtrain.training import update_step
from mtrain.training.build import build_trainer
from mtrain.training.start import check_resumable
from mtrain.training.trainer import NonFiniteLoss, Trainer, Validation
from mtrain.training.validation import Validator

from .synthetic import REPO, overrides, small_config


def mtrain_train(run: Path, settings: list[str]) -> list[str]:
    command = [sys.executable, "-m", "mtrain", "train", "--config", "configs/tiny.yaml"]
    return [*command, "--out", str(run), *(f"--set={s}" for s in settings)]


ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def run_train(run: Path, settings: list[str]) -> subprocess.CompletedProcess:
    """`mtrain train` to its end, in a subprocess; its output as text."""
    return subprocess.run(
        mtrain_train(run, settings), cwd=REPO, env=ENV, capture_output=True, text=True
    )


def start_training(run: Path, settings: list[str], log: Path) -> subprocess.Popen:
    """Start `mtrain train` in a subprocess; return once it has written its first checkpoint."""
    with log.open("w") as stderr:
        proc = subprocess.Popen(mtrain_train(run, settings), cwd=REPO, env=ENV, stderr=stderr)
    deadline = time.monotonic() + 60
    while not (run / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("ema_decay", [0.0, 0.9])
def test_resume_is_bit_identical_to_an_uninterrupted_run(corpus, tmp_path, ema_decay):
    """With a moving average of the weights too: it is resumed, not restarted."""
    whole = tmp_path / "whole"
    whole.mkdir()
    build_trainer(
        small_config(corpus, max_steps=30, eval_every=10, ema_decay=ema_decay),
        whole,
        torch.device("cpu"),
    ).run()

    parts = tmp_path / "parts"
    parts.mkdir()
    device = torch.device("cpu")
    # 400 pairs make about 8 batches: step 13 stops inside the second epoch.
    build_trainer(
        small_config(corpus, max_steps=13, eval_every=10, ema_decay=ema_decay), parts, device
    ).run()
    assert torch.load(parts / "last.pt", weights_only=True)["batches_done"] > 0
    resumed = build_trainer(
        small_config(corpus, max_steps=30, eval_every=10, ema_decay=ema_decay),
        parts,
        device,
        resume=True,
    )
    assert resumed.step == 13
    resumed.run()

    a = load_checkpoint(whole / "last.pt")
    b = load_checkpoint(parts / "last.pt")
    assert a["step"] == b["step"] == 30
    weights = ["model", "trained_model"] if ema_decay else ["model"]
    assert sorted(k for k in a if k.endswith("model")) == sorted(weights)
    for key in weights:
        for name, tensor in a[key].items():
            assert torch.equal(tensor, b[key][name]), (key, name)
    if ema_decay:  # the model offered for translation is the average, not the trained weights
        assert not torch.equal(
            a["model"]["src_embed.tokens.weight"], a["trained_model"]["src_embed.tokens.weight"]
        )
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])
    # train.jsonl: the same steps and rates; the window after the resume point holds the same
    # batches in both runs, so the same mean loss.
    logs = [jsonl.read(run / TRAIN_LOG) for run in (whole, parts)]
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] == [10, 20, 30]
    assert [r["lr"] for r in logs[0]] == [r["lr"] for r in logs[1]]
    assert logs[0][-1]["loss"] == logs[1][-1]["loss"]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    trainer = build_trainer(
        small_config(corpus, max_steps=20, eval_every=5), tmp_path, torch.device("cpu")
    )
    real_loss = update_step.loss_fn

    def poisoned(logits, tgt_out, smoothing, reduction="mean"):
        loss = real_loss(logits, tgt_out, smoothing, reduction)
        return loss * float("nan") if trainer.step == 7 else loss

    monkeypatch.setattr(update_step, "loss_fn", poisoned)
    with pytest.raises(NonFiniteLoss, match=r"^step 8: the loss is nan; .*\(step 5\) is intact"):
        trainer.run()  # stopped at the log step 10, which logs no NaN
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == 5
    assert jsonl.read(tmp_path / TRAIN_LOG) == []
    assert all(torch.isfinite(t).all() for t in saved["model"].values())


def stop_and_finish(
    run: Path, settings: list[str], log: Path, sigs: list[signal.Signals]
) -> tuple[str, subprocess.CompletedProcess, int]:
    """Start `mtrain train`, send it `sigs`; once it has exited 130 without a traceback, run
    the same command on to 5 updates past its checkpoint. Its stderr, the finishing run, and
    the step it had stopped at."""
    proc = start_training(run, settings, log)
    for sig in sigs:
        proc.send_signal(sig)
    proc.wait(timeout=60)
    stderr = log.read_text()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    step = load_checkpoint(run / "last.pt")["step"]
    assert step > 0
    finish = mtrain_train(run, [*settings, f"train.max_steps={step + 5}"])
    done = subprocess.run(finish, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_checkpoint(run / "last.pt")["step"] == step + 5
    return stderr, done, step


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_and_the_same_command_resumes(corpus, tmp_path, sig):
    run, log = tmp_path / "run", tmp_path / "stderr"
    settings = overrides(corpus, max_steps=100000, eval_every=3)
    stderr, done, step = stop_and_finish(run, settings, log, [sig])
    assert "interrupted at step" in stderr and "run the same command to resume" in stderr
    assert f"resuming {run} at step {step}" in done.stderr


def test_a_run_whose_corpora_moved_resumes_and_another_corpus_is_refused(corpus, tmp_path):
    """A moved clone: the same files at other paths are the run's corpora (last.pt holds a hash
    of their contents); a file of other contents is refused in one line, and nothing changes."""
    clone, moved = tmp_path / "clone", tmp_path / "moved"
    clone.mkdir()
    for key in ("train", "dev", "test"):
        shutil.copy(corpus[key], clone / f"{key}.tsv")

    def settings(root: Path, **more) -> list[str]:
        files = {key: str(root / f"{key}.tsv") for key in ("train", "dev", "test")}
        return overrides({**corpus, **files, **more}, eval_every=3)

    run, log = tmp_path / "run", tmp_path / "stderr"
    proc = start_training(run, [*settings(clone), "train.max_steps=100000"], log)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, log.read_text()
    step = load_checkpoint(run / "last.pt")["step"]
    clone.rename(moved)
    other = tmp_path / "other-test.tsv"
    other.write_text((moved / "test.tsv").read_text("utf-8") + "一\tone\n", "utf-8")
    refused = run_train(run, [*settings(moved, test=other), f"train.max_steps={step + 5}"])
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"data.test: {other} is not what {run / 'last.pt'} was trained on" in refused.stderr
    assert load_checkpoint(run / "last.pt")["step"] == step
    done = run_train(run, [*settings(moved), f"train.max_steps={step + 5}"])
    assert done.returncode == 0, done.stderr
    assert f"resuming {run} at step {step}" in done.stderr
    assert load_checkpoint(run / "last.pt")["step"] == step + 5
    assert run_config(run).data.train == str(moved / "train.tsv")


def test_a_damaged_last_pt_whose_corpora_moved_is_refused_as_damaged(corpus, tmp_path):
    """Corpora at other paths are compared by the hashes last.pt holds: a last.pt that cannot
    be read is what is refused, not the paths."""
    clone, moved = tmp_path / "clone", tmp_path / "moved"
    for root in (clone, moved):
        root.mkdir()
        for key in ("train", "dev", "test"):
            shutil.copy(corpus[key], root / f"{key}.tsv")

    def cfg_in(root: Path) -> config.Config:
        files = {key: str(root / f"{key}.tsv") for key in ("train", "dev", "test")}
        return small_config({**corpus, **files}, max_steps=2, eval_every=2)

    run = tmp_path / "run"
    run.mkdir()
    write_config(run, cfg_in(clone))
    build_trainer(cfg_in(clone), run, torch.device("cpu")).run()
    check_resumable(run, cfg_in(moved))  # the same contents elsewhere
    last = run / "last.pt"
    last.write_bytes(last.read_bytes()[:500])
    with pytest.raises(CheckpointError, match=r"last\.pt: not a loadable mtrain checkpoint"):
        check_resumable(run, cfg_in(moved))


def test_resume_with_another_config_is_refused(corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = small_config(corpus, max_steps=5, eval_every=5)
    write_config(run, cfg)
    build_trainer(cfg, run, torch.device("cpu")).run()
    settings = [*overrides(corpus, max_steps=5, eval_every=5), "model.d_model=32"]
    result = subprocess.run(
        mtrain_train(run, settings), cwd=REPO, capture_output=True, text=True, env=ENV
    )
    assert result.returncode == 2
    assert "was trained with model.d_model=64, not 32" in result.stderr


class Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_checkpoint_with_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": Payload()}, path)
    with pytest.raises(CheckpointError, match=r"evil\.pt: not a loadable mtrain checkpoint"):
        load_checkpoint(path)


def test_truncated_checkpoint_is_refused(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CheckpointError, match=r"cut\.pt: not a loadable mtrain checkpoint"):
        load_checkpoint(path)


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"model": {}, "step": 1})

    def broken(state, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"model": {}, "step": 2})
    assert load_checkpoint(path)["step"] == 1


def test_non_finite_batches_can_be_skipped_and_are_counted(corpus, tmp_path, monkeypatch):
    cfg = small_config(corpus, max_steps=10, eval_every=10, skip_nonfinite="true")
    trainer = build_trainer(cfg, tmp_path, torch.device("cpu"))
    real_loss = update_step.loss_fn
    calls = []

    def poisoned(logits, tgt_out, smoothing, reduction="mean"):
        calls.append(1)
        loss = real_loss(logits, tgt_out, smoothing, reduction)
        return loss * float("inf") if len(calls) == 4 else loss

    monkeypatch.setattr(update_step, "loss_fn", poisoned)
    trainer.run()
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == 10 and saved["skipped"] == 1
    assert '"skipped": 1' in (tmp_path / "metrics.jsonl").read_text()


def test_out_of_memory_batch_is_reported_and_skipped(corpus, tmp_path, monkeypatch, caplog):
    trainer = build_trainer(
        small_config(corpus, max_steps=6, eval_every=6), tmp_path, torch.device("cpu")
    )
    real_forward = trainer.model.forward
    calls = []

    def forward(src, tgt_in):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real_forward(src, tgt_in)

    monkeypatch.setattr(trainer.model, "forward", forward)
    with caplog.at_level("WARNING"):
        trainer.run()
    assert trainer.step == 6 and trainer.skipped == 1
    assert "skipped the update" in caplog.text and "out of memory" in caplog.text


def test_keeps_the_last_k_step_checkpoints(corpus, tmp_path):
    cfg = small_config(corpus, max_steps=20, eval_every=5, keep_last=2)
    build_trainer(cfg, tmp_path, torch.device("cpu")).run()
    names = [p.name for p in step_checkpoints(tmp_path)]
    assert names == ["step-00000015.pt", "step-00000020.pt"]
    assert (tmp_path / "best.pt").exists() and (tmp_path / "last.pt").exists()


def test_tokenizer_that_does_not_match_the_checkpoint_is_refused(corpus, tmp_path):
    cfg = small_config(corpus, max_steps=5, eval_every=5)
    write_config(tmp_path, cfg)
    build_trainer(cfg, tmp_path, torch.device("cpu")).run()
    other = tmp_path / "other"
    other.mkdir()
    from mtrain.data.tokenizer import Tokenizer

    texts = [f"word{i} other{i * 3}" for i in range(200)]
    # the same sizes as the run's
    wider = config.TokenizerConfig(vocab_size=300, tgt_vocab_size=0, character_coverage=1.0)
    Tokenizer.train(texts, texts, wider, "en", "de", other)
    (tmp_path / "spm.tgt.model").write_bytes((other / "spm.tgt.model").read_bytes())
    with pytest.raises(CheckpointError, match="SentencePiece models differ"):
        load_run(tmp_path, torch.device("cpu"))


def test_checkpoint_copies_survive_the_next_save(tmp_path):
    last, step = tmp_path / "last.pt", tmp_path / "step-1.pt"
    save_checkpoint(last, {"model": {}, "step": 1})
    save_copy(last, step)
    save_checkpoint(last, {"model": {}, "step": 2})
    assert load_checkpoint(step)["step"] == 1 and load_checkpoint(last)["step"] == 2


def test_second_interrupt_stops_at_once_without_corrupting_checkpoints(corpus, tmp_path):
    run, log = tmp_path / "run", tmp_path / "stderr"
    proc = start_training(run, overrides(corpus, max_steps=100000, eval_every=3), log)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    stderr = log.read_text()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert load_checkpoint(run / "last.pt")["step"] > 0


def test_a_finished_run_started_again_is_left_as_it_is(corpus, tmp_path):
    settings = overrides(corpus, max_steps=12, eval_every=4, keep_last=2, average_last=2)
    run = tmp_path / "run"
    first = run_train(run, settings)
    assert first.returncode == 0, first.stderr

    def files_of_the_run():  # but the lock, which names the last process that held it
        return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}

    files = files_of_the_run()
    assert {"best.pt", "averaged.pt", "step-00000012.pt"} <= set(files)
    again = run_train(run, settings)
    assert again.returncode == 0, again.stderr
    assert "finished at step 12 (train.max_steps is 12)" in again.stderr
    assert again.stdout.strip() == str(run)
    assert files_of_the_run() == files

    # Raised limits train on, from where it ended.
    more = run_train(run, [*settings, "train.max_steps=16"])
    assert more.returncode == 0, more.stderr
    assert load_checkpoint(run / "last.pt")["step"] == 16


def test_a_linear_schedule_that_reached_zero_cannot_be_raised(corpus, tmp_path):
    settings = overrides(corpus, max_steps=8, eval_every=4, lr_schedule="linear", warmup_steps=2)
    run = tmp_path / "run"
    first = run_train(run, settings)
    assert first.returncode == 0, first.stderr
    before = {name: (run / name).read_bytes() for name in ("last.pt", "config.yaml")}
    again = run_train(run, settings)
    assert again.returncode == 0, again.stderr
    assert "its learning rate is annealed: train a new run" in again.stderr
    raised = run_train(run, [*settings, "train.max_steps=16"])
    assert raised.returncode == 2
    assert "finished at step 8 (train.max_steps is 8) with its learning rate annealed" in (
        raised.stderr
    )
    assert raised.stderr.strip().splitlines()[-1].startswith("mtrain: error: ")
    assert "Traceback" not in raised.stderr
    assert {name: (run / name).read_bytes() for name in before} == before


class Flat(Validator):
    """Dev BLEU 5.0 at every validation: the first is the best, no later one is better."""

    def __call__(self, step: int) -> Validation:
        return Validation(step, self.minutes(), 1.0, 5.0, 5.0)


# Under a linear schedule patience does not end a run (test_train.py).
@pytest.mark.parametrize("schedule", ["inverse_sqrt"])
def test_a_run_ended_by_patience_trains_on_when_patience_is_raised(
    corpus, tmp_path, caplog, schedule
):
    def trainer(**keys) -> Trainer:
        keys = {"max_steps": 100, "eval_every": 5, "warmup_steps": 2, **keys}
        cfg = small_config(corpus, lr_schedule=schedule, **keys)
        resume = (tmp_path / "last.pt").exists()
        if resume:
            check_resumable(tmp_path, cfg)  # the CLI lets a resumed run change its patience
        else:
            write_config(tmp_path, cfg)
        return build_trainer(cfg, tmp_path, torch.device("cpu"), resume=resume, make_validator=Flat)

    first = trainer(patience=2)
    first.run()
    assert first.step == 15
    assert load_checkpoint(tmp_path / "last.pt")["finished"]["limit"] == "patience"
    # More steps do not outlast the patience that ended the run; under a linear schedule
    # its learning rate had not reached 0, so it is not refused as annealed either.
    more_steps = trainer(patience=2, max_steps=200)
    with caplog.at_level("INFO"):
        more_steps.run()
    assert more_steps.step == 15
    assert "raise train.patience to train on" in caplog.text
    more_patience = trainer(patience=4)
    more_patience.run()
    assert more_patience.step == 25  # two more validations without a better dev BLEU


def test_a_run_ended_by_max_steps_is_left_as_it_is_when_only_its_budget_is_raised(corpus, tmp_path):
    keys = {"max_steps": 6, "eval_every": 3, "keep_last": 2, "average_last": 2}
    build_trainer(small_config(corpus, max_minutes=30, **keys), tmp_path, torch.device("cpu")).run()

    def files_of_the_run():
        return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix in (".pt", ".jsonl")}

    files = files_of_the_run()
    more_minutes = small_config(corpus, max_minutes=60, **keys)
    resumed = build_trainer(more_minutes, tmp_path, torch.device("cpu"), resume=True)
    resumed.run()  # more minutes cannot outlast max_steps: nothing to average or log again
    assert resumed.step == 6
    assert files_of_the_run() == files


def test_a_validation_that_fails_keeps_the_updates_before_it(corpus, tmp_path):
    # The last validation (step 10 of 10) fails: last.pt keeps step 10, and the same command
    # again validates it and finishes the run, as an uninterrupted run would have.
    cfg = small_config(corpus, max_steps=10, eval_every=5)
    calls = []

    class FailingSecond(Validator):
        def __call__(self, step: int) -> Validation:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("out of memory while decoding the dev set")
            return super().__call__(step)

    trainer = build_trainer(cfg, tmp_path, torch.device("cpu"), make_validator=FailingSecond)
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.run()
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 10
    assert [r["step"] for r in jsonl.read(tmp_path / "metrics.jsonl")] == [5]
    resumed = build_trainer(cfg, tmp_path, torch.device("cpu"), resume=True)
    assert resumed.step == 10
    resumed.run()
    assert [r["step"] for r in jsonl.read(tmp_path / "metrics.jsonl")] == [5, 10]
    assert load_checkpoint(tmp_path / "last.pt")["finished"]["reason"] == "train.max_steps is 10"


def test_a_run_resumed_in_another_dtype_says_so(corpus, tmp_path, monkeypatch, caplog):
    cpu = torch.device("cpu")
    cfg = small_config(corpus, max_steps=10, eval_every=10, precision="fp32")
    build_trainer(cfg, tmp_path, cpu).run()
    assert load_checkpoint(tmp_path / "last.pt")["dtype"] == "float32"

    caplog.set_level("WARNING")
    build_trainer(cfg, tmp_path, cpu, resume=True)  # the same dtype: no word of it
    assert "was trained in" not in caplog.text
    # On a machine where auto picks bf16:
    monkeypatch.setattr(runtime, "mixed_precision", lambda device, precision: torch.bfloat16)
    build_trainer(cfg, tmp_path, cpu, resume=True)
    assert "was trained in float32; the run goes on in bfloat16" in caplog.text


def test_a_checkpoint_of_the_first_format_resumes(corpus, tmp_path):
    cfg = small_config(corpus, max_steps=6, eval_every=3)
    write_config(tmp_path, cfg)
    build_trainer(cfg, tmp_path, torch.device("cpu")).run()
    state = load_checkpoint(tmp_path / "last.pt")
    # As written before torchrun, dtypes, validation marks and limits were recorded.
    (rng,) = state.pop("rng")
    old = {k: v for k, v in state.items() if k not in ("format", "dtype", "validated")}
    old |= {"python_rng_state": rng["python"], "torch_rng_state": rng["torch"]}
    old |= {"cuda_rng_states": rng["cuda"]}
    old["finished"] = {"reason": "train.max_steps is 6", "max_steps": 6, "max_minutes": math.inf}
    save_checkpoint(tmp_path / "last.pt", old)

    again = build_trainer(cfg, tmp_path, torch.device("cpu"), resume=True)
    assert again.step == 6 and again.progress.finished.limit == "max_steps"
    assert again.run() == state["best_bleu"]  # finished: nothing to do
    more = small_config(corpus, max_steps=9, eval_every=3)
    resumed = build_trainer(more, tmp_path, torch.device("cpu"), resume=True)
    assert torch.equal(torch.get_rng_state(), rng["torch"])
    resumed.run()
    upgraded = load_checkpoint(tmp_path / "last.pt")
    assert upgraded["step"] == 9 and upgraded["format"] == 2 and "torch_rng_state" not in upgraded


def test_a_checkpoint_of_a_newer_format_is_refused(corpus, tmp_path):
    cfg = small_config(corpus, max_steps=3, eval_every=3)
    build_trainer(cfg, tmp_path, torch.device("cpu")).run()
    state = load_checkpoint(tmp_path / "last.pt")
    save_checkpoint(tmp_path / "last.pt", {**state, "format": 99})
    with pytest.raises(CheckpointError, match="its format 99 is newer than this mtrain's"):
        build_trainer(cfg, tmp_path, torch.device("cpu"), resume=True)
