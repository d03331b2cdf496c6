"""A run's start (training/start.py): the paths of this machine, read from the keys' policy, and
Ctrl-C as an MtrainError of the library."""

from __future__ import annotations

import copy
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


def test_the_paths_of_this_machine_are_declared_in_the_keys_policy():
    assert config.LOCATIONS == {
        ("data", "train"): config.Location.CORPUS,
        ("data", "dev"): config.Location.CORPUS,
        ("data", "test"): config.Location.CORPUS,
        ("data", "prepared_dir"): config.Location.DIRECTORY,
    }


def test_each_rank_keeps_its_own_paths_and_takes_rank_0s_other_keys():
    rank_0s = Config(data=DataConfig(train="/zero/t.tsv", prepared_dir="/zero/p", max_src_len=9))
    mine = Config(data=DataConfig(train="/one/t.tsv", dev="/one/d.tsv", prepared_dir="/one/p"))
    got = rank_0s_config(mine, OtherRank(rank_0s))
    for section, name in config.LOCATIONS:
        assert getattr(getattr(got, section), name) == getattr(getattr(mine, section), name)
    assert got.data.max_src_len == 9 and mine.data.max_src_len == 64


def test_resolve_data_makes_every_path_of_this_machine_absolute(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(corpus["train"]).parent)
    cfg = Config(
        data=DataConfig(
            **{k: Path(corpus[k]).name for k in ("train", "dev", "test")}, prepared_dir="p"
        )
    )
    resolve_data(cfg, tmp_path / "c.yaml")
    for section, name in config.LOCATIONS:
        assert Path(getattr(getattr(cfg, section), name)).is_absolute(), name
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
