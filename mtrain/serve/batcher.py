"""Dynamic batching: sentences of concurrent requests decoded together on one worker thread.

Requests wait in a bounded queue and take turns: the worker takes the request at the head of the
queue and gathers, one sentence per request in turn, the sentences of every waiting request with
the same search options until the token budget is spent; the requests it took from that still
have sentences go to the back of the queue. A one-sentence request therefore waits at most one
batch behind a request of hundreds of sentences, whatever the options of either. A batch is also
bounded in time: the worker learns the seconds per source token of each beam size's batches and
caps a batch's tokens at what it decodes in `batch_seconds`, so that one batch at beam 16 does not
hold a greedy sentence for seconds.

Before a batch it waits for company: for as many new requests as the last batch answered,
at most `max_wait` after the head request arrived or after the last batch's answers went back,
whichever is later. On a busy server the clients a batch has just answered send their next
sentences within milliseconds; waiting for them lets them share the next batch with those that
queued during this one, where they would otherwise make a small batch of their own after it
(16 clients: 14.3 sentences a batch, against 7.7 in batches of 10 and 6 in turn). A lone client
never waits: its one answered request has come back as soon as it sends again.

All model work, solo jobs (/explain) included, runs on the one thread: the model is not shared.
An exception in that thread fails the requests in hand and the worker goes on; a request whose
client has gone is cancelled, and its sentences not taken yet are never decoded.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mtrain.core.config import DecodeConfig
from mtrain.serve.api import Limits, SearchOptions

log = logging.getLogger(__name__)

Done = Callable[[Any], None]  # receives the result, or the exception that stopped the job


class QueueFull(Exception):
    """More sentences are waiting than the queue holds."""


class Closed(Exception):
    """The batcher is shutting down and takes no more work."""


class WorkerDown(Exception):
    """The worker thread has stopped: nothing queued would ever be decoded."""


class PolicyError(ValueError):
    """A batching option out of its range."""


@dataclass(eq=False)  # a job is itself: queue removal is by identity
class Job:
    """One request's sentences, waiting for their translations."""

    options: SearchOptions
    sentences: list[Any]  # what `translate` takes, one item a sentence
    tokens: list[int]  # each sentence's source length, for the budget
    done: Done
    arrived: float = field(default_factory=time.monotonic)
    results: list[Any] = field(init=False)
    taken: int = 0  # sentences handed to the worker so far, in order
    left: int = field(init=False)  # sentences not translated yet; -1 once failed or cancelled

    def __post_init__(self) -> None:
        self.results = [None] * len(self.sentences)
        self.left = len(self.sentences)


@dataclass(eq=False)
class Solo:
    """Work that runs alone on the worker thread: fn() is passed to done."""

    fn: Callable[[], Any]
    done: Done
    arrived: float = field(default_factory=time.monotonic)
    taken: int = 0  # 1 once the worker runs it


def _bounded(default: float, low: float, high: float) -> Any:
    return field(default=default, metadata={"range": (low, high)})


@dataclass(frozen=True)
class Policy:
    """How requests are batched and how long they may wait: each number within its range,
    the one place `mtrain serve`'s options take their bounds from."""

    batching: bool = True  # False: each request decoded on its own
    max_wait: float = _bounded(0.02, 0.0, 60.0)  # seconds a batch waits for company (see the top)
    # source tokens in one call of the translator: the run's decode.batch_tokens
    batch_tokens: int = _bounded(DecodeConfig.batch_tokens, 1, 1 << 20)
    # sentences waiting, beyond which requests are refused; one request must fit
    max_queue: int = _bounded(1024, Limits.max_sentences, 1 << 20)
    deadline: float = _bounded(300.0, 1.0, 86400.0)  # seconds a request waits for its answer
    batch_seconds: float = _bounded(0.5, 0.01, 600.0)  # a batch's expected decoding time, at most

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if "range" in f.metadata:
                low, high = f.metadata["range"]
                value = getattr(self, f.name)
                if not low <= value <= high:  # NaN too
                    raise PolicyError(f"{f.name} must be between {low} and {high}, not {value}")

    @classmethod
    def range(cls, name: str) -> tuple[float, float]:
        """The (lowest, highest) value the option `name` may take."""
        return next(f.metadata["range"] for f in dataclasses.fields(cls) if f.name == name)


# translate(sentences, options) -> one result per sentence, in order
Translate = Callable[[list[Any], SearchOptions], list[Any]]


class Pace:
    """Seconds per source token of each beam size's batches, an exponentially weighted mean."""

    WEIGHT = 0.3  # of the newest batch: it follows a model that slows, a few outweigh one outlier

    def __init__(self) -> None:
        # By beam size, which sets the cost and takes few values: alpha, any float, would let
        # clients grow the table without end.
        self.per_token: dict[int, float] = {}

    def record(self, options: SearchOptions, seconds: float, tokens: int) -> None:
        """Count one batch of `tokens` source tokens that took `seconds`."""
        rate = max(seconds, 0.0) / max(tokens, 1)
        old = self.per_token.get(options.beam)
        self.per_token[options.beam] = rate if old is None else old + self.WEIGHT * (rate - old)

    def tokens_within(self, options: SearchOptions, seconds: float, most: int) -> int:
        """Source tokens a batch decodes in `seconds`, at most `most` (all of it until measured)."""
        rate = self.per_token.get(options.beam)
        if not rate:  # no batch measured yet, or too fast to measure
            return most
        return int(min(most, seconds / rate))


def _size(job: Job | Solo) -> int:
    """Sentences a job holds: a solo job counts as one."""
    return len(job.sentences) if isinstance(job, Job) else 1


def _jobs(batch: list[tuple[Job, int]]) -> list[Job]:
    """The jobs a batch takes sentences from, in their order."""
    return list(dict.fromkeys(job for job, _ in batch))


class TurnQueue:
    """The jobs waiting, in turn, and the sentences each batch takes from them. Not locked:
    the `Batcher` calls it holding its lock."""

    def __init__(self, policy: Policy, pace: Pace):
        self.policy, self.pace = policy, pace
        self.pending: deque[Job | Solo] = deque()
        self.waiting = 0  # sentences queued and not taken yet
        self.decoded = 0  # sentences handed to `translate` so far

    def add(self, job: Job | Solo) -> None:
        """Queue a job at the back; QueueFull if its sentences do not fit."""
        size = _size(job)
        if self.waiting and self.waiting + size > self.policy.max_queue:
            raise QueueFull
        self.pending.append(job)
        self.waiting += size

    def drop(self, job: Job | Solo) -> None:
        """Take a job out of the queue and mark it over."""
        if job in self.pending:
            self.pending.remove(job)
            self.waiting -= _size(job) - job.taken
        if isinstance(job, Job):
            job.left = -1

    def clear(self) -> list[Job | Solo]:
        """Empty the queue; return what it held."""
        dropped = list(self.pending)
        self.pending.clear()
        self.waiting = 0
        return dropped

    def take_solo(self) -> Solo:
        """Take the solo job at the head of the queue."""
        solo = self.pending.popleft()
        assert isinstance(solo, Solo)
        self.waiting -= 1
        solo.taken = 1
        return solo

    def budget(self, head: Job) -> int:
        """Source tokens in head's batch: the policy's, shared by the beams, as the translator
        shares them, and no more than it decodes in `batch_seconds` at its pace so far."""
        tokens = self.policy.batch_tokens // head.options.beam
        # Always, not only while others wait: a light request mostly comes while a batch runs.
        return max(self.pace.tokens_within(head.options, self.policy.batch_seconds, tokens), 1)

    def company(self, head: Job) -> list[Job]:
        """The queued jobs that may share head's batch: head first."""
        if not self.policy.batching:
            return [head]
        return [j for j in self.pending if isinstance(j, Job) and j.options == head.options]

    def tokens(self, head: Job) -> int:
        """Source tokens not taken yet of the jobs that may share head's batch."""
        return sum(sum(j.tokens[j.taken :]) for j in self.company(head))

    def take(self, head: Job) -> list[tuple[Job, int]]:
        """Sentences for one batch, one per job in turn, within the token budget (at least one).

        The jobs taken from go to the back of the queue: requests take turns, whatever their
        options.
        """
        jobs, batch, tokens, budget = self.company(head), [], 0, self.budget(head)
        while jobs:
            for job in list(jobs):
                cost = job.tokens[job.taken]
                if batch and tokens + cost > budget:
                    jobs = []
                    break
                batch.append((job, job.taken))
                tokens += cost
                job.taken += 1
                if job.taken == len(job.sentences):
                    jobs.remove(job)
        for job in _jobs(batch):
            self.pending.remove(job)
            if job.taken < len(job.sentences):
                self.pending.append(job)
        self.waiting -= len(batch)
        self.decoded += len(batch)
        return batch


class Batcher:
    """A bounded queue of requests (`TurnQueue`, under this lock) and the one thread that
    decodes them in batches."""

    def __init__(
        self, translate: Translate, policy: Policy, clock: Callable[[], float] = time.monotonic
    ):
        self.translate, self.policy = translate, policy
        self.clock = clock  # times the batches for `pace`
        self.pace = Pace()
        self.queue = TurnQueue(policy, self.pace)
        self.closed = False
        self.batches = 0  # calls of `translate` so far
        self.free_since = 0.0  # when the worker last handed back a batch's answers
        self.answered = 0  # requests that batch answered in full
        self.returned = 0  # requests queued since: the company expected is `answered`
        self.in_hand: list[Job | Solo] = []  # what the worker works on: failed if it raises
        self.stopped: str | None = None  # why the worker thread ended, if it did
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._work, name="mtrain-batcher", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def waiting(self) -> int:  # sentences queued and not taken yet
        return self.queue.waiting

    @property
    def decoded(self) -> int:  # sentences handed to `translate` so far
        return self.queue.decoded

    def submit(self, job: Job | Solo) -> None:
        """Queue a job; its `done` is called on the worker thread. QueueFull, Closed,
        WorkerDown if not."""
        with self.cond:
            if self.closed:
                raise Closed
            if not self.alive:
                raise WorkerDown(self.stopped or "the worker thread has stopped")
            self.queue.add(job)
            self.returned += isinstance(job, Job)
            self.cond.notify()

    def cancel(self, job: Job | Solo) -> None:
        """Forget a job whose answer nobody waits for: what it has not handed over yet is
        never decoded, and its `done` is not called."""
        with self.cond:
            self.queue.drop(job)

    def close(self) -> None:
        """Refuse new work, fail what is still queued, let the batch in hand finish."""
        with self.cond:
            self.closed = True
            dropped = self.queue.clear()
            self.cond.notify()
        for job in dropped:
            self._settle(job.done, Closed())
        self.thread.join()

    def _work(self) -> None:
        """Decode until closed. An exception fails the jobs in hand and the worker goes on;
        anything that ends the thread is recorded for /health and fails what waits."""
        try:
            while True:
                try:
                    work = self._next()
                    if work is None:
                        return
                    if isinstance(work, Solo):
                        self._finish(work.done, work.fn)
                    else:
                        self._run(*work)
                except Exception as e:
                    log.error("mtrain serve: decoding failed: %s: %s", type(e).__name__, e)
                    self._fail(e)
        except BaseException as e:
            self.stopped = f"the worker thread stopped: {type(e).__name__}: {e}"
            log.error("mtrain serve: %s", self.stopped)
            with self.cond:
                dropped = list(dict.fromkeys([*self.in_hand, *self.queue.clear()]))
            for job in dropped:
                self._settle(job.done, WorkerDown(self.stopped))

    def _fail(self, error: Exception) -> None:
        """Fail every job in hand with `error`."""
        with self.cond:
            failed = [j for j in self.in_hand if not (isinstance(j, Job) and j.left < 0)]
            for job in failed:
                self.queue.drop(job)
            self.in_hand = []
        self._answer([(job, error) for job in failed])

    @staticmethod
    def _settle(done: Done, result: Any) -> None:
        """Hand a result over; a callback that fails costs one log line, not the worker."""
        try:
            done(result)
        except Exception as e:
            log.error("mtrain serve: answering failed: %s: %s", type(e).__name__, e)

    def _finish(self, done: Done, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except Exception as e:  # handed to the request, which answers 500
            result = e
        self.in_hand = []
        self._settle(done, result)

    def _next(self) -> Solo | tuple[SearchOptions, list[tuple[Job, int]]] | None:
        """The next work: a solo job, or a batch of (job, sentence index); None once closed."""
        pending = self.queue.pending
        with self.cond:
            while True:
                while not pending and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return None
                head = pending[0]
                self.in_hand = [head]
                if isinstance(head, Solo):
                    return self.queue.take_solo()
                if self.policy.batching:
                    self._wait_for_company(head)
                    if self.closed:
                        return None
                if head in pending:  # else it was cancelled while it waited: start again
                    batch = self.queue.take(head)
                    self.in_hand = _jobs(batch)
                    return head.options, batch

    def _wait_for_company(self, head: Job) -> None:
        """Wait (holding the lock) for the clients the last batch answered, up to max_wait."""
        deadline = max(head.arrived, self.free_since) + self.policy.max_wait
        while (
            not self.closed
            and self.returned < self.answered
            and head in self.queue.pending
            and self.queue.tokens(head) < self.queue.budget(head)
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.cond.wait(left)

    def _run(self, options: SearchOptions, batch: list[tuple[Job, int]]) -> None:
        start = self.clock()
        results = self.translate([job.sentences[i] for job, i in batch], options)
        self.pace.record(options, self.clock() - start, sum(job.tokens[i] for job, i in batch))
        self.batches += 1
        finished = []
        with self.cond:  # a job cancelled meanwhile is not answered
            for (job, i), result in zip(batch, results, strict=True):
                if job.left < 0:
                    continue
                job.results[i] = result
                job.left -= 1
                if job.left == 0:
                    finished.append((job, job.results))
            self.in_hand = []
        self._answer(finished)

    def _answer(self, answers: list[tuple[Job | Solo, Any]]) -> None:
        """Hand each finished job its result, and start counting the requests that come back.

        The count starts before the first answer goes: a client may send again at once.
        """
        with self.cond:
            self.free_since, self.answered, self.returned = time.monotonic(), len(answers), 0
        for job, result in answers:
            self._settle(job.done, result)
