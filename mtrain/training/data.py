"""What a run trains on: the prepared corpus, the tokenizer, the dev set and the updates.

The one place where training reads its data. The rest of training asks a `TrainingData` for
its tokenizer, its dev set, its next updates, the position of its batch stream and the
fingerprints of its corpora, and knows nothing of how they are read or stored.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtrain.core.config import Config
from mtrain.core.distributed import Group
from mtrain.core.files import write_atomic
from mtrain.data.batching import BatchPlan, BatchStream
from mtrain.data.corpus import DataError, corpora, read_pairs
from mtrain.data.pairs import Batch, encode_pairs, group_references
from mtrain.data.prepare import prepare
from mtrain.data.prepared import data_digests, identity
from mtrain.data.subword_sampling import SourceSampler, planned_lengths
from mtrain.data.token_corpus import TokenCorpus, drop_final_punctuation
from mtrain.data.tokenizer import SRC_MODEL, TGT_MODEL, Tokenizer, too_long
from mtrain.run.directory import CheckpointError, check_corpora
from mtrain.run.lineage import Parent

log = logging.getLogger(__name__)
# Updates the batch thread builds ahead: one is enough to hide its work behind an update's.
PREFETCH = 1


@dataclass
class Update:
    """What one process trains on in one optimizer update."""

    batches: list[Batch]  # this process's share: `train.accumulate` batches
    n_target: int  # target tokens of the whole update, on every process
    n_tokens: int  # source and target tokens of the whole update, for the tokens/s shown

    @classmethod
    def of(cls, batches: list[Batch]) -> Update:
        """An update of one process alone."""
        n_target = sum(batch.n_target_tokens for batch in batches)
        return cls(batches, n_target, sum(batch.n_tokens for batch in batches))


class TrainingData:
    """The tokenizer, the prepared training corpus and its stream of batches, the dev set."""

    def __init__(
        self, cfg: Config, run_dir: Path, group: Group, resume: bool, parent: Parent | None = None
    ):
        """Every process opens the prepared corpus (rank 0 prepares it first) and reads the
        dev set; rank 0 puts the tokenizer into `run_dir` (or checks the run's own). A run
        built on another (`parent`) encodes its corpus with the parent's tokenizer."""
        dcfg = cfg.data
        self.corpus, self.tokenizer = prepared_corpus(cfg, run_dir, group, resume, parent)
        # A resumed run must read the same data, or it would not continue the same run.
        self.fingerprints = data_digests(self.corpus.manifest)
        self.paths = {"train": dcfg.train, "dev": dcfg.dev, "test": dcfg.test}
        (dev,) = corpora(dcfg.dev, dcfg.swap_columns)
        dev_pairs = read_pairs(dev, dcfg.src_lang, dcfg.tgt_lang, scored=True)
        if not any(s and t for s, t in dev_pairs):
            raise DataError(f"{dev}: no sentence pairs with both sides non-empty")
        self.dev_examples = encode_pairs(
            self.tokenizer, dev_pairs, dcfg.max_src_len, dcfg.max_tgt_len
        )
        self.dev_sources, self.dev_refs = group_references(dev_pairs)
        warn_truncated(self.tokenizer, self.dev_sources, dcfg.max_src_len, str(dev))
        self.drop_final_punct = dcfg.drop_final_punct
        self.punctuation = torch.tensor(self.tokenizer.src_punctuation_ids(), dtype=torch.long)
        tcfg = cfg.train
        self.sampler, src_len = None, self.corpus.src_len
        if dcfg.src_sampling_alpha:
            proto = self.tokenizer.src.serialized_model_proto()
            self.sampler = SourceSampler(proto, dcfg.src_sampling_alpha, tcfg.seed)
            src_len = planned_lengths(src_len, dcfg.max_src_len)  # room for longer cuts
        self.stream = BatchStream(src_len, self.corpus.tgt_len, tcfg.batch_tokens, tcfg.seed)
        log.info(
            "training batches in %d shapes, %.1f%% of their positions padding",
            len(self.stream.grid.shapes),
            100 * self.stream.grid.padding,
        )
        if group.active:  # numpy's random streams differ between builds: compare, not trust
            mine = (self.stream.order_digest(0), np.__version__)
            expected = group.broadcast(mine, startup=True)
            if mine[0] != expected[0]:
                raise DataError(
                    f"rank {group.rank}: the batch order differs from rank 0's (numpy "
                    f"{mine[1]} here, {expected[1]} there): give every machine the same numpy"
                )

    def updates(self, group: Group, accumulate: int) -> Iterator[Update]:
        """Yield this process's share of each optimizer update.

        An update is the next `world_size × accumulate` batches of the batch stream, which is
        the same on every process; process r trains on the r-th `accumulate` of them. So an
        update holds the same sentences whatever the number of processes, and updates run
        across epoch ends as they do in one process: no process ever runs short of batches.
        With subword sampling, a thread builds the next updates while this one trains; the
        stream's position moves only as each update is handed out, so a checkpoint holds the
        position of the updates trained. Close the iterator to stop the thread.
        """
        built = self.built_updates(group, accumulate)
        made = Prefetched(built, PREFETCH) if self.sampler else built
        try:
            for update, last in made:
                self.stream.passed(last)
                if self.drop_final_punct:  # here: its draws come from torch's generator
                    for batch in update.batches:
                        batch.src = drop_final_punctuation(
                            batch.src, self.punctuation, self.drop_final_punct
                        )
                yield update
        finally:
            made.close()

    def built_updates(self, group: Group, accumulate: int) -> Iterator[tuple[Update, BatchPlan]]:
        """This process's share of each update from the stream's position on, and the update's
        last batch of the stream (any process's), without moving the stream."""
        mine = slice(group.rank * accumulate, (group.rank + 1) * accumulate)
        stream = self.stream.plans(self.stream.epoch, self.stream.batches_done)
        while True:
            plans = [next(stream) for _ in range(group.world_size * accumulate)]
            # Counted on the host from the lengths: no wait for a GPU, no exchange between ranks.
            every = np.concatenate([plan.indices for plan in plans])
            n_target = int(self.corpus.tgt_len[every].sum(dtype=np.int64)) + len(every)
            n_source = int(self.corpus.src_len[every].sum(dtype=np.int64))
            batches = [self.batch(plan) for plan in plans[mine]]
            yield Update(batches, n_target, n_source + n_target), plans[-1]

    def batch(self, plan: BatchPlan) -> Batch:
        """A batch of the stream, read from the corpus (its sources cut afresh, with subword
        sampling) and padded to its shape."""
        batch = self.corpus.collate(plan.indices)
        if self.sampler:
            rng = self.sampler.generator(plan)
            batch.src = self.sampler.resegment(batch.src, plan.shape.src_len, rng)
        return batch.padded_to(plan.shape)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the data: its fingerprints and the stream's position."""
        manifest = self.corpus.manifest
        counts = {"pairs": manifest["pairs"], "tokens": manifest["tokens"]}
        return {"data": self.fingerprints, "corpus": counts, **self.stream.state_dict()}

    def check_unchanged(self, state: dict, path: Path) -> None:
        """Refuse to resume from the checkpoint `path` if a corpus changed since it was written,
        or was prepared with another tokenizer than the run's."""
        check_corpora(path, state, self.fingerprints, self.paths)
        if (
            state.get("tokenizer", self.corpus.manifest["tokenizer"])
            != self.corpus.manifest["tokenizer"]
        ):
            raise CheckpointError(
                f"{self.corpus.directory} was prepared with another tokenizer than {path}'s; "
                "resuming would not continue the same run (train into another --out)"
            )
        manifest = self.corpus.manifest
        counts = {"pairs": manifest["pairs"], "tokens": manifest["tokens"]}
        if state.get("corpus", counts) != counts:  # absent: written before checkpoints kept it
            raise CheckpointError(
                f"{self.corpus.directory} holds {counts['pairs']} pairs and other counts than "
                f"the corpus {path} was trained on: resuming would not continue the same run "
                "(train into another --out)"
            )
        epoch = state.get("epoch")
        if isinstance(epoch, int) and state.get("batch_order", "") not in (
            "",  # written before checkpoints kept it
            self.stream.order_digest(epoch),
        ):
            raise CheckpointError(
                f"{path}: epoch {epoch}'s batch order differs here from the one it was trained "
                f"in (numpy {np.__version__} here): resuming would not continue the same run "
                "(use the numpy it was trained with, or train into another --out)"
            )

    def load_state_dict(self, state: dict) -> None:
        """Take the batch stream back to where the checkpoint `state` left it."""
        self.stream.load_state_dict(state)


class Prefetched:
    """The items of a generator, made ahead in a thread of their own."""

    def __init__(self, items: Generator, depth: int):
        """Start making `items`, at most `depth` ahead of the ones taken."""
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._make, args=(items,), name="batches")
        self._thread.daemon = True  # a process that ends without closing it is not held up
        self._thread.start()

    def _make(self, items: Generator) -> None:
        try:
            for item in items:
                if not self._put((item, None)):
                    break
        except BaseException as e:  # raised where the item would have been taken
            self._put((None, e))
        finally:
            items.close()

    def _put(self, entry: tuple) -> bool:
        """Queue `entry` once there is room; False when closed first."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self) -> Any:
        item, error = self._queue.get()
        if error is not None:
            raise error
        return item

    def close(self) -> None:
        """Stop the thread; it ends once the item it is making is made."""
        self._stop.set()
        self._thread.join()


def warn_truncated(tokenizer: Tokenizer, sources: list[str], max_src_len: int, where: str) -> None:
    """Warn once, as the dev set is read, of the sources every validation will truncate."""
    cut = sum(too_long(ids, max_src_len) for ids in tokenizer.encode_src(sources))
    if cut:
        log.warning(
            "%s: %d source sentence(s) truncated to %d tokens at every validation",
            where,
            cut,
            max_src_len,
        )


def prepared_corpus(
    cfg: Config, run_dir: Path, group: Group, resume: bool, parent: Parent | None = None
) -> tuple[TokenCorpus, Tokenizer]:
    """The prepared training corpus and its tokenizer, the same on every process.

    Rank 0 prepares the corpus (or finds it prepared) and puts the tokenizer into the run
    directory. The other ranks then open the same prepared directory: on another machine
    without a shared disk they prepare it themselves, which gives the same bytes. Only rank 0
    reads the run directory.
    """
    pieces = parent_pieces(cfg, run_dir, group, resume, parent)
    if group.is_main:
        directory = prepare(cfg, tokenizer=pieces)
        corpus = TokenCorpus(directory)
    # The others wait here while rank 0 prepares: start-up, not bounded by --peer-timeout.
    expected = group.broadcast(identity(corpus.manifest) if group.is_main else None, startup=True)
    if not group.is_main:
        directory = prepare(cfg, progress=False, tokenizer=pieces)  # other ranks: errors only
        corpus = TokenCorpus(directory)
    if identity(corpus.manifest) != expected:  # the tokenizer's fingerprint included
        raise DataError(
            f"rank {group.rank}: {directory} differs from rank 0's prepared corpus: "
            "give every machine the same data files"
        )
    if resume and group.is_main:
        tokenizer = Tokenizer.load(run_dir)  # check_unchanged compares it with the corpus's
    else:
        tokenizer = Tokenizer.load(directory)
        if group.is_main:
            for name in (SRC_MODEL, TGT_MODEL):
                write_atomic(run_dir / name, (directory / name).read_bytes())
    log.info("training on %d pairs, prepared in %s", len(corpus), directory)
    return corpus, tokenizer


def parent_pieces(
    cfg: Config, run_dir: Path, group: Group, resume: bool, parent: Parent | None
) -> Tokenizer | None:
    """The tokenizer a run built on another encodes its corpus with, on every rank as rank 0
    has it: the parent's, or on a resume the run's own copy of it; None: the run trains its
    own."""
    if not cfg.train.init_from:
        return None
    mine = None
    if group.is_main:
        mine = Tokenizer.load(run_dir) if resume or parent is None else parent.tokenizer()
    return Tokenizer.from_protos(*group.broadcast(mine and mine.protos(), startup=True))
