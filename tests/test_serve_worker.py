"""`mtrain serve`'s worker: bounded options, a worker that survives, deadlines, hang-ups, turns,
and numbers that break arithmetic."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request

from mtrain.core import config
from mtrain.core.config import MAX_ALPHA, ConfigError, DecodeConfig
from mtrain.decoding.translator import Source
from mtrain.serve import api
from mtrain.serve.api import ApiError, Limits, SearchOptions
from mtrain.serve.app import Server
from mtrain.serve.batcher import Batcher, Job, Pace, Policy, PolicyError, WorkerDown
from mtrain.serve.service import Decoded

from .console import mtrain
from .test_serve import GREEDY, LENIENT, Answers, Model, Served, held_batcher, job

BEAM16 = SearchOptions(beam=16, alpha=0.6)


# Options and the worker's survival ------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_wait", 1e10),
        ("max_wait", float("nan")),
        ("max_queue", 10),
        ("deadline", 0.0),
        ("batch_seconds", 0.0),
        ("batch_seconds", 1e9),
        ("batch_seconds", float("nan")),
    ],
)
def test_the_policy_refuses_numbers_out_of_its_ranges(field, value):
    with pytest.raises(PolicyError, match=field):
        Policy(**{field: value})


@pytest.mark.parametrize(
    "args, option",
    [
        (["serve", "--wait-ms", "1e13"], "--wait-ms"),
        (["serve", "--queue", "10"], "--queue"),
        (["serve", "--deadline", "1e300"], "--deadline"),
        (["serve", "--batch-seconds", "0"], "--batch-seconds"),
        (["serve", "--batch-seconds", "1e9"], "--batch-seconds"),
        (["translate", "--alpha", "1e308"], "--alpha"),
        (["eval", "--alpha", "300"], "--alpha"),
    ],
)
def test_commands_refuse_an_option_out_of_range_in_one_line(args, option):
    result = mtrain(*args, "--run", "/nonexistent")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"Invalid value for '{option}'" in result.stderr, result.stderr


def test_the_config_bounds_alpha_with_the_api_range():
    raw = config.Config().to_dict()
    raw["decode"]["alpha"] = 300.0
    with pytest.raises(ConfigError, match=r"decode\.alpha"):
        config.from_dict(raw, "x.yaml")
    with pytest.raises(ApiError) as refused:
        api.translate_request({"text": "a", "alpha": 300}, DecodeConfig(), Limits())
    assert refused.value.status == 422 and f"{MAX_ALPHA:g}" in refused.value.message


def test_a_worker_whose_work_raises_fails_those_requests_and_serves_the_next():
    """A job the worker cannot take apart (an answer callback that raises, a budget list too
    short) costs its own request, never the thread."""
    model, answers = Model(), Answers()
    batcher = Batcher(model, Policy(batching=False))

    def broken_callback(result):
        raise RuntimeError("the event loop is closed")

    batcher.submit(Job(GREEDY, ["a"], [2], broken_callback))
    batcher.submit(Job(GREEDY, ["b", "c"], [2], answers.done("short")))  # one token count
    batcher.submit(job(["next"], GREEDY, answers, "next"))
    results = answers.wait(2)
    assert isinstance(results["short"], IndexError)
    assert results["next"] == ["next/1"] and batcher.alive
    batcher.close()


class FakeService:
    """What the app needs of a service, around a model that counts and holds its batches."""

    def __init__(self, model):
        self.model = model
        self.cfg = SimpleNamespace(data=SimpleNamespace(max_src_len=64))
        self.base = SimpleNamespace(decode=DecodeConfig(beam_size=1))
        self.can_explain = False
        self.run, self.step = Path("no-run"), None  # no training view, no checkpoint step

    def describe(self):
        return {}

    def sources(self, texts):
        return [Source([7] * 3, False) for _ in texts]

    def translate(self, sources, options):
        texts = self.model(sources, options)
        return [Decoded([SimpleNamespace(text=t, score=None)], None) for t in texts]


def app_server(model, policy: Policy) -> Server:
    service = FakeService(model)
    server = Server(service, policy, Limits())
    server.batcher = Batcher(service.translate, policy)
    return server


def post(body: dict, hang_up: asyncio.Event | None = None) -> Request:
    """A POST /translate whose client, once its body is read, hangs up when `hang_up` is set."""
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    hang_up = hang_up or asyncio.Event()

    async def receive():
        if messages:
            return messages.pop(0)
        await hang_up.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/translate", "headers": []}
    return Request(scope, receive)


def answer(response) -> tuple[int, dict]:
    return response.status_code, json.loads(response.body)


def test_a_dead_worker_makes_health_503_and_refuses_work():
    def translate(sentences, options):
        raise SystemExit("gone")  # not an Exception: it ends the thread

    server = app_server(translate, Policy())
    server.batcher.submit(job(["a"], GREEDY, Answers(), "a"))
    server.batcher.thread.join(30)
    status, health = answer(asyncio.run(server.health(post({}))))
    assert status == 503 and health["status"] == "down" and "SystemExit" in health["error"]
    with pytest.raises(WorkerDown):
        server.batcher.submit(job(["b"], GREEDY, Answers(), "b"))
    status, refused = answer(asyncio.run(server.translate(post({"text": "b"}))))
    assert status == 503 and "SystemExit" in refused["error"]


def test_past_the_deadline_a_started_request_gets_504_and_a_waiting_one_503():
    model = Model()
    model.release.clear()
    server = app_server(model, Policy(batch_tokens=1, deadline=1.0))

    async def both():
        started = asyncio.create_task(server.translate(post({"text": ["a", "b"]})))
        await asyncio.to_thread(model.entered.wait, 30)  # "a" is in hand, "b" is not
        waiting = asyncio.create_task(server.translate(post({"text": "c"})))
        return await started, await waiting

    (late, late_body), (busy, busy_body) = (answer(r) for r in asyncio.run(both()))
    model.release.set()
    assert late == 504 and busy == 503, (late_body, busy_body)
    assert server.batcher.waiting == 0  # neither is decoded any further
    server.batcher.close()
    assert [s for s, _ in model.batches] == [[Source([7] * 3, False)]]


# Abandoned work and turns -----------------------------------------------------------------------


def test_a_request_whose_client_hangs_up_is_not_decoded_further():
    """One sentence a batch: the first is in hand when the client goes; the other 49 are never
    decoded, and the next request is answered after that one batch."""
    model = Model()
    model.release.clear()
    server = app_server(model, Policy(batch_tokens=1))

    async def scenario():
        hang_up = asyncio.Event()
        big = asyncio.create_task(server.translate(post({"text": ["x"] * 50}, hang_up)))
        await asyncio.to_thread(model.entered.wait, 30)
        hang_up.set()
        gone = await big  # the handler returns as soon as it notices
        model.release.set()
        return gone, await server.translate(post({"text": "next"}))

    gone, after = asyncio.run(scenario())
    assert answer(after)[0] == 200 and gone.status_code == 499
    server.batcher.close()
    assert [len(s) for s, _ in model.batches] == [1, 1]
    assert server.batcher.decoded == 2


def test_a_request_with_other_options_waits_at_most_one_batch():
    """Requests take turns whatever their options: a greedy sentence queued behind a 256-sentence
    beam-16 request rides in the batch after the one in hand."""
    batcher, model, answers = held_batcher(Policy(batch_tokens=160, max_wait=0.0))
    batcher.submit(job(["w"] * 256, BEAM16, answers, "big", [10] * 256))
    batcher.submit(job(["small"], GREEDY, answers, "small", [10]))
    model.release.set()
    answers.wait(3)
    options = [o for _, o in model.batches]
    assert options[:3] == [GREEDY, BEAM16, GREEDY] and model.batches[2][0] == ["small"]
    assert all(len(t) == 1 for t, o in model.batches if o == BEAM16)  # 160 // 16: one sentence
    batcher.close()


def test_a_cancelled_job_leaves_the_queue_and_its_answer_is_dropped():
    batcher, model, answers = held_batcher(Policy(max_wait=0.0))
    waiting = job(["w1", "w2"], GREEDY, answers, "waiting")
    batcher.submit(waiting)
    batcher.cancel(waiting)
    assert batcher.waiting == 0
    batcher.submit(job(["after"], GREEDY, answers, "after"))
    model.release.set()
    assert set(answers.wait(2)) == {"first", "after"}
    batcher.close()
    assert [t for t, _ in model.batches] == [["first"], ["after"]]


# Batches bounded in time --------------------------------------------------------------------------

SLOW, FAST = 0.01, 0.0001  # seconds a source token at beam 16 and greedy


class Paced(Model):
    """A model whose batches take `per_token[beam]` seconds a source token on its own clock;
    a sentence is its token count. `during[n]` runs inside the n-th call."""

    def __init__(self, per_token: dict[int, float]):
        super().__init__()
        self.per_token, self.now = per_token, 0.0
        self.during: dict[int, Callable[[], None]] = {}

    def clock(self) -> float:
        return self.now

    def __call__(self, sentences: list[int], options: SearchOptions) -> list[str]:
        self.during.get(len(self.batches) + 1, lambda: None)()
        texts = super().__call__(sentences, options)
        self.now += self.per_token[options.beam] * sum(sentences)
        return texts


def sizes(model: Model, options: SearchOptions) -> list[int]:
    return [len(s) for s, o in model.batches if o == options]


@pytest.mark.parametrize("seconds, per_batch", [(0.5, 5), (0.05, 1)])
def test_once_a_beam_is_timed_its_batches_hold_what_decodes_in_batch_seconds(seconds, per_batch):
    """The first beam-16 batch holds 4000 / 16 tokens; the later ones batch_seconds / pace
    (0.5 s at 0.01 s a token: 50 tokens), and never less than one sentence."""
    model, answers = Paced({16: SLOW}), Answers()
    batcher = Batcher(
        model, Policy(batch_seconds=seconds, max_wait=0.0, batch_tokens=4000), clock=model.clock
    )
    batcher.submit(job([10] * 100, BEAM16, answers, "big", [10] * 100))
    assert answers.wait(1)["big"] == ["10/16"] * 100
    batcher.close()
    assert sizes(model, BEAM16) == [25] + [per_batch] * (75 // per_batch)


def test_a_fast_beam_is_not_bounded_by_a_slow_ones_pace():
    """Greedy batches take turns with beam-16 ones and keep their 4000 tokens (0.4 s at their
    own pace), where the beam-16 pace would allow 50."""
    model, answers = Paced({16: SLOW, 1: FAST}), Answers()
    model.release.clear()
    batcher = Batcher(
        model, Policy(max_wait=0.0, max_queue=2048, batch_tokens=4000), clock=model.clock
    )
    batcher.submit(job([10] * 100, BEAM16, answers, "slow", [10] * 100))
    assert model.entered.wait(30)
    batcher.submit(job([10] * 1000, GREEDY, answers, "fast", [10] * 1000))
    model.release.set()
    answers.wait(2)
    batcher.close()
    assert sizes(model, GREEDY) == [400, 400, 200]
    assert sizes(model, BEAM16)[:4] == [25, 5, 5, 5]


def test_a_greedy_request_sent_during_a_beam_16_batch_waits_two_batch_seconds_at_most():
    """Sent while a beam-16 batch runs, a greedy sentence waits for the rest of it and one more
    (the big request went back to the queue ahead of it), each within batch_seconds: 1 s, where
    batches of 4000 / 16 tokens would take 2.5 s each."""
    model, answers = Paced({16: SLOW, 1: FAST}), Answers()
    policy = Policy(max_wait=0.0, batch_tokens=4000)
    batcher = Batcher(model, policy, clock=model.clock)
    light: dict[str, float] = {}

    def answered(result):
        light["answered"] = model.now
        answers.done("light")(result)

    def send_light():
        light["sent"] = model.now
        batcher.submit(Job(GREEDY, [10], [10], answered))

    model.during[2] = send_light  # the first batch timed beam 16: the second is bounded
    batcher.submit(job([10] * 256, BEAM16, answers, "big", [10] * 256))
    answers.wait(2)
    batcher.close()
    assert light["answered"] - light["sent"] <= 2 * policy.batch_seconds + FAST * 10 + 1e-9


def test_the_pace_follows_a_model_that_slows_down():
    pace, tokens = Pace(), []
    pace.record(BEAM16, 0.5, 50)
    for _ in range(10):
        tokens.append(pace.tokens_within(BEAM16, 0.5, 250))
        pace.record(BEAM16, 1.0, 50)
    assert tokens[0] == 50 and tokens == sorted(tokens, reverse=True) and 25 <= tokens[-1] < 27
    assert pace.tokens_within(GREEDY, 0.5, 4000) == 4000  # not timed yet: the token budget


# Numbers that break arithmetic -------------------------------------------------------------------

FIELDS = ["beam", "alpha", "nbest", "top_k", "x"]
NUMBERS = st.one_of(
    st.builds(lambda sign, n: sign + "9" * n, st.sampled_from(["", "-"]), st.integers(1, 6000)),
    st.sampled_from(["1e308", "-1e308", "1e400", "1e-400", "0.0", "-0.0", "3.5", "10", "11"]),
)


@LENIENT
@given(st.sampled_from(FIELDS), NUMBERS, st.booleans())
def test_any_number_in_any_field_is_a_request_or_a_422(field, number, in_list):
    value = f"[{number}]" if in_list else number
    body = f'{{"text": "我", "{field}": {value}}}'.encode()
    for parse in (api.translate_request, api.explain_request):
        try:
            request = parse(api.parse_body(body), DecodeConfig(), Limits())
        except ApiError as e:
            assert e.status == 422 and "\n" not in e.message and len(e.message) < 200
            continue
        assert 0 <= request.options.alpha <= MAX_ALPHA


def test_a_5000_digit_integer_is_a_422_not_a_500():
    body = b'{"text": ["a", ' + b"1" * 5000 + b'], "beam": 4}'
    with pytest.raises(ApiError) as refused:
        api.translate_request(api.parse_body(body), DecodeConfig(), Limits())
    assert refused.value.status == 422 and "5000-digit" in refused.value.message


# The real server -------------------------------------------------------------------------------


def test_a_client_that_hangs_up_costs_no_more_batches(run_dir):
    """A 256-sentence beam-16 request over a real socket, cut once its first batch is taken:
    its queue empties at once and most of its sentences are never decoded."""
    served = Served(run_dir)
    try:
        sentences = [f"我是谁{i}" * 3 for i in range(256)]
        body = json.dumps({"text": sentences, "beam": 16}).encode()
        client = socket.create_connection((served.host, served.port))
        client.sendall(
            b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        health = wait_for(served, lambda h: h["decoded"] > 0)
        client.close()
        health = wait_for(served, lambda h: h["queued"] == 0)
        assert health["decoded"] < 256, health
        status, answer = served.post("/translate", {"text": "我是谁"})
        assert status == 200 and answer["translations"][0]["text"]
    finally:
        status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr and "failed" not in stderr, stderr


def wait_for(served: Served, condition, seconds: float = 120) -> dict:
    """/health once `condition` holds of it."""
    deadline = time.monotonic() + seconds
    while True:
        status, health = served.request("GET", "/health")
        if status == 200 and condition(health):
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.05)  # between two looks at /health: the condition is what is waited for
