"""Subword sampling of the training sources: the same text, the planned shapes, draws that
depend on the batch alone, and a batch thread that stops with the updates."""

from __future__ import annotations

import signal
import threading
from itertools import islice

import numpy as np
import pytest
import torch

from mtrain.core import config
from mtrain.core.config import ConfigError
from mtrain.core.distributed import Group
from mtrain.data.batching import BatchStream
from mtrain.data.prepare import prepared_dir
from mtrain.data.prepared import DamagedCorpus
from mtrain.data.subword_sampling import planned_lengths
from mtrain.data.token_corpus import drop_final_punctuation
from mtrain.data.tokenizer import EOS_ID, PAD_ID
from mtrain.run.directory import load_checkpoint, write_config
from mtrain.training.build import build_trainer
from mtrain.training.data import TrainingData

from .synthetic import REPO, overrides
from .test_resume import stop_and_finish


def sampling_config(corpus, alpha: float, *settings: str, **train_keys) -> config.Config:
    values = [*overrides(corpus, **train_keys), f"data.src_sampling_alpha={alpha}", *settings]
    return config.load(REPO / "configs" / "tiny.yaml", values)


def sources(src: torch.Tensor) -> list[list[int]]:
    """Each row's pieces, without </s> and padding."""
    return [[i for i in row if i not in (PAD_ID, EOS_ID)] for row in src.tolist()]


def sampling_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "batches"]


def test_sampled_sources_read_the_stored_text_and_keep_their_batch_shape(corpus, tmp_path):
    data = TrainingData(sampling_config(corpus, 0.1), tmp_path, Group(), False)
    decode = data.tokenizer.src.decode
    differ = rows = 0
    for plan in islice(data.stream.plans(0, 0), 16):
        stored = data.corpus.collate(plan.indices)
        batch = data.batch(plan)
        assert batch.src.shape == (plan.shape.rows, plan.shape.src_len)
        assert plan.shape.src_len > stored.src.size(1)  # room planned for a longer cut
        assert torch.equal(batch.tgt_out, stored.padded_to(plan.shape).tgt_out)  # targets kept
        n = len(plan.indices)
        src = batch.src[:n]
        lengths = (src != PAD_ID).sum(1)  # (n,) pieces and </s>
        assert torch.equal(src[torch.arange(n), lengths - 1], torch.full((n,), EOS_ID))
        assert decode(sources(src)) == decode(sources(stored.src))
        differ += sum(a != b for a, b in zip(sources(src), sources(stored.src)))
        rows += n
    assert 0 < differ < rows


def test_a_source_draws_only_among_the_segmentations_that_fit_its_width(corpus, tmp_path):
    data = TrainingData(sampling_config(corpus, 0.0001), tmp_path, Group(), False)
    longer = 0
    for plan in islice(data.stream.plans(0, 0), 8):  # alpha near 0: nearly uniform draws
        stored = data.corpus.collate(plan.indices).src
        width = stored.size(1)  # the batch's longest stored source, </s> included
        for seed in range(5):
            rng = np.random.default_rng(seed)
            assert data.sampler.resegment(stored, width, rng).size(1) <= width
            rng = np.random.default_rng(seed)
            longer += data.sampler.resegment(stored, width + 8, rng).size(1) > width
    assert longer, "no longer segmentation drawn: the width was not what limited the draws"


def test_batches_are_planned_with_room_for_longer_cuts_within_the_longest_source():
    stored = np.array([2, 5, 20, 21, 40, 64], np.uint16)  # pieces and </s>
    assert planned_lengths(stored, 64).tolist() == [3, 6, 21, 23, 42, 64]
    assert planned_lengths(stored, 64).dtype == stored.dtype


def test_alpha_0_reads_the_stored_batches(corpus, tmp_path):
    """The batches of a run without sampling, punctuation dropout's draws included."""
    cfg = sampling_config(corpus, 0.0, "data.drop_final_punct=0.5")
    data = TrainingData(cfg, tmp_path, Group(), False)
    assert data.sampler is None
    torch.manual_seed(0)
    got = [b for update in islice(data.updates(Group(), 2), 6) for b in update.batches]
    assert not sampling_threads()
    stream = BatchStream(
        data.corpus.src_len, data.corpus.tgt_len, cfg.train.batch_tokens, cfg.train.seed
    )
    torch.manual_seed(0)
    for batch, plan in zip(got, stream):
        expected = data.corpus.collate(plan.indices).padded_to(plan.shape)
        expected.src = drop_final_punctuation(expected.src, data.punctuation, 0.5)
        for name in ("src", "tgt_in", "tgt_out"):
            assert torch.equal(getattr(batch, name), getattr(expected, name))
    assert data.stream.batches_done == 12 == stream.batches_done


def test_a_batch_draws_the_same_in_the_thread_directly_and_in_another_pass(corpus, tmp_path):
    data = TrainingData(sampling_config(corpus, 0.2), tmp_path, Group(), False)
    direct = [data.batch(plan).src for plan in islice(data.stream.plans(0, 0), 20)]
    again = [data.batch(plan).src for plan in islice(data.stream.plans(0, 0), 20)]
    updates = data.updates(Group(), 2)
    threaded = [b.src for update in islice(updates, 10) for b in update.batches]
    assert sampling_threads()
    updates.close()
    assert not sampling_threads()
    assert data.stream.batches_done + data.stream.epoch * len(data.stream.epoch_order(0)) == 20
    for a, b, c in zip(direct, again, threaded, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    # Two ranks of two take the same batches, drawn the same, as one process does.
    for rank in range(2):
        fresh = TrainingData(sampling_config(corpus, 0.2), tmp_path, Group(), False)
        updates = fresh.updates(Group(rank=rank, world_size=2), 1)
        for k, update in enumerate(islice(updates, 10)):
            assert torch.equal(update.batches[0].src, direct[2 * k + rank])
        updates.close()


def test_an_error_in_the_batch_thread_is_raised_where_its_update_is_taken(
    corpus, tmp_path, monkeypatch
):
    data = TrainingData(sampling_config(corpus, 0.2), tmp_path, Group(), False)
    made = []

    def failing(src, width, rng):
        made.append(1)
        if len(made) == 3:
            raise DamagedCorpus(tmp_path, "src.bin ends before byte 12")
        return src

    monkeypatch.setattr(data.sampler, "resegment", failing)
    updates = data.updates(Group(), 1)
    next(updates), next(updates)
    with pytest.raises(DamagedCorpus, match="ends before byte 12"):
        next(updates)
    assert not sampling_threads()


def test_resume_with_sampling_equals_an_uninterrupted_run(corpus, tmp_path):
    """Punctuation dropout too: its draws share torch's generator with dropout."""
    cpu = torch.device("cpu")
    settings = ("data.drop_final_punct=0.5",)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for run in (whole, parts):
        run.mkdir()
    cfg = sampling_config(corpus, 0.3, *settings, max_steps=30, eval_every=10)
    build_trainer(cfg, whole, cpu).run()
    assert not sampling_threads()
    first = sampling_config(corpus, 0.3, *settings, max_steps=13, eval_every=10)
    build_trainer(first, parts, cpu).run()
    assert load_checkpoint(parts / "last.pt")["batches_done"] > 0  # within the second epoch
    build_trainer(cfg, parts, cpu, resume=True).run()
    a, b = (load_checkpoint(run / "last.pt") for run in (whole, parts))
    assert a["step"] == b["step"] == 30
    assert (a["epoch"], a["batches_done"]) == (b["epoch"], b["batches_done"])
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    write_config(parts, cfg)  # what `mtrain train` writes, and `mtrain info` and a resume read
    assert "src_sampling_alpha: 0.3" in (parts / "config.yaml").read_text()


@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_stops_the_batch_thread_and_the_same_command_resumes(corpus, tmp_path, signals):
    """Once: a checkpoint at the next update, then a resume; twice: a stop at once."""
    run, log = tmp_path / "run", tmp_path / "stderr"
    settings = [*overrides(corpus, max_steps=100000, eval_every=3), "data.src_sampling_alpha=0.3"]
    stop_and_finish(run, settings, log, [signal.SIGINT] * signals)


def test_a_negative_alpha_is_refused_naming_the_key(corpus):
    with pytest.raises(ConfigError, match=r"data\.src_sampling_alpha: must not be negative"):
        sampling_config(corpus, -0.5)
    with pytest.raises(ConfigError, match=r"data\.src_sampling_alpha: needs tokenizer"):
        sampling_config(corpus, 0.5, "tokenizer.model_type=bpe")


def test_sampling_leaves_the_prepared_corpus_as_it_is(corpus):
    assert prepared_dir(sampling_config(corpus, 0.5)) == prepared_dir(sampling_config(corpus, 0))
