"""Endpoint throughput and latency under load, per policy, and the HTTP overhead over the library.

    python benchmarks/bench_serve.py --zoo ZOO [--predictor DIR_OR_URI]
    # ZOO from `blockpilot zoo build --out ZOO`

Starts an embedded Ray and the Serve endpoint on 127.0.0.1 (one replica, one batched engine of --max-batch
rows), then for each policy (the server's adaptive one, and fixed b = B) and each concurrency (1, 8, 32)
sends the same bounded set of completion requests (T = 0, `ignore_eos` so every request generates exactly
max_tokens) and prints requests/s, generated tokens/s and p50/p99 latency. Before that, the same requests go
one by one through the library's `BatchedDecoder` in this process: the difference of mean latencies at
concurrency 1 is the HTTP + Serve overhead per request.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--predictor", default=None, help="the adaptive policy's predictor (default: none, fixed B)")
    parser.add_argument("--policy", default=None, help="the adaptive policy's spec, e.g. entropy")
    parser.add_argument("--requests", type=int, default=32, help="requests per (policy, concurrency)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8, help="rows in the replica's engine")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs of the replica (its torch threads)")
    args = parser.parse_args()

    from blockpilot.data.sources import prompt_texts
    from blockpilot.serving import ServeLimits
    from pipelines.serve import ModelLoader, serve_locally

    texts = prompt_texts(f"zoo:{args.zoo}:heldout")
    prompts = [texts[i % len(texts)] for i in range(args.requests)]
    limits = ServeLimits(max_batch=args.max_batch, max_queue=max(64, args.requests))
    loader = ModelLoader(
        str(args.zoo / "target"), str(args.zoo / "drafter"), args.predictor, policy=args.policy, limits=limits
    )

    decoder = loader()
    requests = [
        decoder.check(decoder.encode_completion(p), max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts
    ]
    decoder.complete(requests[0])  # warm-up
    library = []
    for request in requests:
        started = time.perf_counter()
        decoder.complete(request)
        library.append(time.perf_counter() - started)
    adaptive_name = decoder.adaptive.name
    decoder.stop()
    del decoder

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = serve_locally(loader, port=port, num_cpus=args.num_cpus)
    url = f"{server.url}/v1/completions"
    server.wait_healthy()

    def body(prompt: str, policy: str) -> dict:
        return {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "policy": policy}

    levels = [int(c) for c in args.concurrency.split(",")]
    # One pooled client: `httpx.post` builds a client (and an SSL context) per call, and at concurrency 32 that
    # load generator took half of a 2-core machine away from the server it measures.
    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels)))
    client.post(url, json=body(prompts[0], "adaptive")).raise_for_status()  # warm-up

    def one(payload: dict) -> tuple[float, int, str]:
        started = time.perf_counter()
        response = client.post(url, json=payload)
        response.raise_for_status()
        answer = response.json()
        return time.perf_counter() - started, answer["usage"]["completion_tokens"], answer["blockpilot"]["policy"]

    print(
        f"requests per level: {len(prompts)}, max_tokens {args.max_tokens} (ignore_eos), T=0, one replica, "
        f"engine max_batch {args.max_batch}, {args.num_cpus:g} CPUs; adaptive = {adaptive_name}"
    )
    print(f"{'policy':<16} {'concurrency':>11} {'req/s':>8} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    latencies_at_one = []
    for policy in ("adaptive", "fixed"):
        for level in levels:
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=level) as pool:
                answers = list(pool.map(one, [body(p, policy) for p in prompts]))
            wall = time.perf_counter() - started
            latencies = [a[0] for a in answers]
            if policy == "adaptive" and level == 1:
                latencies_at_one = latencies
            print(
                f"{policy + '=' + answers[0][2]:<16} {level:>11} {len(prompts) / wall:>8.2f} {sum(a[1] for a in answers) / wall:>9.1f} "
                f"{percentile(latencies, 0.5) * 1000:>8.0f} {percentile(latencies, 0.99) * 1000:>8.0f}",
                flush=True,
            )
    if latencies_at_one:
        overhead = statistics.fmean(latencies_at_one) - statistics.fmean(library)
        print(
            f"library mean latency {statistics.fmean(library) * 1000:.0f} ms; HTTP + Serve overhead at concurrency 1: "
            f"{overhead * 1000:.0f} ms per request"
        )
    client.close()
    server.shutdown()


if __name__ == "__main__":
    main()
