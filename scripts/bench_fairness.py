"""`mtrain serve` under a heavy neighbour: latency of small requests beside big ones.

    python scripts/bench_fairness.py --run runs/NAME [--requests 100] [--heavy 1]
        [--batch-seconds S]

Starts one server (with `--batch-seconds S` if given, else the server's default, 0.5 s); --heavy
clients send 256-sentence beam-16 requests of the run's test split back to back, while one light
client sends --requests single-sentence greedy requests, one after the other. Prints p50, p99
and the largest latency of the light requests on stdout (the goal: p99 at most 2 s, the rest of
the batch in hand and one more behind the big requests, each bounded by --batch-seconds), how
many big requests were answered and in how many batches. `--batch-seconds 600` leaves batches
bounded by tokens alone, for comparison. Run it alone on the machine: the clients share its
cores with the server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from bench_serve import Server, client, test_sources

GOAL_P99 = 2.0  # seconds


def heavy(address, sentences: list[str], stop: threading.Event, done: list[int]) -> None:
    """Send 256-sentence beam-16 requests on one connection until `stop`."""
    conn = http.client.HTTPConnection(*address, timeout=600)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = json.dumps({"text": sentences, "beam": 16}, ensure_ascii=False).encode()
    while not stop.is_set():
        conn.request("POST", "/translate", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        done.append(response.status)
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--engine", default="mtrain", choices=["mtrain", "ctranslate2"])
    parser.add_argument("--requests", type=int, default=100, help="light requests, one by one")
    parser.add_argument("--heavy", type=int, default=1, help="clients sending big requests")
    parser.add_argument(
        "--batch-seconds", type=float, help="mtrain serve --batch-seconds (default: its own)"
    )
    args = parser.parse_args()
    sources = test_sources(args.run)
    big = (sources * (256 // len(sources) + 1))[:256]
    pace = [] if args.batch_seconds is None else ["--batch-seconds", str(args.batch_seconds)]
    server = Server(args.run, ["--engine", args.engine, *pace])
    stop, answered = threading.Event(), []
    try:
        latencies: list[float] = []
        errors: list[str] = []
        client(server.address, sources[:5], 1, [], errors)  # warm up
        heavies = [
            threading.Thread(target=heavy, args=(server.address, big, stop, answered))
            for _ in range(args.heavy)
        ]
        for t in heavies:
            t.start()
        while server.get("/health")["decoded"] == 0:  # the big requests are being decoded
            time.sleep(0.05)
        before = server.get("/health")["batches"]
        light = (sources * (args.requests // len(sources) + 1))[: args.requests]
        print(f"bench_fairness: {len(light)} light requests", file=sys.stderr)
        client(server.address, light, 1, latencies, errors)
        batches = server.get("/health")["batches"] - before
        stop.set()
        for t in heavies:
            t.join()
    finally:
        stop.set()
        server.stop()
    if errors:
        print(f"bench_fairness: {len(errors)} errors, the first: {errors[0]}", file=sys.stderr)
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")  # never past the max
    verdict = "met" if cuts[98] <= GOAL_P99 else "missed"
    seconds = "default" if args.batch_seconds is None else f"{args.batch_seconds:g}"
    print(
        "| --batch-seconds | light requests | p50 ms | p99 ms | max ms "
        "| big requests answered | batches |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {seconds} | {len(latencies)} | {1000 * cuts[49]:.0f} | {1000 * cuts[98]:.0f} "
        f"| {1000 * max(latencies):.0f} | {answered.count(200)} | {batches} |"
    )
    print(f"bench_fairness: p99 goal {GOAL_P99:g} s {verdict}", file=sys.stderr)


if __name__ == "__main__":
    main()
