"""Tokens/s of every way to decode the same prompts on the same weights, in one run: the number users look for.

    python benchmarks/bench_engine.py --zoo $ZOO [--prompts 24] [--max-new-tokens 128] [--widths 4,5,6,7,8] \\
        [--temperatures 0,1] [--batch 8]

On the zoo's held-out prompts (one at a time, batch 1), each decoder generating to a stop token or
--max-new-tokens, tokens/s = generated tokens over the wall time of the whole generation, prefill included:

- transformers: the target's plain greedy loop (`DynamicCache`, one token a step), and a `StaticCache` step under
  `torch.compile` (compiled once, before timing), with inductor's default wrapper (the baseline of the ratios) and
  with its C++ wrapper (what the static engine compiles with on a CPU);
- the engine (`blockpilot.decoding.engine`) with `--compile off`, its cycle eager: autoregressive and fixed b;
- the engine as the commands run it (`--compile auto`: compiled on a CPU, once per width before timing):
  autoregressive and fixed b, at every --widths (the best of them is the best fixed b).

T > 0 rows run where the decoder samples (the engine), compiled with both acceptance rules (`match`, and
`rejection` at every --widths). With --batch N, the engine also decodes the prompts N at a time, eager and compiled,
each row at its own b (cycling through --widths), rows leaving as they finish. Each temperature's decoders take turns, a pass over
the prompts each, --repeats rounds (the median is shown). Compile times are printed; the figures are timings of
this machine, so compare rows of one run only. First, each static cycle's time at batch 1 beside its arithmetic (its
FLOPs at this machine's matmul rate).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from blockpilot.data.sources import zoo_prompts
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.decoding.compiled import inductor_options
from blockpilot.decoding.engine import Engine, keep_compiled_kernels
from blockpilot.decoding.speed import plain_loop
from blockpilot.decoding.static import span_bucket
from blockpilot.models.loading import cache_keyword, load_models
from blockpilot.options import block_size_list
from blockpilot.policies.fixed import Autoregressive, FixedBlockSize


def say(text: str) -> None:
    print(text, flush=True)


class HFCompiled:
    """transformers' StaticCache with the one-token step under torch.compile; the prefill runs eager. With
    `cpp_wrapper`, compiled as the static engine compiles (`inductor_options`: the C++ wrapper on a CPU)."""

    def __init__(self, models, capacity: int, cpp_wrapper: bool = False) -> None:
        from transformers import StaticCache

        self.target = models.target
        self.cache = StaticCache(config=models.target.config, max_cache_len=capacity)
        self.keyword = cache_keyword(models.target)
        options = inductor_options(models.device) if cpp_wrapper else None
        self.step = torch.compile(self._step, fullgraph=True, dynamic=False, options=options)

    def _step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = self.target(input_ids=token, **{self.keyword: self.cache}, cache_position=position, use_cache=True)
        return out.logits[:, -1].argmax(dim=-1, keepdim=True)

    @torch.inference_mode()
    def __call__(self, prompt: list[int], max_new_tokens: int, stop: Sequence[int]) -> list[int]:
        self.cache.reset()
        positions = torch.arange(len(prompt))
        logits = self.target(
            input_ids=torch.tensor([prompt]), **{self.keyword: self.cache}, cache_position=positions, use_cache=True
        ).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens = [int(token)]
        while tokens[-1] not in stop and len(tokens) < max_new_tokens:
            token = self.step(token, torch.tensor([len(prompt) + len(tokens) - 1]))
            tokens.append(int(token))
        return tokens


def rates(
    decoders: list[tuple[str, Callable[[list[int]], list[int]]]], prompts: list[list[int]], repeats: int
) -> list[tuple[str, float, float]]:
    """(name, tokens/s, mean tokens a prompt) of each decoder: the median over `repeats` rounds, each round one pass
    of every decoder in turn over every prompt, one at a time (so the machine's drift falls on all of them alike)."""
    speeds: dict[str, list[float]] = {name: [] for name, _ in decoders}
    means: dict[str, float] = {}
    for _ in range(repeats):
        for name, decode in decoders:
            started, count = time.perf_counter(), 0
            for prompt in prompts:
                count += len(decode(prompt))
            speeds[name].append(count / (time.perf_counter() - started))
            means[name] = count / len(prompts)
    return [(name, statistics.median(speeds[name]), means[name]) for name, _ in decoders]


def engine_decode(
    models, policy, temperature: float, max_new_tokens: int, stop, engine=None, verify="match"
) -> Callable:
    def decode(prompt: list[int]) -> list[int]:
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop, seed=0, verify=verify
        )
        return generate_many(models, [GenerationRequest(prompt, config, policy)], engine=engine)[0].token_ids

    return decode


def batch_requests(prompts, sizes, temperature: float, max_new_tokens: int, stop) -> list[GenerationRequest]:
    config = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop)
    return [
        GenerationRequest(p, GenerationConfig(**config, seed=i), FixedBlockSize(b))
        for i, (p, b) in enumerate(zip(prompts, sizes, strict=True))
    ]


def batch_rate(models, requests, engine=None) -> float:
    started = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in generate_many(models, requests, max_batch=len(requests), engine=engine))
    return tokens / (time.perf_counter() - started)


def matmul_rate(size: int = 1024, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate in FLOP/s: a (size x size) product, the median of `repeats`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * size**3 / statistics.median(times)


def cycle_against_arithmetic(static: dict[int, Engine], prompt: list[int], cycles: int = 200) -> None:
    """Each compiled cycle's time at batch 1 (the best of 3 rounds of `cycles`) beside its arithmetic: the FLOPs of
    the eager cycle (`FlopCounterMode`: matmuls and attention) at this machine's matmul rate."""
    from torch.utils.flop_counter import FlopCounterMode

    rate = matmul_rate()
    say(f"  a cycle against its arithmetic (batch 1; this machine's fp32 matmul rate: {rate / 1e9:.0f} GFLOP/s)")
    step = None
    for width, engine in sorted(static.items()):
        decoder, length = engine.decoder, len(prompt) - 1
        decoder.prefill(0, [torch.tensor(prompt[:-1])])
        decoder.place(0, length=length, last_token=prompt[-1], temperature=0.0, seed=0)
        decoder.set_block_sizes([width])
        span = span_bucket(length + width, decoder.capacity)
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            decoder._cycle(1, span, width)
        rounds = []
        for _ in range(3):
            started = time.perf_counter()
            for _ in range(cycles):
                decoder.length[0] = length
                decoder.cycle(1, span, width)
            rounds.append((time.perf_counter() - started) / cycles)
        decoder.free(0)
        seconds, flops = min(rounds), counter.get_total_flops()
        step = step or seconds
        say(
            f"  width {width}: {seconds * 1e3:.3f} ms a cycle ({seconds / step:.2f}x the one-token step), "
            f"{flops / 1e6:.1f} MFLOP = {flops / rate * 1e3:.3f} ms of arithmetic: {seconds * rate / flops:.1f}x it"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--zoo", type=Path, required=True, help="a built zoo (its target, drafter and held-out prompts)"
    )
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--widths", type=block_size_list, default=None, help="fixed b to run (default: B-2 .. B+2)")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--batch", type=int, default=0, help="also decode N prompts at a time, rows of mixed b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    models = load_models(args.zoo / "target", args.zoo / "drafter", device="cpu")
    stop = tuple(models.stop_token_ids())
    prompts = [models.encode_prompt(r.turns[0]) for r in zoo_prompts(args.zoo, "heldout")[: args.prompts]]
    B = models.train_block_size
    widths = list(args.widths or range(max(2, B - 2), B + 3))
    capacity = max(len(p) for p in prompts) + args.max_new_tokens + max(widths) + 8
    temperatures = [float(t) for t in args.temperatures.split(",")]
    say(
        f"{args.zoo.name}: B = {B}, {len(prompts)} held-out prompts, up to {args.max_new_tokens} new tokens, "
        f"batch 1, torch {torch.__version__} on {torch.get_num_threads()} threads; tokens/s over whole generations"
    )

    keep_compiled_kernels()
    static: dict[int, Engine] = {}
    for width in [1, *widths]:
        engine = Engine(models, width=width, capacity=capacity, compile="compile")
        generate_many(models, [GenerationRequest(prompts[0], GenerationConfig(max_new_tokens=4))], engine=engine)
        static[width] = engine
        say(f"  cycle compiled at width {width} in {engine.compile_seconds:.0f} s")
    cycle_against_arithmetic(static, prompts[0])
    hf_compiled, hf_cpp = HFCompiled(models, capacity), HFCompiled(models, capacity, cpp_wrapper=True)
    for name, loop in [("", hf_compiled), (" (C++ wrapper)", hf_cpp)]:
        started = time.perf_counter()
        loop(prompts[0], 4, stop)
        say(f"  transformers' static step{name} compiled in {time.perf_counter() - started:.0f} s")

    decoders: list[tuple[str, Callable]] = []  # one temperature's, timed together

    def add(name: str, decode: Callable) -> None:
        decoders.append((name, decode))

    for temperature in temperatures:
        decoders.clear()

        if temperature == 0:
            greedy = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
            add("transformers, plain loop", lambda p, greedy=greedy: plain_loop(models, p, greedy))
            add("transformers, static cache + compile", lambda p: hf_compiled(p, args.max_new_tokens, stop))
            add("transformers, the same, C++ wrapper", lambda p: hf_cpp(p, args.max_new_tokens, stop))
        add("eager cycle, autoregressive", engine_decode(models, Autoregressive(), temperature, args.max_new_tokens, stop))
        for width in widths:
            add(
                f"eager cycle, fixed b = {width}",
                engine_decode(models, FixedBlockSize(width), temperature, args.max_new_tokens, stop),
            )
        add("compiled, autoregressive", engine_decode(models, None, temperature, args.max_new_tokens, stop, static[1]))
        for width in widths:
            policy = FixedBlockSize(width)
            add(
                f"compiled, fixed b = {width}",
                engine_decode(models, policy, temperature, args.max_new_tokens, stop, static[width]),
            )
        for width in widths if temperature > 0 else []:  # the other acceptance rule (its cycle compiles on first use)
            rejection = engine_decode(
                models, FixedBlockSize(width), temperature, args.max_new_tokens, stop, static[width], "rejection"
            )
            rejection(prompts[0])
            add(f"compiled, fixed b = {width}, rejection", rejection)
        rows = rates(decoders, prompts, args.repeats)
        for name, speed, mean in rows:
            say(f"  T = {temperature:g}  {name:<36} {speed:9.1f} tokens/s  ({mean:.1f} tokens a prompt)")
        baseline = next((speed for name, speed, _ in rows if name == "transformers, static cache + compile"), None)
        cpp = next((speed for name, speed, _ in rows if name == "transformers, the same, C++ wrapper"), None)
        best = max(
            (r for r in rows if r[0].startswith("compiled, fixed") and "rejection" not in r[0]), key=lambda r: r[1]
        )
        fixed_B = next((r for r in rows if r[0] == f"compiled, fixed b = {B}"), best)  # B, when --widths has it
        say(
            f"T = {temperature:g}: {fixed_B[0]} {fixed_B[1]:.1f}, best fixed ({best[0]}) {best[1]:.1f} tokens/s"
            + (
                f"; x compiled transformers: {fixed_B[1] / baseline:.2f} and {best[1] / baseline:.2f} "
                f"(x its C++ wrapper: {fixed_B[1] / cpp:.2f} and {best[1] / cpp:.2f})"
                if baseline and cpp
                else ""
            )
        )

    if args.batch > 1:
        for batch_size in sorted({args.batch, *([32] if args.batch < 32 <= len(prompts) else [])}):
            batch = prompts[:batch_size]
            sizes = [widths[i % len(widths)] for i in range(len(batch))]
            engine = Engine(models, max_batch=len(batch), width=max(sizes), capacity=capacity, compile="compile")
            for temperature in temperatures:
                requests = batch_requests(batch, sizes, temperature, args.max_new_tokens, stop)
                batch_rate(models, requests, engine)  # compiles the row counts it meets
                eager, static_speed = batch_rate(models, requests), batch_rate(models, requests, engine)
                say(
                    f"batch {len(batch)}, b = {sizes[: len(widths)]}..., T = {temperature:g}: eager cycle {eager:.1f} "
                    f"tokens/s, compiled {static_speed:.1f} tokens/s (compiled in {engine.compile_seconds:.0f} s)"
                )


if __name__ == "__main__":
    main()
