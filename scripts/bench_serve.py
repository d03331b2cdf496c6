"""`mtrain serve` under load: sentences/s and latency with N concurrent HTTP clients.

    python scripts/bench_serve.py --run runs/NAME [--sentences 400] [--clients 1 4 16]
    python scripts/bench_serve.py --run DIR --engine ctranslate2   # a directory of mtrain export

It starts two servers on free ports, batching on and off (--no-batching: each request decoded
alone), and for each N, on then off back to back (the VM's speed drifts), runs N client
threads, each on its own keep-alive connection, that send single sentences of the run's test
split (POST /translate, greedy unless --beam) until --sentences have been sent in all. Prints
a Markdown table on stdout: sentences/s, p50 and p99 latency per request, and how many requests
the server decoded per batch on average; progress and each N's on/off ratio on stderr. Run it
alone on the machine: the clients share its cores with the server.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from mtrain.core import config
from mtrain.data.corpus import corpora, read_pairs
from mtrain.export.converter import MTRAIN_CONFIG
from mtrain.run.directory import CONFIG_FILE

REPO = Path(__file__).resolve().parent.parent


def test_sources(run: Path) -> list[str]:
    """The source sentences of the run's test split."""
    path = run / CONFIG_FILE if (run / CONFIG_FILE).is_file() else run / MTRAIN_CONFIG
    cfg = config.load(path)
    corpus = corpora(cfg.data.test, cfg.data.swap_columns)[0]
    pairs = read_pairs(corpus, cfg.data.src_lang, cfg.data.tgt_lang)
    return [src for src, _ in pairs if src]


class Server:
    """`mtrain serve` in a subprocess; `address` once it prints its URL."""

    def __init__(self, run: Path, args: list[str]):
        command = [sys.executable, "-m", "mtrain", "serve", "--run", str(run), "--port", "0"]
        self.proc = subprocess.Popen(
            [*command, *args],
            stderr=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        out = b""
        while not (found := re.search(rb"http://([\d.]+):(\d+)/", out)):
            if self.proc.poll() is not None:
                sys.exit(f"bench_serve: the server stopped:\n{out.decode(errors='replace')}")
            if select.select([self.proc.stderr], [], [], 1.0)[0]:
                out += os.read(self.proc.stderr.fileno(), 4096)
        self.address = (found[1].decode(), int(found[2]))

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(*self.address, timeout=600)
        conn.request("GET", path)
        answer = json.loads(conn.getresponse().read())
        conn.close()
        return answer

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def client(address, sentences, beam: int, latencies: list[float], errors: list[str]) -> None:
    """Send sentences one request at a time on one connection; record each latency."""
    conn = http.client.HTTPConnection(*address, timeout=600)
    conn.connect()
    # http.client sends the headers and the body in two writes: with Nagle's algorithm on, the
    # body waits for the server's delayed ACK of the headers (40 ms on Linux). curl, urllib3
    # and browsers turn Nagle off; so does this client.
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    headers = {"Content-Type": "application/json"}
    for text in sentences:
        body = json.dumps({"text": text, "beam": beam}, ensure_ascii=False).encode()
        start = time.perf_counter()
        conn.request("POST", "/translate", body, headers)
        response = conn.getresponse()
        data = response.read()
        latencies.append(time.perf_counter() - start)
        if response.status != 200:
            errors.append(f"{response.status} {data[:200]!r}")
    conn.close()


def load(server: Server, sources: list[str], clients: int, total: int, beam: int) -> dict:
    """N clients sending `total` sentences in all: sentences/s, latency percentiles."""
    work = list(itertools.islice(itertools.cycle(sources), total))
    shares = [work[i::clients] for i in range(clients)]
    latencies: list[float] = []
    errors: list[str] = []
    before = server.get("/health")["batches"]
    threads = [
        threading.Thread(target=client, args=(server.address, s, beam, latencies, errors))
        for s in shares
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    batches = server.get("/health")["batches"] - before
    if errors:
        print(f"bench_serve: {len(errors)} errors, the first: {errors[0]}", file=sys.stderr)
    cuts = statistics.quantiles(latencies, n=100)
    return {
        "rate": total / seconds,
        "p50": cuts[49],
        "p99": cuts[98],
        "per_batch": total / max(batches, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--engine", default="mtrain", choices=["mtrain", "ctranslate2"])
    parser.add_argument("--sentences", type=int, default=400, help="sent per N, in all")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--wait-ms", type=float, help="mtrain serve --wait-ms (default: its own)")
    args = parser.parse_args()
    sources = test_sources(args.run)
    wait = [] if args.wait_ms is None else ["--wait-ms", str(args.wait_ms)]
    servers: dict[str, Server] = {}
    try:
        for batching in ("--batching", "--no-batching"):  # both loaded; the idle one sleeps
            servers[batching] = Server(args.run, ["--engine", args.engine, batching, *wait])
            load(servers[batching], sources, 1, min(10, args.sentences), args.beam)  # warm up
        print("| clients | batching | sentences/s | p50 ms | p99 ms | sentences per batch |")
        print("|---:|---|---:|---:|---:|---:|")
        for n in args.clients:
            rates = []
            for batching, server in servers.items():
                print(f"bench_serve: {n} clients, {batching[2:]}", file=sys.stderr)
                r = load(server, sources, n, args.sentences, args.beam)
                rates.append(r["rate"])
                print(
                    f"| {n} | {'on' if batching == '--batching' else 'off'} | {r['rate']:.1f} "
                    f"| {1000 * r['p50']:.0f} | {1000 * r['p99']:.0f} | {r['per_batch']:.1f} |",
                    flush=True,
                )
            print(f"bench_serve: {n} clients: on / off {rates[0] / rates[1]:.2f}x", file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
