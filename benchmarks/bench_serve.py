"""The load curve through the endpoint: tokens/s and latency per mode and concurrency, and the HTTP overhead.

    python benchmarks/bench_serve.py --zoo ZOO [--predictor DIR_OR_URI] [--step-model DIR_OR_URI] [--temperature 1]
    # ZOO from `blockpilot zoo build --out ZOO`; the models from `blockpilot demo` or `blockpilot train`

Starts an embedded Ray and the Serve endpoint on 127.0.0.1 (one replica, one batched engine of --max-batch rows,
its shapes built up front as `serve` builds them), then, in interleaved rounds (each starting with another mode), for
each concurrency and mode sends the same held-out prompts (`ignore_eos`, so every request generates exactly
max_tokens): modes `autoregressive` (fixed b = 1), `fixed` (b = B) and `adaptive` (the replica's policy, as `serve`
resolves it from the models given), and `fixed:N` where asked.
Prints each (concurrency, mode)'s median tokens/s, requests/s and p50/p99 latency over the rounds, the adaptive mode
against the best other one, and the share of its cycles that ran autoregressive. Before that, the same requests go
one by one through the library's decoder in this process: the difference of mean latencies at concurrency 1 is the
HTTP + Serve overhead per request. The curve is logged to MLflow (experiment `blockpilot-load`, each mode's tokens/s
by concurrency; notebook 04 draws the newest), unless --no-track.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from blockpilot.load_curve import LOAD_EXPERIMENT, log_load_curve
from blockpilot.tracking import start_run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


MODES = {"autoregressive": {"policy": "fixed", "block_size": 1}, "fixed": {"policy": "fixed"}, "adaptive": {}}


def mode_fields(mode: str) -> dict:
    """A mode's request fields: one of `MODES`, or `fixed:N` (every request forcing b = N)."""
    if mode in MODES:
        return MODES[mode]
    kind, _, size = mode.partition(":")
    if kind != "fixed" or not size.isdigit() or int(size) < 1:
        raise ValueError(f"unknown mode {mode!r}; expected one of {list(MODES)} or fixed:N")
    return {"policy": "fixed", "block_size": int(size)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True)
    parser.add_argument("--predictor", default=None, help="the per-request predictor (folder or models:/ URI)")
    parser.add_argument("--step-model", default=None, help="the per-step model (folder or models:/ URI)")
    parser.add_argument("--policy", default=None, help="the adaptive policy's spec (default: serve's, from the models)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--requests", type=int, default=32, help="requests per (mode, concurrency, round)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)} and fixed:N")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16, help="rows in the replica's engine")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs of the replica (its torch threads)")
    parser.add_argument("--no-track", action="store_true", help=f"do not log the curve to MLflow ({LOAD_EXPERIMENT})")
    args = parser.parse_args()
    modes = args.modes.split(",")
    try:
        fields = {mode: mode_fields(mode) for mode in modes}
    except ValueError as error:
        parser.error(str(error))

    from blockpilot.data.sources import prompt_texts
    from blockpilot.serving import ServeLimits
    from pipelines.serve import ModelLoader, serve_locally

    texts = prompt_texts(f"zoo:{args.zoo}:heldout")
    prompts = [texts[i % len(texts)] for i in range(args.requests)]
    limits = ServeLimits(max_batch=args.max_batch, max_queue=max(64, args.requests))
    loader = ModelLoader(
        str(args.zoo / "target"),
        str(args.zoo / "drafter"),
        args.predictor,
        step_model=args.step_model,
        policy=args.policy,
        limits=limits,
    )

    decoder = loader()
    requests = [
        decoder.check(
            decoder.encode_completion(p), max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True
        )
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

    def body(prompt: str, mode: str, index: int) -> dict:
        sampling = {"temperature": args.temperature, "seed": index}
        return {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, **sampling, **fields[mode]}

    levels = [int(c) for c in args.concurrency.split(",")]
    # One pooled client: `httpx.post` builds a client (and an SSL context) per call, and at concurrency 32 that
    # load generator took half of a 2-core machine away from the server it measures.
    limits_http = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    client = httpx.Client(timeout=600, limits=limits_http)

    def one(payload: dict) -> tuple[float, int, list[int]]:
        started = time.perf_counter()
        response = client.post(url, json=payload)
        response.raise_for_status()
        answer = response.json()
        return time.perf_counter() - started, answer["usage"]["completion_tokens"], answer["blockpilot"]["block_sizes"]

    for mode in modes:  # warm-up: every mode's first cycles at every batch
        with ThreadPoolExecutor(max_workers=max(levels)) as pool:
            list(pool.map(one, [body(p, mode, i) for i, p in enumerate(prompts)]))
    runs: dict[tuple[int, str], list[tuple[float, float, list]]] = {}
    for round_index in range(args.rounds):
        for level in levels:
            for mode in modes[round_index % len(modes) :] + modes[: round_index % len(modes)]:  # no mode always first
                started = time.perf_counter()
                with ThreadPoolExecutor(max_workers=level) as pool:
                    answers = list(pool.map(one, [body(p, mode, i) for i, p in enumerate(prompts)]))
                wall = time.perf_counter() - started
                runs.setdefault((level, mode), []).append((sum(a[1] for a in answers) / wall, wall, answers))

    print(
        f"requests per run: {len(prompts)}, max_tokens {args.max_tokens} (ignore_eos), T={args.temperature:g}, one "
        f"replica, engine max_batch {args.max_batch}, {args.num_cpus:g} CPUs, {args.rounds} interleaved rounds "
        f"(medians); adaptive = {adaptive_name}"
    )
    header = f"{'concurrency':>11} {'mode':<15} {'tokens/s':>9} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8}"
    print(f"{header} {'x best other':>12}")
    tokens_per_s: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    p99_ms: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    for level in levels:
        rates = {mode: statistics.median(r[0] for r in runs[(level, mode)]) for mode in modes}
        for mode in modes:
            median_run = sorted(runs[(level, mode)], key=lambda r: r[0])[len(runs[(level, mode)]) // 2]
            latencies = [a[0] for a in median_run[2]]
            others = [rates[m] for m in modes if m != mode]
            versus = f"{rates[mode] / max(others):.3f}" if others else "-"
            sizes = [b for a in median_run[2] for b in a[2]]
            share = (
                f" ({sum(b == 1 for b in sizes) / max(len(sizes), 1):.0%} of cycles b = 1)"
                if mode == "adaptive"
                else ""
            )
            tokens_per_s[mode][level], p99_ms[mode][level] = rates[mode], percentile(latencies, 0.99) * 1000
            print(
                f"{level:>11} {mode:<15} {rates[mode]:>9.1f} {len(prompts) / median_run[1]:>7.2f} "
                f"{percentile(latencies, 0.5) * 1000:>8.0f} {percentile(latencies, 0.99) * 1000:>8.0f} {versus:>12}"
                f"{share}",
                flush=True,
            )
    overhead = statistics.fmean(a[0] for a in runs[(levels[0], modes[-1])][0][2]) - statistics.fmean(library)
    print(
        f"library mean latency {statistics.fmean(library) * 1000:.0f} ms; HTTP + Serve overhead at concurrency "
        f"{levels[0]} ({modes[-1]}): {overhead * 1000:.0f} ms per request"
    )
    client.close()
    server.shutdown()
    params = {
        "zoo": args.zoo.name,
        "adaptive": adaptive_name,
        "temperature": args.temperature,
        "max_batch": args.max_batch,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "rounds": args.rounds,
        "num_cpus": args.num_cpus,
    }
    with start_run(LOAD_EXPERIMENT, f"{args.zoo.name}-T{args.temperature:g}", enabled=not args.no_track) as tracker:
        tracker.log_params(params)
        log_load_curve(tracker, tokens_per_s, p99_ms)
    if tracker.enabled:
        print(f"logged to MLflow: experiment {LOAD_EXPERIMENT}, run {tracker.run_id} (tokens/s by concurrency a step)")


if __name__ == "__main__":
    main()
