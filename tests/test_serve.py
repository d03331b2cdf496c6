"""`mtrain serve`: the batcher and the request checks alone, then the real server over HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mtrain.cli import app
from mtrain.core.config import DecodeConfig
from mtrain.serve import api
from mtrain.serve.api import ApiError, Limits, SearchOptions
from mtrain.serve.app import endpoint
from mtrain.serve.batcher import Batcher, Closed, Job, Policy, QueueFull, Solo

from .console import REPO, mtrain

GREEDY = SearchOptions(beam=1, alpha=0.6)
BEAM = SearchOptions(beam=4, alpha=0.6, nbest=2)


# The batcher, with a stand-in for the model --------------------------------------------------


class Model:
    """A translate function that records its batches and can be held inside a call."""

    def __init__(self):
        self.batches: list[tuple[list[str], SearchOptions]] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()

    def __call__(self, texts: list[str], options: SearchOptions) -> list[str]:
        self.batches.append((texts, options))
        self.entered.set()
        self.release.wait()
        return [f"{t}/{options.beam}" for t in texts]


class Answers:
    """Collects each job's result; `wait` blocks until `n` have come."""

    def __init__(self):
        self.results: dict[str, object] = {}
        self.cond = threading.Condition()

    def done(self, name: str):
        def settle(result):
            with self.cond:
                self.results[name] = result
                self.cond.notify_all()

        return settle

    def wait(self, n: int) -> dict[str, object]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.results) >= n, timeout=30)
        return self.results


def job(texts, options, answers, name, tokens=None):
    return Job(options, texts, tokens or [len(t) + 1 for t in texts], answers.done(name))


def held_batcher(policy: Policy) -> tuple[Batcher, Model, Answers]:
    """A batcher whose model is held inside a first call, so that jobs pile up behind it.

    Its clock stands still: the hold is not the model's pace, and batches stay bounded by tokens.
    """
    model, answers = Model(), Answers()
    model.release.clear()
    batcher = Batcher(model, policy, clock=lambda: 0.0)
    batcher.submit(job(["first"], GREEDY, answers, "first"))
    assert model.entered.wait(30)
    return batcher, model, answers


def test_requests_waiting_together_are_decoded_together():
    batcher, model, answers = held_batcher(Policy(max_wait=0.0))
    for i in range(5):
        batcher.submit(job([f"a{i}", f"b{i}"], GREEDY, answers, f"r{i}"))
    batcher.submit(job(["beam"], BEAM, answers, "beam"))
    model.release.set()
    results = answers.wait(7)
    assert results["r3"] == ["a3/1", "b3/1"] and results["beam"] == ["beam/4"]
    # one batch for the held request, one for the five alike, one for the other options
    texts = [t for t, _ in model.batches]
    assert texts[1] == [f"{x}{i}" for x in "ab" for i in range(5)]
    assert texts[2] == ["beam"] and model.batches[2][1] == BEAM
    batcher.close()


def test_requests_queued_during_a_batch_wait_for_the_clients_it_answered():
    """Requests that queued during a batch wait for as many new ones as it answered, however
    long they have waited already: the answered clients' next sentences join them."""
    batcher, model, answers = held_batcher(Policy(max_wait=60.0))
    long_ago = time.monotonic() - 600  # it has waited far longer than max_wait
    batcher.submit(Job(GREEDY, ["queued"], [7], answers.done("queued"), arrived=long_ago))
    model.release.set()
    answers.wait(1)  # the held batch answered one request; its client sends again
    batcher.submit(job(["again"], GREEDY, answers, "again"))
    answers.wait(3)
    assert [t for t, _ in model.batches] == [["first"], ["queued", "again"]]
    batcher.close()


def test_a_lone_client_never_waits_for_company():
    """Its one answered request is back as soon as it sends again: max_wait is never waited."""
    model, answers = Model(), Answers()
    batcher = Batcher(model, Policy(max_wait=60.0))
    for i in range(3):
        batcher.submit(job([f"s{i}"], GREEDY, answers, f"s{i}"))
        answers.wait(i + 1)  # within 30 s, where a wait of max_wait would take 60
    assert [t for t, _ in model.batches] == [["s0"], ["s1"], ["s2"]]
    batcher.close()


def test_a_client_that_sends_again_as_its_answer_goes_is_counted():
    """The worker counts returning requests from before the first answer goes out."""
    model, answers = Model(), Answers()
    batcher = Batcher(model, Policy(max_wait=60.0))

    def answered_and_sends_again(result):  # runs on the worker thread, before it moves on
        batcher.submit(job(["next"], GREEDY, answers, "next"))
        answers.done("first")(result)

    batcher.submit(Job(GREEDY, ["first"], [6], answered_and_sends_again))
    assert answers.wait(2) == {"first": ["first/1"], "next": ["next/1"]}
    batcher.close()


def test_clients_that_do_not_come_back_are_waited_for_at_most_max_wait():
    batcher, model, answers = held_batcher(Policy(max_wait=0.05))
    for name in ("a", "b"):
        batcher.submit(job([name], GREEDY, answers, name))
    model.release.set()
    answers.wait(3)  # [first], then [a, b] once first's client has not come back in max_wait
    batcher.submit(job(["c"], GREEDY, answers, "c"))  # one of a and b's two clients
    answers.wait(4)
    assert [t for t, _ in model.batches] == [["first"], ["a", "b"], ["c"]]
    batcher.close()


def test_without_batching_each_request_is_decoded_alone():
    batcher, model, answers = held_batcher(Policy(batching=False))
    for i in range(3):
        batcher.submit(job([f"a{i}", f"b{i}"], GREEDY, answers, f"r{i}"))
    model.release.set()
    answers.wait(4)
    assert [t for t, _ in model.batches[1:]] == [[f"a{i}", f"b{i}"] for i in range(3)]
    batcher.close()


def test_a_huge_request_does_not_starve_a_small_one():
    batcher, model, answers = held_batcher(Policy(batch_tokens=40, max_wait=0.0))
    batcher.submit(job([f"h{i}" for i in range(100)], GREEDY, answers, "huge", [10] * 100))
    batcher.submit(job(["small"], GREEDY, answers, "small", [10]))
    model.release.set()
    answers.wait(3)
    assert "small" in model.batches[1][0]  # rides in the next batch, beside the huge one's start
    assert all(sum(10 for _ in t) <= 40 for t, _ in model.batches[1:])
    assert answers.results["huge"] == [f"h{i}/1" for i in range(100)]
    batcher.close()


def test_a_full_queue_refuses_and_close_fails_what_waits():
    size = Policy.range("max_queue")[0]  # the smallest queue: one largest request
    batcher, model, answers = held_batcher(Policy(max_queue=size))
    batcher.submit(job(["a"] * (size - 1), GREEDY, answers, "fits"))
    with pytest.raises(QueueFull):
        batcher.submit(job(["d", "e"], GREEDY, answers, "over"))
    batcher.submit(job(["d"], GREEDY, answers, "last"))
    threading.Thread(target=batcher.close).start()
    with batcher.cond:  # close() has taken the queue
        assert batcher.cond.wait_for(lambda: batcher.closed, timeout=30)
    model.release.set()
    results = answers.wait(3)
    assert results["first"] == ["first/1"]  # the batch in hand finishes
    assert isinstance(results["fits"], Closed) and isinstance(results["last"], Closed)
    with pytest.raises(Closed):
        batcher.submit(job(["x"], GREEDY, answers, "late"))


def test_a_failing_batch_fails_its_requests_only():
    calls = []

    def translate(texts, options):
        calls.append(texts)
        if "bad" in texts:
            raise RuntimeError("boom")
        return texts

    answers = Answers()
    batcher = Batcher(translate, Policy(batching=False))
    batcher.submit(job(["bad"], GREEDY, answers, "bad"))
    batcher.submit(Solo(lambda: 42, answers.done("solo")))
    batcher.submit(job(["good"], GREEDY, answers, "good"))
    results = answers.wait(3)
    assert isinstance(results["bad"], RuntimeError)
    assert results["solo"] == 42 and results["good"] == ["good"]
    batcher.close()


# Request checks --------------------------------------------------------------------------------

DECODE = DecodeConfig()


# Input generation is cheap but the machine may be shared: no timing checks.
LENIENT = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@LENIENT
@given(st.binary(max_size=200))
def test_any_body_is_a_json_object_or_a_client_error(body):
    try:
        value = api.parse_body(body)
    except ApiError as e:
        assert 400 <= e.status < 500 and "\n" not in e.message
        return
    assert isinstance(value, dict)


@LENIENT
@given(
    st.dictionaries(
        st.sampled_from(["text", "beam", "alpha", "nbest", "top_k", "x"]),
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text()
        | st.lists(st.text(), max_size=3),
    )
)
def test_any_fields_are_a_request_or_a_client_error(body):
    for parse in (api.translate_request, api.explain_request):
        try:
            request = parse(body, DECODE, Limits())
        except ApiError as e:
            assert 400 <= e.status < 500
            continue
        assert 1 <= request.options.nbest <= request.options.beam <= Limits().max_beam


def test_queue_full_and_bugs_answer_json():
    async def busy(request):
        raise QueueFull

    async def bug(request):
        raise KeyError("x")

    class Request:
        method, url = "POST", urllib.parse.urlparse("http://h/translate")

    full = asyncio.run(endpoint(busy)(Request()))
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert "queue is full" in json.loads(full.body)["error"]
    crash = asyncio.run(endpoint(bug)(Request()))
    assert (
        crash.status_code == 500 and json.loads(crash.body)["error"] == "internal error: KeyError"
    )


# The real server -------------------------------------------------------------------------------


class Served:
    """A `mtrain serve` subprocess on a free port, started once its URL is on stderr."""

    def __init__(self, run: Path, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mtrain", "serve", "--run", str(run), "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self.stderr = self._read_until(rb"http://[\d.]+:\d+/")
        found = re.search(r"http://([\d.]+):(\d+)/", self.stderr)
        self.host, self.port = found[1], int(found[2])
        self.url = found[0]

    def _read_until(self, pattern: bytes, seconds: float = 120) -> str:
        out, deadline = b"", time.monotonic() + seconds
        fd = self.proc.stderr.fileno()
        while not re.search(pattern, out):
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, out.decode(errors="replace")
            if select.select([fd], [], [], left)[0]:
                out += os.read(fd, 4096)
        return out.decode()

    def request(self, method: str, path: str, body: bytes | None = None, headers=None):
        """(status, parsed JSON or text) of one request on a connection of its own."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        if body is not None:  # the server takes JSON bodies only
            headers = {"Content-Type": "application/json", **(headers or {})}
        try:
            conn.request(method, path, body, headers or {})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        kind = response.getheader("content-type", "")
        return response.status, json.loads(data) if "json" in kind else data.decode()

    def post(self, path: str, value) -> tuple[int, object]:
        return self.request("POST", path, json.dumps(value, ensure_ascii=False).encode())

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, self.stderr + err.decode()


@pytest.fixture(scope="module")
def server(run_dir):
    served = Served(run_dir)
    yield served
    status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr
    assert "stopped by SIGTERM" in stderr


def split_sentences():
    """Test-split sentences, an empty one, and one past data.max_src_len (32 pieces)."""
    lines = (REPO / "data/tatoeba/test.tsv").read_text("utf-8").splitlines()[:24]
    return [line.split("\t")[1] for line in lines] + ["", "我是谁" * 40]


def command_nbest(run: Path, sentences: list[str], *args: str) -> list[list[tuple[str, float]]]:
    """`mtrain translate --nbest` of the sentences: per line, (text, score) best first."""
    result = mtrain("translate", "--run", str(run), *args, input="\n".join(sentences) + "\n")
    assert result.returncode == 0, result.stderr
    out: list[list[tuple[str, float]]] = [[] for _ in sentences]
    for line in result.stdout.splitlines():
        number, text, score = line.split(" ||| ")
        out[int(number)].append((text, float(score)))
    return out


def test_translations_equal_the_command_greedy_and_beam(server, run_dir):
    sentences = split_sentences()
    greedy = mtrain("translate", "--run", str(run_dir), input="\n".join(sentences) + "\n")
    status, answer = server.post("/translate", {"text": sentences})
    assert status == 200, answer
    assert [t["text"] for t in answer["translations"]] == greedy.stdout.split("\n")[:-1]
    assert answer["warnings"] == [f"sentence {len(sentences) - 1}: truncated to 32 tokens"]
    assert [t["truncated"] for t in answer["translations"]][-2:] == [False, True]

    expected = command_nbest(run_dir, sentences, "--beam", "4", "--nbest", "2", "--alpha", "1.0")
    status, answer = server.post(
        "/translate", {"text": sentences, "beam": 4, "nbest": 2, "alpha": 1.0}
    )
    assert status == 200, answer
    got = [[(t["text"], t["score"]) for t in item["nbest"]] for item in answer["translations"]]
    assert [[t for t, _ in s] for s in got] == [[t for t, _ in s] for s in expected]
    for mine, theirs in zip(got, expected):
        assert [s for _, s in mine] == pytest.approx([s for _, s in theirs], abs=1e-3)
    status, one = server.post("/translate", {"text": sentences[0], "beam": 4, "alpha": 1.0})
    assert one["translations"][0]["text"] == expected[0][0][0]


def test_concurrent_clients_each_get_their_own_answer(server):
    sentences = split_sentences()[:16]
    alone = [
        server.post("/translate", {"text": s})[1]["translations"][0]["text"] for s in sentences
    ]
    asks = [(i % 16, 1 + 3 * (i % 2)) for i in range(64)]  # greedy and beam 4, interleaved
    with ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(
                lambda a: server.post("/translate", {"text": sentences[a[0]], "beam": a[1]}), asks
            )
        )
    beam = {s: server.post("/translate", {"text": s, "beam": 4})[1] for s in sentences}
    for (i, b), (status, answer) in zip(asks, answers):
        assert status == 200, answer
        want = alone[i] if b == 1 else beam[sentences[i]]["translations"][0]["text"]
        assert answer["translations"][0]["text"] == want


def test_explain_shows_the_steps_and_every_attention_map(server):
    status, model = server.request("GET", "/model")
    assert status == 200 and model["direction"] == "zh-en" and model["parameters"] > 0
    status, answer = server.post("/explain", {"text": "我是谁", "top_k": 3})
    assert status == 200, answer
    _, translated = server.post("/translate", {"text": "我是谁"})
    assert answer["translations"][0]["text"] == translated["translations"][0]["text"]
    steps, att = answer["steps"], answer["attention"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(len(s["top"]) == 3 and s["top"][0]["id"] == s["chosen"]["id"] for s in steps)
    assert att["output"] == [s["chosen"]["piece"] for s in steps]
    assert att["source"] == answer["source"]["pieces"]
    m = model["model"]
    s_len, t_len = len(att["source"]), len(att["output"])
    for kind, layers, shape in (
        ("encoder", m["n_encoder_layers"], (s_len, s_len)),
        ("decoder", m["n_decoder_layers"], (t_len, t_len)),
        ("cross", m["n_decoder_layers"], (t_len, s_len)),
    ):
        assert len(att[kind]) == layers and len(att[kind][0]) == m["n_heads"], kind
        for head in (h for layer in att[kind] for h in layer):
            assert (len(head), len(head[0])) == shape
            assert all(abs(sum(row) - 1) < 1e-2 for row in head), kind
    decoder = att["decoder"][0][0]
    assert all(decoder[q][k] == 0 for q in range(t_len) for k in range(q + 1, t_len))  # masked
    status, beam = server.post("/explain", {"text": "我是谁", "beam": 3})
    assert beam["search"] == "beam" and beam["steps"][0]["candidates"]
    fates = {c["fate"] for s in beam["steps"] for c in s["candidates"]}
    assert "alive" in fates and any(f.startswith("finished") for f in fates)


BAD = [
    ("POST", "/translate", b"", 400, "empty request body"),
    ("POST", "/translate", b'{"text": ', 400, "invalid JSON"),
    ("POST", "/translate", b"\xff\xfe{}", 400, "not valid UTF-8"),
    ("POST", "/translate", b'{"text": "\\ud800"}', 400, "not valid UTF-8"),
    ("POST", "/translate", b"[1, 2]", 422, "must be a JSON object"),
    ("POST", "/translate", b'{"txt": "a"}', 422, "unknown field 'txt'"),
    ("POST", "/translate", b'{"beam": 2}', 422, "missing field 'text'"),
    ("POST", "/translate", b'{"text": 5}', 422, "'text' must be a string"),
    ("POST", "/translate", b'{"text": ["a", null]}', 422, "'text' item 1 must be a string"),
    ("POST", "/translate", b'{"text": []}', 422, "empty list"),
    ("POST", "/translate", b'{"text": "a", "beam": "4"}', 422, "'beam' must be an integer"),
    ("POST", "/translate", b'{"text": "a", "beam": 0}', 422, "between 1 and 64"),
    ("POST", "/translate", b'{"text": "a", "alpha": -1}', 422, "'alpha' must be a finite"),
    ("POST", "/translate", b'{"text": "a", "alpha": NaN}', 422, "'alpha' must be a finite"),
    ("POST", "/translate", b'{"text": "a", "nbest": 3}', 422, "nbest 3 needs beam 3"),
    ("POST", "/translate", json.dumps({"text": ["a"] * 257}).encode(), 413, "too many sentences"),
    ("POST", "/translate", b'{"text": "' + b"a" * (1 << 20) + b'"}', 413, "at most 1048576"),
    ("POST", "/translate", b"[" * 100000, 400, "invalid JSON"),
    ("POST", "/explain", b'{"text": ["a", "b"]}', 422, "one sentence"),
    ("POST", "/explain", b'{"text": "a", "top_k": 99}', 422, "between 1 and 20"),
    ("GET", "/training/attention?validation=" + "9" * 5000 + "&source=a", None, 422, "whole"),
    ("GET", "/training/attention?validation=%C2%B2&source=a", None, 422, "whole number"),
    ("GET", "/training/attention?validation=99999999999&source=a", None, 422, "between 0"),
    ("GET", "/training/attention?validation=0", None, 422, "expected ?validation=N"),
    ("GET", "/translate", None, 405, "Method Not Allowed"),
    ("GET", "/nowhere", None, 404, "Not Found"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"), BAD, ids=[f"{m} {p[:50]}" for m, p, *_ in BAD]
)
def test_each_bad_request_gets_its_status_and_message(server, method, path, body, status, message):
    got, answer = server.request(method, path, body)
    assert got == status and message in answer["error"], answer
    assert answer["status"] == status and "Traceback" not in answer["error"]


def test_the_page_and_its_assets_are_served_with_no_network(server):
    status, page = server.request("GET", "/")
    assert status == 200 and "<html" in page
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    status, css = server.request("GET", "/static/style.css")
    assets += re.findall(r'url\("([^"]+)"\)', css)
    assert "/static/app.js" in assets and "/static/cjk.otf" in assets
    for path in assets:
        assert path.startswith("/static/"), path  # nothing from another host
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 200 and response.read(), path
        conn.close()


def test_sigterm_with_requests_in_flight_finishes_them_and_exits_cleanly(run_dir):
    served = Served(run_dir, "--no-batching")
    body = {"text": split_sentences()[:24] * 4, "beam": 4}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(served.post, "/translate", body) for _ in range(4)]
        until_a_request_waits(served, futures)
        status, stderr = served.stop(signal.SIGTERM)
        answers = [f.result() for f in futures]
    assert status == 0 and "Traceback" not in stderr, stderr
    assert "stopped by SIGTERM" in stderr
    for code, answer in answers:
        assert code == 200 and len(answer["translations"]) == 96


def until_a_request_waits(served: Served, futures: list) -> None:
    """Return once a whole request is queued behind the one decoding; raise a failed one's error."""
    while served.request("GET", "/health")[1]["queued"] < 96:
        for future in futures:
            if future.done():
                future.result()  # a request refused or cut: its own error, not a race's
        assert not all(f.done() for f in futures), "every request was answered before one waited"


def test_the_url_is_said_once_the_server_listens(run_dir, caplog):
    """A client that connects as soon as the URL is on stderr is not refused: the line comes
    once the socket listens, not when the app has started and uvicorn not yet listened."""
    tried = []

    class Connect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = re.search(r"serving .* on http://([\d.]+):(\d+)/", record.getMessage())
            if found is None:
                return
            try:
                socket.create_connection((found[1], int(found[2])), timeout=60).close()
                tried.append("connected")
            except OSError as e:
                tried.append(repr(e))
            signal.raise_signal(signal.SIGTERM)  # stop the server: the test is done

    caplog.set_level(logging.INFO, logger="mtrain")
    connect = Connect()
    logging.getLogger("mtrain").addHandler(connect)
    try:
        result = CliRunner().invoke(app, ["serve", "--run", str(run_dir), "--port", "0"])
    finally:
        logging.getLogger("mtrain").removeHandler(connect)
    assert tried == ["connected"], (tried, result.output)
    assert result.exit_code == 0, result.output


def test_ctrl_c_stops_an_idle_server_and_a_taken_port_is_one_line(run_dir):
    served = Served(run_dir)
    result = mtrain("serve", "--run", str(run_dir), "--port", str(served.port))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().endswith(
        f"cannot listen on 127.0.0.1 port {served.port}: Address already in use"
    )
    status, stderr = served.stop(signal.SIGINT)
    assert status == 0 and "stopped by SIGINT" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_connections_to_the_bound_socket_send_small_writes_at_once(host):
    """Nagle's algorithm is off on each connection the server accepts: with it on, a response
    body written after its headers waits for the client's delayed ACK (40 ms a request)."""
    from mtrain.serve import server

    try:
        sock = server.bind(host, 0)
    except OSError as e:  # a machine without IPv6 on its loopback
        pytest.skip(f"cannot listen on {host}: {e}")

    async def nodelay_of_an_accepted_connection() -> int:
        accepted = asyncio.get_running_loop().create_future()

        def connected(reader, writer):
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listening = await asyncio.start_server(connected, sock=sock)
        port = listening.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection(host, port)
        value = await asyncio.wait_for(accepted, 30)
        writer.close()
        listening.close()
        return value

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def dump_dom(url: str, profile: Path) -> subprocess.CompletedProcess:
    """The page at `url` after its scripts ran, in headless Chromium."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    return subprocess.run(
        [
            chromium(),
            *flags,
            f"--user-data-dir={profile}",
            "--virtual-time-budget=60000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.skipif(chromium() is None, reason="no chromium: apt-get install chromium")
def test_the_page_translates_and_shows_steps_and_a_heatmap_in_a_browser(server, tmp_path):
    text = "我是谁"
    hash_ = urllib.parse.urlencode(
        {"text": text, "explain": text, "step": 2, "kind": "cross", "layer": 1, "head": 2}
    )
    result = dump_dom(f"{server.url}#{hash_}", tmp_path)
    dom = result.stdout
    assert 'data-ready="yes"' in dom, result.stderr[-2000:]
    _, answer = server.post("/explain", {"text": text})
    translation = answer["translations"][0]["text"]
    out = re.search(r'<span class="out">([^<]*)</span>', dom)
    assert out and html_text(out[1]) == translation
    assert f"step 2 of {len(answer['steps'])}" in dom
    chosen = re.search(r'<tr class="chosen"><td class="piece-cell" lang="zh">([^<]*)<', dom)
    assert chosen and html_text(chosen[1]) == answer["steps"][1]["chosen"]["piece"]
    att = answer["attention"]
    assert dom.count('class="cell"') == len(att["output"]) * len(att["source"])
    cols = re.findall(r'class="col-label"[^>]*>([^<]*)<', dom)
    assert [html_text(c) for c in cols] == att["source"]
    assert "Cross-attention, layer 1, head 2." in dom
    assert 'class="bad"' not in dom


@pytest.mark.skipif(chromium() is None, reason="no chromium: apt-get install chromium")
def test_the_page_translates_with_a_beam_size_outside_its_list(run_dir, tmp_path):
    # The default recipe decodes with beam 6, which the page's list of 1, 2, 4, 5, 8 lacked: it
    # sent no beam at all and showed "'beam' must be an integer, not null".
    run = tmp_path / "beam6"
    shutil.copytree(run_dir, run)
    config = run / "config.yaml"
    text = config.read_text("utf-8")
    assert "beam_size: 1\n" in text
    config.write_text(text.replace("beam_size: 1\n", "beam_size: 6\n"), "utf-8")
    served = Served(run)
    try:
        dom = dump_dom(f"{served.url}#text=我是谁", tmp_path / "profile").stdout
        _, answer = served.post("/translate", {"text": "我是谁"})
    finally:
        served.stop()
    assert '<option value="6">6</option>' in dom and 'class="bad"' not in dom
    out = re.search(r'<span class="out">([^<]*)</span>', dom)
    assert out and html_text(out[1]) == answer["translations"][0]["text"]


def html_text(s: str) -> str:
    import html

    return html.unescape(s)


def test_the_ctranslate2_engine_translates_as_the_command_and_cannot_explain(run_dir, tmp_path):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    result = mtrain("export", str(run_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    sentences = split_sentences()[:8]
    args = ("translate", "--run", str(out), "--engine", "ctranslate2", "--beam", "4")
    expected = mtrain(*args, input="\n".join(sentences) + "\n").stdout.splitlines()
    served = Served(out, "--engine", "ctranslate2")
    try:
        status, answer = served.post("/translate", {"text": sentences, "beam": 4})
        assert status == 200 and [t["text"] for t in answer["translations"]] == expected
        status, answer = served.post("/explain", {"text": "我是谁"})
        assert status == 501 and "--engine mtrain" in answer["error"]
        assert served.request("GET", "/model")[1]["engine"] == "ctranslate2"
    finally:
        status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr
