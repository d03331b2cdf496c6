"""`mtrain serve` at the network edge: descriptors, slow clients, stops, Host, token, CORS."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mtrain.serve.edge import Access
from mtrain.serve.server import Repeats

from .console import REPO, mtrain
from .test_serve import Served, split_sentences

TOKEN = "s3cret-token-of-the-test-0123456789"


class Server(Served):
    """A `mtrain serve` subprocess, optionally with its own environment and descriptor limits."""

    def __init__(self, run: Path, *args: str, env=None, nofile: tuple[int, int] | None = None):
        def limit() -> None:  # in the child, before it runs Python
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mtrain", "serve", "--run", str(run), "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            preexec_fn=limit,
        )
        self.stderr = self._read_until(rb"serving .* on http://\S+:\d+/")
        found = re.search(r"serving .* on (http://(\S+):(\d+)/)", self.stderr)
        self.url, self.printed_host, self.port = found[1], found[2], int(found[3])
        self.host = "127.0.0.1"  # every address this server listens on includes loopback

    def raw(self, method: str, path: str, body: bytes | None = None, headers=None):
        """(status, headers, parsed JSON or text) of one request sent with exactly `headers`."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.putrequest(method, path, skip_host="Host" in (headers or {}))
            for name, value in (headers or {}).items():
                conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body or b"")))
            conn.endheaders(body)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        kind = response.getheader("content-type", "")
        answer = json.loads(data) if "json" in kind else data.decode()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, answer

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=60)


def closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends on `sock` until it closes it (the socket's timeout bounds it)."""
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got


JSON = {"Content-Type": "application/json"}


# The rules alone -------------------------------------------------------------------------------


def test_a_loopback_server_answers_only_to_loopback_names():
    access = Access.bound_to("127.0.0.1", 8000)
    for host in ("localhost", "LocalHost:8000", "127.0.0.1", "127.0.0.1:8000", "[::1]:8000"):
        assert access.host_allowed(host), host
    for host in (
        "evil.example",
        "evil.example:8000",
        "localhost:8001",
        "localhost.evil.example",
        "127.0.0.1.nip.io:8000",
        "[::1]x",
        "127.0.0.1:8000:1",
        "",
        None,
    ):
        assert not access.host_allowed(host), host
    assert Access.bound_to("::1", 8000).host_allowed("[::1]:8000")
    assert Access.bound_to("0.0.0.0", 8000).host_allowed("any.name.example")


def test_the_token_is_compared_whole():
    access = Access(None, 8000, token=TOKEN)
    assert access.token_given(f"Bearer {TOKEN}") and access.token_given(f"bearer  {TOKEN} ")
    for value in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"):
        assert not access.token_given(value), value


def test_a_repeated_failure_is_one_line_then_a_count_per_interval(caplog):
    scheduled = []
    repeats = Repeats(every=10, schedule=lambda delay, fn, *args: scheduled.append((fn, args)))
    error = OSError(24, "Too many open files")
    with caplog.at_level(logging.WARNING, logger="mtrain.serve.server"):
        for _ in range(1000):
            repeats.loop_exception(None, {"message": "accept", "exception": error})
        assert [r.getMessage() for r in caplog.records] == [
            "mtrain serve: cannot accept connections: Too many open files"
        ]
        fn, args = scheduled.pop()
        fn(*args)  # the interval is over
        assert caplog.records[-1].getMessage().endswith("(999 more times in 10 s)")
        fn, args = scheduled.pop()
        fn(*args)  # a quiet interval: nothing to say, and the next failure is logged at once
        assert len(caplog.records) == 2 and not scheduled


def test_a_short_token_a_bad_origin_or_too_many_connections_is_one_line(tmp_path):
    short = tmp_path / "token"
    short.write_text("abc\n")
    result = mtrain("serve", "--run", str(tmp_path), "--token-file", str(short))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "at least 16 characters" in result.stderr and len(result.stderr.splitlines()) == 1
    huge = tmp_path / "huge-token"
    huge.write_text("x" * (3 << 20))  # 3 MB: no request's headers could carry it
    result = mtrain("serve", "--run", str(tmp_path), "--token-file", str(huge))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "more than 4096 characters" in result.stderr and len(result.stderr.splitlines()) == 1
    for origin in ("*", "https://a.example/path", "a.example"):
        result = mtrain("serve", "--run", str(tmp_path), "--allow-origin", origin)
        assert result.returncode == 2 and "one origin" in result.stderr, origin
    result = mtrain("serve", "--run", str(tmp_path), "--max-connections", "100000")
    assert result.returncode == 2  # at most 1024, fewer under a low descriptor limit
    assert re.search(r"--max-connections 100000: at most \d+ under the limit", result.stderr)


# Host, content type and CORS on a loopback server ---------------------------------------------

ALLOWED = "https://allowed.example"


@pytest.fixture(scope="module")
def guarded(run_dir):
    served = Server(run_dir, "--allow-origin", ALLOWED)
    yield served
    status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr


def test_a_host_header_not_naming_loopback_is_refused(guarded):
    port = guarded.port
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        status, _, answer = guarded.raw("GET", "/health", headers={"Host": host})
        assert status == 200 and answer["status"] == "ok", host
    for host in ("rebound.example", f"rebound.example:{port}", f"localhost:{port + 1}"):
        for method, path, body in (("GET", "/model", None), ("POST", "/translate", b"{}")):
            status, _, answer = guarded.raw(method, path, body, {"Host": host, **JSON})
            assert status == 403 and answer["status"] == 403, (host, path)
            assert f"Host {host!r}" in answer["error"]


def test_a_post_body_must_be_json(guarded):
    body = json.dumps({"text": "我是谁"}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
        status, _, answer = guarded.raw("POST", "/translate", body, {"Content-Type": kind})
        assert status == 415 and f"not {kind.split(';')[0]!r}" in answer["error"], kind
    status, _, answer = guarded.raw("POST", "/translate", body)
    assert status == 415 and "none was given" in answer["error"]
    kind = {"Content-Type": "application/json; charset=utf-8"}
    status, _, answer = guarded.raw("POST", "/translate", body, kind)
    assert status == 200 and len(answer["translations"]) == 1


def test_cors_headers_go_only_to_the_allowed_origin(guarded):
    preflight = {"Access-Control-Request-Method": "POST"}
    for origin in ("https://other.example", "null"):
        status, headers, _ = guarded.raw("GET", "/health", headers={"Origin": origin})
        assert status == 200 and not any(k.startswith("access-control") for k in headers)
        status, headers, _ = guarded.raw(
            "OPTIONS", "/translate", None, {"Origin": origin, **preflight}
        )
        assert not any(k.startswith("access-control") for k in headers)
    status, headers, _ = guarded.raw(
        "OPTIONS", "/translate", None, {"Origin": ALLOWED, **preflight}
    )
    assert status == 204 and headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in headers["access-control-allow-methods"]
    assert "content-type" in headers["access-control-allow-headers"].lower()
    body = json.dumps({"text": "我是谁"}).encode()
    status, headers, _ = guarded.raw("POST", "/translate", body, {"Origin": ALLOWED, **JSON})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED


@pytest.fixture(scope="module")
def server(run_dir):
    served = Server(run_dir)
    yield served
    served.stop()


def test_no_cors_headers_without_allow_origin(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("GET", "/health", headers={"Origin": "https://any.example"})
    response = conn.getresponse()
    response.read()
    conn.close()
    assert response.status == 200
    assert not any(k.lower().startswith("access-control") for k, _ in response.getheaders())


# A token, on an address other machines reach --------------------------------------------------


def test_a_server_on_all_addresses_warns_once_prints_an_openable_address_and_needs_its_token(
    run_dir, tmp_path
):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    served = Server(run_dir, "--host", "0.0.0.0", "--token-file", str(token_file))
    try:
        assert served.printed_host != "0.0.0.0"
        assert served.stderr.count("warning") == 1
        assert "listening on 0.0.0.0, not loopback; requests need the token" in served.stderr
        rebound = {"Host": "any.name.example"}  # no Host check: the token is the check
        for headers in ({}, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN}):
            status, got, answer = served.raw("GET", "/model", None, {**rebound, **headers})
            assert status == 401 and got["www-authenticate"] == "Bearer", headers
            assert "Authorization: Bearer" in answer["error"]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, _, answer = served.raw("GET", "/model", None, {**rebound, **auth})
        assert status == 200 and answer["direction"] == "zh-en"
        body = json.dumps({"text": "我是谁"}).encode()
        assert served.raw("POST", "/translate", body, JSON)[0] == 401
        assert served.raw("POST", "/translate", body, {**JSON, **auth})[0] == 200
        for path in ("/", "/static/app.js"):  # the page loads, then asks for the token
            assert served.raw("GET", path)[0] == 200, path
    finally:
        status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr


def test_the_token_may_come_from_the_environment(run_dir):
    served = Server(run_dir, env={"MTRAIN_SERVE_TOKEN": TOKEN})
    try:
        assert "warning" not in served.stderr  # loopback: no warning
        assert served.raw("GET", "/health")[0] == 401
        assert served.raw("GET", "/health", None, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    finally:
        served.stop()


# Descriptors and slow clients -----------------------------------------------------------------


@pytest.fixture(scope="module")
def scarce(run_dir):
    """A server whose child starts with a soft descriptor limit of 64 under a hard one of 128,
    and gives a client 1 s to send a request."""
    served = Server(run_dir, "--read-timeout", "1", nofile=(64, 128))
    yield served
    status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr
    assert "failed" not in stderr  # clients that hang up or are too slow are no bugs
    assert len(stderr.encode()) < 2000, stderr


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(scarce):
    limits = Path(f"/proc/{scarce.proc.pid}/limits").read_text()
    assert re.search(r"Max open files\s+128\s+128", limits), limits


def test_more_idle_connections_than_descriptors_neither_hang_nor_flood_the_log(scarce):
    held = [scarce.connect() for _ in range(150)]  # more than the 128 descriptors it may open
    try:
        # past the cap a connection is answered 503 at once (or refused): never a hang
        try:
            status, headers, answer = scarce.raw("GET", "/health")
            assert status in (200, 503), answer
            if status == 503:
                assert headers["retry-after"] == "1" and "too many" in answer["error"]
        except ConnectionError:
            pass
        for sock in held:  # each idle one is closed by its read deadline, or was refused
            answer = closed_by_server(sock)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 503 ")
    finally:
        for sock in held:
            sock.close()
    status, _, answer = scarce.raw("GET", "/health")
    assert status == 200 and answer["status"] == "ok"


def test_a_body_shorter_than_its_content_length_is_closed_at_the_deadline(scarce):
    with scarce.connect() as sock:
        sock.sendall(
            b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"text": '
        )
        assert closed_by_server(sock) == b""  # its reader learns the client has gone


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_deadline(scarce):
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + b"X-Slow: a\r\n" * 1000
    with scarce.connect() as sock:
        for i in range(len(request)):  # until the server closes, 1 byte per 0.2 s (or faster)
            if select.select([sock], [], [], 0.2)[0]:
                break
            sock.sendall(request[i : i + 1])
        else:
            pytest.fail("the server read the whole slow request")
        answer = closed_by_server(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"status":408' in answer


def test_an_idle_keep_alive_connection_is_closed(scarce):
    with scarce.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        answer = closed_by_server(sock)  # the answer, then the close, with no second request
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"status":"ok"' in answer


def test_malformed_requests_are_answered_400_and_logged_once(scarce):
    for _ in range(200):
        with scarce.connect() as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert closed_by_server(sock).startswith(b"HTTP/1.1 400 ")
    # the fixture checks stderr stays under 2,000 bytes: not a line per request


def test_a_client_that_hangs_up_mid_body_is_no_failure(scarce):
    with scarce.connect() as sock:
        sock.sendall(
            b"POST /translate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"text": '
        )
    assert scarce.raw("GET", "/health")[0] == 200  # the stderr check is in the fixture


# Stopping --------------------------------------------------------------------------------------


def long_requests_then(served: Server, stop) -> tuple[list, int, str]:
    """Four long requests in flight, `stop(served)` once some wait; their answers and the exit."""
    body = json.dumps({"text": split_sentences()[:24] * 4, "beam": 4}).encode()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(served.raw, "POST", "/translate", body, JSON) for _ in range(4)]
        while served.raw("GET", "/health")[2]["queued"] == 0:  # until requests wait
            assert not any(f.done() for f in futures)
        stop(served)
        _, err = served.proc.communicate(timeout=120)
        answers = [f.result() for f in futures]
    return answers, served.proc.returncode, served.stderr + err.decode()


def until_refused(served: Server) -> None:
    """Wait until the server has taken the first signal: it stops taking connections."""
    while True:
        try:
            served.raw("GET", "/health")
        except ConnectionError:
            return


@pytest.mark.parametrize("signals", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM,) * 2])
def test_a_second_signal_cuts_what_is_in_flight_with_json_503(run_dir, signals):
    served = Server(run_dir, "--no-batching")

    def twice(served: Server) -> None:
        served.proc.send_signal(signals[0])
        until_refused(served)
        served.proc.send_signal(signals[1])

    answers, status, stderr = long_requests_then(served, twice)
    assert status == 0 and "Traceback" not in stderr, stderr
    assert f"stopped by {signals[0].name} (a second signal:" in stderr
    for code, _, answer in answers:
        assert code == 200 or (code == 503 and answer["error"] == "server shutting down"), answer
    assert sum(code == 503 for code, _, _ in answers) >= 1  # the queued ones, at least


def test_work_past_the_grace_gets_json_503(run_dir):
    served = Server(run_dir, "--no-batching", "--grace", "0")
    answers, status, stderr = long_requests_then(
        served, lambda s: s.proc.send_signal(signal.SIGTERM)
    )
    assert status == 0 and "Traceback" not in stderr, stderr
    assert "stopped by SIGTERM (the grace ran out:" in stderr
    for code, headers, answer in answers:
        assert code == 200 or (code == 503 and answer["error"] == "server shutting down"), answer
        assert headers["content-type"] == "application/json"
    assert sum(code == 503 for code, _, _ in answers) >= 1


def test_the_page_asks_for_the_token_once_and_translates(run_dir, tmp_path):
    """In Chromium, driven by Selenium: the page's first API call gets 401, it asks, it keeps."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.common.exceptions import (
        NoAlertPresentException,
        UnexpectedAlertPresentException,
    )

    driver_path = next(
        (
            p
            for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
            if Path(p).exists()
        ),
        None,
    )
    if driver_path is None:
        pytest.skip("no chromedriver: apt-get install chromium-driver")
    served = Server(run_dir, env={"MTRAIN_SERVE_TOKEN": TOKEN})
    options = webdriver.ChromeOptions()
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=driver_path)
    browser = webdriver.Chrome(options=options, service=service)
    try:
        browser.get(f"{served.url}#text=我是谁")
        asked = 0
        deadline = time.monotonic() + 120
        while True:  # until the page is ready, answering its questions
            assert time.monotonic() < deadline, browser.page_source[-2000:]
            try:
                alert = browser.switch_to.alert
            except NoAlertPresentException:
                try:
                    body = browser.find_element("tag name", "body")
                    if body.get_attribute("data-ready") == "yes":
                        break
                except UnexpectedAlertPresentException:  # it asked in between
                    pass
                continue
            asked += 1
            alert.send_keys(TOKEN)
            alert.accept()
        out = browser.find_element("css selector", "span.out").text
        assert asked == 1 and out
        assert browser.find_elements("css selector", ".bad") == []
    finally:
        browser.quit()
        served.stop()


def test_a_bar_of_idle_connections_does_not_lock_out_one_request(run_dir):
    """300 idle connections against a cap of 50: the oldest idle ones are closed to make room,
    so a real request is still answered."""
    served = Server(run_dir, "--max-connections", "50")
    held = []
    try:
        held = [served.connect() for _ in range(300)]
        status, _, answer = served.raw("GET", "/health")
        assert status == 200 and answer["status"] == "ok", answer
        assert closed_by_server(held[0]) == b""  # the oldest was closed, with no answer
    finally:
        for sock in held:
            sock.close()
        status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr
    assert len(stderr.encode()) < 2000, stderr
