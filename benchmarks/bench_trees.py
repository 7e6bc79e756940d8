"""Draft trees against chains on the static engine, in one run: tau and tokens/s on the same prompts and weights.

    python benchmarks/bench_trees.py --zoo $ZOO [--prompts 32] [--max-new-tokens 128] [--budgets 3,7,15,31] \\
        [--widths 4,5,6,7,8] [--temperatures 0,1] [--compile compile] [--batch 8] [--predictor PATH] \\
        [--device cuda --compile compile+graph]

On the zoo's held-out prompts, one at a time (and --batch N at a time), each decoder generating to a stop token or
--max-new-tokens: tau (tokens a cycle commits, the target's own token included) and tokens/s over whole generations,
prefill included, for the static engine's chains at every --widths (fixed b) and its trees of every --budgets nodes
(`tree:N`, --depth deep, every slot's top 8), and with --predictor a per-request predictor over shapes
(`blockpilot train --trees`) against the best fixed shape. At batch 1 it also prints, for each tree, its cycle's
cost against the best chain's and what its tau alone is worth: the tokens/s it would reach were its cycle to cost
the chain's (its prefill and host work as measured). Each decoder's cycle is compiled (or not, per
--compile) by a first pass, then timed in --repeats rounds over every decoder (the median of each); the figures
are timings of this machine, so compare rows of one run only. The zoo runs in the device's default dtype (bf16 on a
GPU: in float32 there, cuBLAS picked a kernel 10x slower for some widths' products, the log's 2026-11-26 (morning)).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from blockpilot.data.sources import zoo_prompts
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.decoding.calibration import device_name
from blockpilot.decoding.compiled import COMPILE_MODES
from blockpilot.decoding.engine import Engine, keep_compiled_kernels, shape_for
from blockpilot.models.loading import load_models
from blockpilot.options import block_size_list
from blockpilot.policies.fixed import FixedBlockSize, FixedTree
from blockpilot.policies.resolve import resolve_policy


def say(text: str) -> None:
    print(text, flush=True)


def one_pass(models, engine, requests, batch: int) -> tuple[int, int, int, float, float]:
    """(tokens, tokens committed by cycles, cycles, seconds, seconds in cycles) of one pass over `requests`, `batch`
    at a time. The seconds in cycles add up each generation's (at batch 1, the engine's own)."""
    started, tokens, committed, cycles, in_cycles = time.perf_counter(), 0, 0, 0, 0.0
    for first in range(0, len(requests), batch):
        for result in generate_many(models, requests[first : first + batch], engine=engine):
            tokens += len(result.token_ids)
            committed += sum(result.acceptance_lengths)
            cycles += len(result.acceptance_lengths)
            in_cycles += result.decode_time_s
    return tokens, committed, cycles, time.perf_counter() - started, in_cycles


def tree_ceiling(tree: tuple[int, int, float, float], chain: tuple[int, int, float, float]) -> tuple[float, float]:
    """(a tree's cycle cost over the chain's, the tokens/s it would reach over the chain's were its cycle to cost the
    chain's), from each decoder's (tokens, cycles, seconds, seconds in cycles) at batch 1: what the tree's tau alone
    is worth, with its prefill and host work as measured."""
    tokens, cycles, seconds, in_cycles = tree
    chain_tokens, chain_cycles, chain_seconds, chain_in_cycles = chain
    chain_cycle = chain_in_cycles / chain_cycles
    at_chain_cost = seconds - in_cycles + cycles * chain_cycle
    return (in_cycles / cycles) / chain_cycle, (tokens / at_chain_cost) / (chain_tokens / chain_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True, help="a built zoo (its target, drafter, held-out prompts)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=block_size_list, default=(3, 7, 15, 31))
    parser.add_argument("--depth", type=int, default=None, help="the trees' depth, as a block size (default: B)")
    parser.add_argument("--widths", type=block_size_list, default=None, help="chains' b (default: B-2 .. B+2)")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="compile")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--predictor", default=None, help="also a per-request predictor over shapes (`train --trees`): learned:PATH"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: the device's (float32 on a CPU, bfloat16 on a GPU)")
    args = parser.parse_args()

    keep_compiled_kernels()
    models = load_models(args.zoo / "target", args.zoo / "drafter", device=args.device, dtype=args.dtype)
    prompts = [models.encode_prompt(r.turns[0]) for r in zoo_prompts(args.zoo, "heldout")[: args.prompts]]
    B = models.train_block_size
    widths = list(args.widths or range(max(2, B - 2), B + 3))
    learned = resolve_policy(f"learned:{args.predictor}", models) if args.predictor else None
    reach = max(*widths, *args.budgets, args.depth or 0, (learned.tree_nodes or 0) + 1 if learned else 0)
    capacity = max(map(len, prompts)) + args.max_new_tokens + reach + 8
    say(
        f"{args.zoo.name}: B = {B}, {len(prompts)} held-out prompts, up to {args.max_new_tokens} new tokens, batch "
        f"{args.batch}, static engine ({args.compile}), torch {torch.__version__} on {device_name(models.device)}"
    )
    decoders = [(f"chain b = {b}", FixedBlockSize(b), dict(width=b)) for b in widths]
    depth = args.depth or B
    decoders += [
        (f"tree:{n} (depth {depth})", FixedTree(n, depth), dict(width=depth, tree_nodes=n)) for n in args.budgets
    ]
    if learned is not None:
        width, nodes = shape_for(learned)
        decoders.append(("learned (shapes)", learned, dict(width=max(width or 0, *widths), tree_nodes=nodes)))
    stop = tuple(models.stop_token_ids())
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        requests = [
            GenerationRequest(p, GenerationConfig(args.max_new_tokens, temperature, stop_token_ids=stop, seed=i))
            for i, p in enumerate(prompts)
        ]
        engines = []
        for name, policy, shape in decoders:
            engine = Engine(
                models, max_batch=args.batch, capacity=capacity, compile=args.compile, sampling=temperature > 0, **shape
            )
            ours = [replace(r, policy=policy) for r in requests]
            one_pass(models, engine, ours, args.batch)  # compiles every shape the pass meets
            engine.verified_nodes.clear()
            engines.append((name, engine, ours))
        # Rounds over every decoder, so that the machine's drift falls on all of them alike.
        speeds: dict[str, list[float]] = {name: [] for name, *_ in engines}
        passes: dict[str, list[tuple[int, int, float, float]]] = {name: [] for name, *_ in engines}
        taus: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, engine, ours in engines:
                tokens, committed, cycles, seconds, in_cycles = one_pass(models, engine, ours, args.batch)
                speeds[name].append(tokens / seconds)
                passes[name].append((tokens, cycles, seconds, in_cycles))
                taus[name] = committed / max(cycles, 1)
        rows = [(name, taus[name], statistics.median(speeds[name])) for name, *_ in engines]
        for (name, tau, speed), (_, engine, _) in zip(rows, engines, strict=True):
            built = engine.compile_seconds or 0.0
            sizes = ""
            if name.startswith("learned"):
                sizes = ", cycles by tree size " + str(dict(sorted(engine.verified_nodes.items())))
            say(
                f"  T = {temperature:g}  {name:<22} tau {tau:5.2f}  {speed:8.1f} tokens/s  (built in {built:.0f} s{sizes})"
            )
        chains = [r for r in rows if r[0].startswith("chain")]
        trees = [r for r in rows if r[0].startswith("tree")]
        best_chain_tau, best_chain_speed = max(chains, key=lambda r: r[1]), max(chains, key=lambda r: r[2])
        best_tree_tau, best_tree_speed = max(trees, key=lambda r: r[1]), max(trees, key=lambda r: r[2])
        say(
            f"T = {temperature:g}: tau, best tree ({best_tree_tau[0]}) {best_tree_tau[1]:.2f} against best chain "
            f"({best_chain_tau[0]}) {best_chain_tau[1]:.2f}: {best_tree_tau[1] / best_chain_tau[1]:.2f}x; tokens/s, "
            f"best tree ({best_tree_speed[0]}) {best_tree_speed[2]:.1f} against best chain ({best_chain_speed[0]}) "
            f"{best_chain_speed[2]:.1f}: {best_tree_speed[2] / best_chain_speed[2]:.2f}x"
        )
        if args.batch == 1:  # what each tree's tau alone is worth against the best chain, this run's medians
            chain = best_chain_speed[0]
            median_pass = lambda name: tuple(statistics.median(p[i] for p in passes[name]) for i in range(4))  # noqa: E731
            for name, *_ in trees:
                cost, ceiling = tree_ceiling(median_pass(name), median_pass(chain))
                say(
                    f"T = {temperature:g}: {name}: a cycle {cost:.2f}x the best chain's ({chain}); were it to cost "
                    f"the chain's, {ceiling:.2f}x the best chain's tokens/s"
                )
        for name, tau, speed in (r for r in rows if r[0].startswith("learned")):
            best_fixed = max(chains + trees, key=lambda r: r[2])
            say(
                f"T = {temperature:g}: {name} {speed:.1f} tokens/s (tau {tau:.2f}) against the best fixed shape "
                f"({best_fixed[0]}) {best_fixed[2]:.1f}: {speed / best_fixed[2]:.2f}x"
            )


if __name__ == "__main__":
    main()
