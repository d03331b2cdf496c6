"""`train.compile`: the compiled updates train as the eager ones do; compiles are counted."""

from __future__ import annotations

import logging

import pytest
import torch

from mtrain.core.config import ConfigError
from mtrain.training import compiled
from mtrain.training.build import build_trainer
from mtrain.training.trainer import Trainer

from .synthetic import small_config

CPU = torch.device("cpu")
UPDATES = 4


def losses(corpus, path, compile_: bool) -> tuple[Trainer, list[float]]:
    """The losses of the tiny config's first updates, fp32 without dropout."""
    cfg = small_config(corpus, precision="fp32", compile=str(compile_).lower())
    cfg.model.dropout = 0.0
    path.mkdir()
    trainer = build_trainer(cfg, path, CPU)
    updates = trainer.data.updates(trainer.group, cfg.train.accumulate)
    out = [float(trainer.update_step(next(updates))) for _ in range(UPDATES)]
    updates.close()
    return trainer, out


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",  # dynamo and autograd's tracing, without generating code: seconds
        pytest.param("inductor", marks=pytest.mark.slow),  # C++ from gcc: a minute a shape
    ],
)
def test_compiled_updates_give_the_eager_losses(corpus, tmp_path, monkeypatch, backend):
    monkeypatch.setattr(compiled, "BACKEND", backend)
    eager_trainer, eager = losses(corpus, tmp_path / "eager", False)
    assert eager_trainer.update_step.compiled is None
    trainer, fast = losses(corpus, tmp_path / "compiled", True)
    step = trainer.update_step.compiled
    assert step is not None and step.compiles >= 1 and step.recompiles == 0
    assert len(step.seen) <= UPDATES
    assert fast == pytest.approx(eager, rel=1e-4)
    for a, b in zip(eager_trainer.model.parameters(), trainer.model.parameters()):
        # Adam's first steps move a weight by about the rate whatever its gradient's size:
        # a near-zero gradient of the other sign moves it the other way.
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)


def test_compiles_beyond_the_grid_are_counted_and_logged(caplog):
    def loss(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum()

    step = compiled.Compiled(loss, shapes=2)
    compiled.BACKEND = "eager"
    try:
        with caplog.at_level(logging.WARNING):
            for n in (3, 4, 3):  # two shapes: as many as the grid
                step(torch.ones(n))
            assert "train.compile" not in caplog.text
            step(torch.ones(5))
    finally:
        compiled.BACKEND = "inductor"
    assert len(step.seen) == 3 and step.recompiles == 0
    assert "3 shapes compiled and 0 recompiled, beyond the 2 shapes" in caplog.text


def test_auto_compiles_nowhere_yet(corpus):
    assert not compiled.compiles_on("auto", CPU)
    assert not compiled.compiles_on("auto", torch.device("cuda"))
    assert compiled.compiles_on(True, CPU)
    assert small_config(corpus).train.compile == "auto"
    with pytest.raises(ConfigError, match=r"train\.compile"):
        small_config(corpus, compile="fast")
