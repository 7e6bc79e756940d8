"""The load curve through the endpoint: tokens/s and latency per mode and concurrency, and the HTTP overhead.

    python benchmarks/bench_serve.py --zoo ZOO [--predictor DIR_OR_URI] [--step-model DIR_OR_URI] [--temperature 1]
    # ZOO from `blockpilot zoo build --out ZOO`; the models from `blockpilot demo` or `blockpilot train`

Starts an embedded Ray and the Serve endpoint on 127.0.0.1 (one replica, one batched engine of --max-batch rows,
its shapes built up front as `serve` builds them), then, in interleaved rounds (each starting with another mode), for
each concurrency and mode sends the same held-out prompts (`ignore_eos`, so every request generates exactly
max_tokens): modes `autoregressive` (fixed b = 1), `fixed` (b = B) and `adaptive` (the replica's policy, as `serve`
resolves it from the models given), and `fixed:N` where asked.
Requests stream (`stream: true`, as a chat client reads them): per request the time to its first token (TTFT) and
per output token after it (TPOT), and from its last event the shape of every cycle it ran. Prints each
(concurrency, mode)'s median tokens/s over the rounds and, of its median round, requests/s, TTFT and TPOT p50/p99,
tau (tokens a cycle) and the shapes its cycles ran (the share of each), and the adaptive mode against the best
other one. Before that, the same requests go
one by one through the library's decoder in this process: the difference of mean latencies at concurrency 1 is the
HTTP + Serve overhead per request. The curve is logged to MLflow (experiment `blockpilot-load`, each mode's tokens/s
by concurrency, and its latencies and tau; notebook 04 draws the newest), unless --no-track.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from blockpilot.blocks import cycle_shapes
from blockpilot.load_curve import LOAD_EXPERIMENT, log_load_curve
from blockpilot.tracking import start_run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


@dataclass(frozen=True)
class Streamed:
    """One streamed request as the client saw it: seconds to its first token and to its end, tokens, and the block
    size of each of its cycles (its last event's `blockpilot` stats)."""

    first_token_s: float
    total_s: float
    tokens: int
    shapes: list[str]  # every cycle's (`blocks.cycle_shapes`)

    @property
    def per_output_token_s(self) -> float:
        """TPOT: the seconds between tokens after the first."""
        return (self.total_s - self.first_token_s) / max(self.tokens - 1, 1)


def read_stream(lines: Iterable[str], started: float, clock=time.perf_counter) -> Streamed:
    """A completion's server-sent events (OpenAI's chunks, `stream_options.include_usage`) read to `[DONE]`."""
    first = stats = usage = None
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            raise RuntimeError(f"the stream failed: {event['error']['message']}")
        if first is None and event["choices"][0]["text"]:
            first = clock() - started
        if "blockpilot" in event:
            stats, usage = event["blockpilot"], event["usage"]
    total = clock() - started
    if first is None or stats is None:
        raise RuntimeError("the stream ended without a token or without its final stats")
    return Streamed(first, total, usage["completion_tokens"], cycle_shapes(stats["block_sizes"], stats["tree_nodes"]))


def shapes(cycles: list[str]) -> str:
    """The share of cycles of each shape, most common first: 'b=1 62% tree:15 38%'."""
    counts = Counter(cycles)
    return " ".join(f"{shape} {n / len(cycles):.0%}" for shape, n in counts.most_common(3)) if cycles else "-"


STREAMED = {"stream": True, "stream_options": {"include_usage": True}}  # the fields that make a request stream
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
    parser.add_argument(
        "--compile-spans",
        type=int,
        default=2,
        help="spans of cache the replica builds (serve's --compile-spans; 2: 256 and 512 slots, which hold the zoos' "
        "held-out prompts and 64 tokens: a row past the built spans runs eagerly, in every mode)",
    )
    parser.add_argument(
        "--stream-interval-s",
        type=float,
        default=None,
        help="seconds between a stream's chunks after its first (serve's flag; default: serve's)",
    )
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
    if args.stream_interval_s is not None:
        limits = dataclasses.replace(limits, stream_interval_s=args.stream_interval_s)
    loader = ModelLoader(
        str(args.zoo / "target"),
        str(args.zoo / "drafter"),
        args.predictor,
        step_model=args.step_model,
        policy=args.policy,
        compile_spans=args.compile_spans,
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
        request = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True}
        return {**request, **sampling, **fields[mode], **STREAMED}

    levels = [int(c) for c in args.concurrency.split(",")]
    # One pooled client: `httpx.post` builds a client (and an SSL context) per call, and at concurrency 32 that
    # load generator took half of a 2-core machine away from the server it measures.
    limits_http = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    client = httpx.Client(timeout=600, limits=limits_http)

    def one(payload: dict) -> Streamed:
        started = time.perf_counter()
        with client.stream("POST", url, json=payload) as response:
            response.raise_for_status()
            return read_stream(response.iter_lines(), started)

    for mode in modes:  # warm-up: every mode's first cycles at every batch
        with ThreadPoolExecutor(max_workers=max(levels)) as pool:
            list(pool.map(one, [body(p, mode, i) for i, p in enumerate(prompts)]))
    runs: dict[tuple[int, str], list[tuple[float, float, list[Streamed]]]] = {}
    for round_index in range(args.rounds):
        for level in levels:
            for mode in modes[round_index % len(modes) :] + modes[: round_index % len(modes)]:  # no mode always first
                started = time.perf_counter()
                with ThreadPoolExecutor(max_workers=level) as pool:
                    answers = list(pool.map(one, [body(p, mode, i) for i, p in enumerate(prompts)]))
                wall = time.perf_counter() - started
                runs.setdefault((level, mode), []).append((sum(a.tokens for a in answers) / wall, wall, answers))

    print(
        f"requests per run: {len(prompts)}, max_tokens {args.max_tokens} (ignore_eos), T={args.temperature:g}, one "
        f"replica, engine max_batch {args.max_batch}, stream interval {limits.stream_interval_s:g} s, "
        f"{args.num_cpus:g} CPUs, {args.rounds} interleaved rounds "
        f"(medians); adaptive = {adaptive_name}; latencies in ms, p50 / p99"
    )
    print(
        f"{'concurrency':>11} {'mode':<15} {'tokens/s':>9} {'x best other':>12} {'req/s':>6} {'TTFT':>11} "
        f"{'TPOT':>9} {'tau':>5}  shapes"
    )
    curves: dict[str, dict[str, dict[int, float]]] = {}  # metric -> mode -> concurrency -> value
    for level in levels:
        rates = {mode: statistics.median(r[0] for r in runs[(level, mode)]) for mode in modes}
        for mode in modes:
            median_run = sorted(runs[(level, mode)], key=lambda r: r[0])[len(runs[(level, mode)]) // 2]
            answers = median_run[2]
            others = [rates[m] for m in modes if m != mode]
            versus = f"{rates[mode] / max(others):.3f}" if others else "-"
            cycles = [shape for a in answers for shape in a.shapes]
            tau = sum(a.tokens - 1 for a in answers) / max(len(cycles), 1)  # the first token comes from the prefill
            figures = {
                "tokens_per_s": rates[mode],
                "p99_ms": percentile([a.total_s for a in answers], 0.99) * 1000,
                "ttft_p50_ms": percentile([a.first_token_s for a in answers], 0.5) * 1000,
                "ttft_p99_ms": percentile([a.first_token_s for a in answers], 0.99) * 1000,
                "tpot_p50_ms": percentile([a.per_output_token_s for a in answers], 0.5) * 1000,
                "tpot_p99_ms": percentile([a.per_output_token_s for a in answers], 0.99) * 1000,
                "tau": tau,
            }
            for metric, value in figures.items():
                curves.setdefault(metric, {}).setdefault(mode, {})[level] = value
            print(
                f"{level:>11} {mode:<15} {rates[mode]:>9.1f} {versus:>12} {len(prompts) / median_run[1]:>6.2f} "
                f"{figures['ttft_p50_ms']:>5.0f}/{figures['ttft_p99_ms']:<5.0f} "
                f"{figures['tpot_p50_ms']:>4.1f}/{figures['tpot_p99_ms']:<4.1f} {tau:>5.2f}  {shapes(cycles)}",
                flush=True,
            )
    overhead = statistics.fmean(a.total_s for a in runs[(levels[0], modes[-1])][0][2]) - statistics.fmean(library)
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
        "compile_spans": args.compile_spans,
    }
    with start_run(LOAD_EXPERIMENT, f"{args.zoo.name}-T{args.temperature:g}", enabled=not args.no_track) as tracker:
        tracker.log_params(params)
        log_load_curve(tracker, curves.pop("tokens_per_s"), **curves)
    if tracker.enabled:
        print(f"logged to MLflow: experiment {LOAD_EXPERIMENT}, run {tracker.run_id} (tokens/s by concurrency a step)")


if __name__ == "__main__":
    main()
