"""The moving average of the weights: its arithmetic, and the model it lends validation."""

from __future__ import annotations

import torch

from mtrain.training.moving_average import MovingAverage


def test_the_average_follows_the_ramped_decay_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    average = MovingAverage(model, decay=0.9)
    expected = {k: v.clone().double() for k, v in model.state_dict().items()}
    for t in range(1, 40):  # past the ramp: (1 + t) / (10 + t) reaches 0.9 at t = 80, not here
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        average.update()
        decay = min(0.9, (1 + t) / (10 + t))
        for k, v in model.state_dict().items():
            expected[k] = decay * expected[k] + (1 - decay) * v.double()
    for k, v in average.state_dict().items():
        torch.testing.assert_close(v.double(), expected[k], rtol=1e-5, atol=1e-5)


def test_applied_lends_the_average_and_gives_the_weights_back():
    model = torch.nn.Linear(4, 4)
    average = MovingAverage(model, decay=0.5)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update()  # decay min(0.5, 2/11): the average moves most of the way
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with average.applied():
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    assert not torch.equal(inside["weight"], trained["weight"])
    assert not torch.equal(inside["weight"], own["weight"])
    assert torch.equal(inside["weight"], average.state_dict()["weight"])


def test_a_loaded_average_continues_where_it_was():
    model = torch.nn.Linear(2, 2)
    a = MovingAverage(model, decay=0.99)
    for _ in range(5):
        a.update()
    b = MovingAverage(model, decay=0.99)
    b.load_state_dict(a.state_dict(), a.updates)
    with torch.no_grad():
        model.weight.mul_(2)
    a.update()
    b.update()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
