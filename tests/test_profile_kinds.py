"""Where an update's time goes, by kind: every operator of real updates counted to the kind it
serves (bench_train.py --profile's first table)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from mtrain.core import runtime
from mtrain.core.distributed import Group
from mtrain.training.data import TrainingData
from mtrain.training.profile_kinds import (
    BATCH_ASSEMBLY,
    REST,
    kind_of,
    label_dropout,
    time_by_kind,
)
from mtrain.training.speed import update_step

from .console import script
from .synthetic import overrides, small_config


@dataclass
class Event:
    name: str
    self_cpu_time_total: float = 1.0
    cpu_parent: Event | None = None


def test_an_operator_counts_to_its_own_kind_else_to_the_nearest_enclosing_one():
    keep = Event("_KeepAndScale")
    mul = Event("aten::mul", cpu_parent=keep)
    cast = Event("aten::copy_", cpu_parent=Event("aten::_to_copy", cpu_parent=mul))
    norm_backward = Event("autograd::engine::evaluate_function: NativeLayerNormBackward0")
    assert kind_of(mul) == "dropout"
    assert kind_of(cast) == "casts"  # a cast wherever it runs
    assert kind_of(Event("aten::mm", cpu_parent=Event("attention"))) == "matmuls"
    assert kind_of(Event("aten::add_", cpu_parent=norm_backward)) == "LayerNorm"
    assert kind_of(Event("aten::add_")) == REST
    assert time_by_kind([mul, Event("aten::mul", 2.0, keep), cast]) == {
        "dropout": {"aten::mul": 3.0},
        "casts": {"aten::copy_": 1.0},
    }


# what an operator's name says it belongs to: none of these may be left to the rest
OWNED = ("mm", "layer_norm", "softmax", "nll", "dropout", "bernoulli", "adam", "scaled_dot")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_kind_of_a_real_update_is_found(corpus, tmp_path, dtype):
    cfg = small_config(corpus, batch_tokens=512)
    runtime.set_seed(cfg.train.seed)
    data = TrainingData(cfg, tmp_path, Group(), False)
    step = update_step(cfg, data, torch.device("cpu"), Group())
    step.amp_dtype = dtype  # bf16 autocast runs on any CPU, natively or not
    label_dropout(step.model)
    with contextlib.closing(data.updates(Group(), 1)) as updates:
        step(next(updates))  # warm
        with torch.profiler.profile() as prof:
            for _ in range(2):
                with torch.profiler.record_function(BATCH_ASSEMBLY):
                    update = next(updates)
                step(update)
    kinds = time_by_kind(prof.events())
    expected = {"matmuls", "attention", "loss", "LayerNorm", "dropout", "optimizer", BATCH_ASSEMBLY}
    if dtype is not None:
        expected.add("casts")
    assert all(sum(kinds.get(k, {}).values()) > 0 for k in expected), kinds.keys()
    owned = [op for op in kinds.get(REST, {}) if any(s in op.lower() for s in OWNED)]
    assert not owned, owned


def test_bench_train_prints_the_time_by_kind(corpus):
    result = script(
        "bench_train.py",
        "--config",
        "configs/tiny.yaml",
        *(a for o in overrides(corpus) for a in ("--set", o)),
        "--steps",
        "1",
        "--warmup",
        "1",
        "--profile",
        "2",
    )
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("time by kind, ", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = {line[:18].strip(): line for line in table[2:]}  # after the title and the header
    kinds = {"matmuls", "attention", "loss", "LayerNorm", "dropout", "optimizer", BATCH_ASSEMBLY}
    assert kinds | {"outside operators"} <= set(rows), table
