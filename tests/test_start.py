"""A run's start (training/start.py): the paths of this machine, read from the keys' policy, and
Ctrl-C as an MtrainError of the library."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from mtrain.core import config
from mtrain.core.config import Config, DataConfig
from mtrain.core.distributed import Group
from mtrain.core.errors import MtrainError
from mtrain.training import build
from mtrain.training.start import Stopped, rank_0s_config, resolve_data, run_training


class OtherRank:
    """A rank other than 0: what it receives is rank 0's config, as pickled and sent."""

    is_main = False

    def __init__(self, rank_0s: Config):
        self.rank_0s = rank_0s

    def broadcast(self, obj, startup=False):
        return copy.deepcopy(self.rank_0s)


def test_every_key_typed_as_a_corpus_is_declared_a_path_of_this_machine():
    """A key whose type is a corpus names files of this machine: so declared, it is checked
    and made absolute at a run's start and kept per process under torchrun."""
    typed = {
        (section.name, item.name)
        for section in dataclasses.fields(Config)
        for item in dataclasses.fields(section.default_factory)
        if "Corpus" in str(item.type)
    }
    declared = {k for k, where in config.LOCATIONS.items() if where is config.Location.CORPUS}
    assert typed == declared and ("data", "train") in typed


def test_each_rank_keeps_its_own_paths_and_takes_rank_0s_other_keys():
    paths = {"train": "t.tsv", "dev": "d.tsv", "test": "x.tsv", "prepared_dir": "p"}
    rank_0s = Config(data=DataConfig(**{k: f"/zero/{v}" for k, v in paths.items()}, max_src_len=9))
    mine = Config(data=DataConfig(**{k: f"/one/{v}" for k, v in paths.items()}))
    got = rank_0s_config(mine, OtherRank(rank_0s))
    for name in paths:
        assert getattr(got.data, name) == getattr(mine.data, name), name
    assert got.data.max_src_len == 9 and mine.data.max_src_len == 64


def test_resolve_data_makes_every_path_of_this_machine_absolute(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(corpus["train"]).parent)
    cfg = Config(
        data=DataConfig(
            **{k: Path(corpus[k]).name for k in ("train", "dev", "test")}, prepared_dir="p"
        )
    )
    resolve_data(cfg, tmp_path / "c.yaml")
    for name in ("train", "dev", "test", "prepared_dir"):
        assert Path(getattr(cfg.data, name)).is_absolute(), name
    cfg.data.dev = "missing.tsv"
    with pytest.raises(MtrainError, match=r"c\.yaml: data\.dev: .*missing\.tsv"):
        resolve_data(cfg, tmp_path / "c.yaml")


def test_ctrl_c_is_one_mtrain_error_of_the_library(tmp_path, monkeypatch):
    """The library raises (`mtrain train` prints the line and exits with 130), saying what the
    run directory keeps."""
    last = tmp_path / "last.pt"

    def interrupted(*args, **kwargs):
        if "again" in kwargs:
            last.write_bytes(b"")  # a checkpoint written before the second Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build_trainer", interrupted)
    with pytest.raises(Stopped, match=r"^stopped; no checkpoint had been written$"):
        run_training(Config(), tmp_path, torch.device("cpu"), Group())
    monkeypatch.setattr(build, "build_trainer", lambda *a, **k: interrupted(again=True))
    with pytest.raises(Stopped, match=rf"^stopped; {last} is intact$"):
        run_training(Config(), tmp_path, torch.device("cpu"), Group())
