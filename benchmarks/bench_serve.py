"""Endpoint throughput and latency, and the HTTP overhead over calling the library directly.

    python benchmarks/bench_serve.py --zoo ~/.cache/blockpilot/zoo/small-seed0-v2-py311 [--predictor DIR_OR_URI]

Starts an embedded Ray and the Serve endpoint on 127.0.0.1 (one replica), then for concurrency 1, 8 and 32
sends the same bounded set of completion requests (T = 0, fixed max_tokens) and prints requests/s and
p50/p99 latency. Before that, the same requests go through `DecoderEngine.complete` in this process:
the difference of mean latencies at concurrency 1 is the HTTP + Serve overhead per request.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True)
    parser.add_argument("--predictor", default=None)
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from pipelines.serve import ModelLoader, serve_locally

    rows = [json.loads(line) for line in (args.zoo / "prompts" / "heldout.jsonl").read_text().splitlines()]
    bodies = [
        {"prompt": rows[i % len(rows)]["prompt"], "max_tokens": args.max_tokens, "temperature": 0}
        for i in range(args.requests)
    ]

    loader = ModelLoader(str(args.zoo / "target"), str(args.zoo / "drafter"), args.predictor)
    engine = loader()
    engine.complete(engine.check(bodies[0], chat=False))  # warm-up
    library = []
    for body in bodies:
        started = time.perf_counter()
        engine.complete(engine.check(body, chat=False))
        library.append(time.perf_counter() - started)
    del engine

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = serve_locally(loader, port=port)
    url = f"{server.url}/v1/completions"
    server.wait_healthy()
    httpx.post(url, json=bodies[0], timeout=120).raise_for_status()  # warm-up

    def one(body: dict) -> float:
        started = time.perf_counter()
        httpx.post(url, json=body, timeout=600).raise_for_status()
        return time.perf_counter() - started

    print(f"requests per level: {len(bodies)}, max_tokens {args.max_tokens}, T=0, one replica")
    print(f"{'concurrency':>11} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    results = {}
    for level in (int(c) for c in args.concurrency.split(",")):
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=level) as pool:
            latencies = list(pool.map(one, bodies))
        wall = time.perf_counter() - started
        results[level] = latencies
        print(
            f"{level:>11} {len(bodies) / wall:>8.2f} {percentile(latencies, 0.5) * 1000:>8.0f} "
            f"{percentile(latencies, 0.99) * 1000:>8.0f}"
        )
    overhead = statistics.fmean(results.get(1, [])) - statistics.fmean(library) if 1 in results else float("nan")
    print(
        f"library mean latency {statistics.fmean(library) * 1000:.0f} ms; HTTP + Serve overhead at concurrency 1: "
        f"{overhead * 1000:.0f} ms per request"
    )
    server.shutdown()


if __name__ == "__main__":
    main()
