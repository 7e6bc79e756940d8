"""Measured decode speed of a policy over a set of prompts: the one measurement that the decoding benchmark,
the demo's policy table and the predictors notebook print; and of the baseline every user knows, transformers'
plain greedy loop on the same target. Several decoders compared on one machine: `measure_speeds`, interleaved
prompt by prompt."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from blockpilot.blocks import cycle_shapes
from blockpilot.decoding.engine import Engine, generate_many
from blockpilot.decoding.request import GenerationConfig, GenerationRequest
from blockpilot.models.loading import SpeculativeModels, cache_keyword
from blockpilot.policies.base import BlockSizePolicy


@dataclass(frozen=True)
class PolicySpeed:
    """Generated tokens per second of wall time over all prompts, and tau: the tokens the generations' cycles
    committed over those cycles (`pooled_tau`), as a walk counts it (`walks.py`)."""

    policy: str  # the resolved policy's name, as every surface reports it
    tokens: int
    seconds: float
    tau: float
    # (shape, its cycles, the generations that ran it at least once), most cycles first (`blocks.cycle_shapes`); the
    # generations counted; empty and 0 where no engine ran (the plain loop).
    shapes: tuple[tuple[str, int, int], ...] = ()
    generations: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan

    def shape_shares(self) -> str:
        """The shapes chosen, in words: each one's share of the cycles and the generations that ran it."""
        cycles = sum(count for _, count, _ in self.shapes)
        return "; ".join(
            f"{shape} {100 * count / cycles:.1f}% of cycles, {rows} of {self.generations} prompts"
            for shape, count, rows in self.shapes
        )


def shape_counts(generations: Iterable[Sequence[str]]) -> tuple[tuple[str, int, int], ...]:
    """`PolicySpeed.shapes` of generations given by their cycles' shapes."""
    cycles, rows = Counter(), Counter()
    for shapes in generations:
        cycles.update(shapes)
        rows.update(set(shapes))
    return tuple((shape, count, rows[shape]) for shape, count in cycles.most_common())


def measure_speed(
    models: SpeculativeModels,
    prompts_ids: Sequence[Sequence[int]],
    policy: BlockSizePolicy,
    config: GenerationConfig,
    *,
    max_batch: int = 1,
    engine: Engine | None = None,
) -> PolicySpeed:
    """Decode every prompt under `policy` in one engine, `max_batch` rows at a time (1: one after another): on
    `engine` when given (its compiled shapes reused), else a new one run eagerly.

    A policy keeps no per-request state, so one instance drives every row."""
    if not prompts_ids:
        raise ValueError("measure_speed needs at least one prompt; got none")
    requests = [GenerationRequest(list(ids), config, policy) for ids in prompts_ids]
    started = time.perf_counter()
    results = generate_many(models, requests, max_batch=max_batch, engine=engine)
    seconds = time.perf_counter() - started
    return PolicySpeed(
        policy=results[0].policy,
        tokens=sum(len(r.token_ids) for r in results),
        seconds=seconds,
        tau=pooled_tau((sum(r.acceptance_lengths), r.cycles) for r in results),
        shapes=shape_counts(cycle_shapes(r.block_sizes, r.tree_nodes) for r in results),
        generations=len(results),
    )


def pooled_tau(generations: Iterable[tuple[int, int]]) -> float:
    """Mean acceptance length over generations of (tokens their cycles committed, cycles): committed tokens over
    cycles, every cycle counting once (NaN: no cycle). Not the mean of each generation's tau, where a short answer
    of one long block weighs as much as a long autoregressive one (the confidence rule's 24 held-out answers at
    T = 0 on the mini zoo: 2.23 by prompt, 1.35 by cycle)."""
    committed = cycles = 0
    for tokens, count in generations:
        committed, cycles = committed + tokens, cycles + count
    return committed / cycles if cycles else math.nan


PLAIN_LOOP = "transformers loop"


@torch.inference_mode()
def plain_loop(models: SpeculativeModels, prompt_ids: Sequence[int], config: GenerationConfig) -> list[int]:
    """The target alone in transformers' plain greedy loop (its `DynamicCache`, one token a forward pass), to
    `config`'s budget and stop tokens: the baseline every user knows."""
    from transformers import DynamicCache

    cache, device, tokens = {cache_keyword(models.target): DynamicCache()}, models.device, []
    logits = models.target(input_ids=torch.tensor([list(prompt_ids)], device=device), **cache, use_cache=True).logits
    while True:
        tokens.append(int(logits[0, -1].argmax()))
        if tokens[-1] in config.stop_token_ids or len(tokens) == config.max_new_tokens:
            return tokens
        logits = models.target(input_ids=torch.tensor([[tokens[-1]]], device=device), **cache, use_cache=True).logits


def measure_plain_loop(
    models: SpeculativeModels, prompts_ids: Sequence[Sequence[int]], config: GenerationConfig
) -> PolicySpeed:
    """`plain_loop` over every prompt one after another: the speed speculative decoding is measured against."""
    if not prompts_ids:
        raise ValueError("measure_plain_loop needs at least one prompt; got none")
    started = time.perf_counter()
    tokens = sum(len(plain_loop(models, ids, config)) for ids in prompts_ids)
    return PolicySpeed(policy=PLAIN_LOOP, tokens=tokens, seconds=time.perf_counter() - started, tau=1.0)


Decoded = tuple[int, float, int, int, list[str]]  # one decode: tokens, seconds, committed, cycles, cycles' shapes


def measure_speeds(
    models: SpeculativeModels,
    prompts_ids: Sequence[Sequence[int]],
    runs: Mapping[str, tuple[BlockSizePolicy, Engine | None]],
    config: GenerationConfig,
    *,
    rounds: int,
    plain_loop_key: str | None = None,
) -> dict[str, PolicySpeed]:
    """Each run (a policy on its engine, None: a new eager one) and, under `plain_loop_key`, `plain_loop`, decoding
    every prompt one at a time, interleaved prompt by prompt: after one untimed pass of each (compiling what the
    generations meet), every prompt is decoded by every decoder in turn, `rounds` times, in an order shuffled each
    time (seeded), so that no decoder always follows the same one (a decoder after another engine's found its
    caches cold: rotating a fixed order put two policies running the same cycles 12% apart). A decoder's figure
    sums, over the prompts, its median round on that prompt (by seconds a token). The machine's drift then falls on
    every decoder alike, and a burst on one decode counts for nothing: with whole passes per decoder instead, such
    policies came out up to 28% apart on a 2-core CPU (docs/log.md)."""
    if not prompts_ids:
        raise ValueError("measure_speeds needs at least one prompt; got none")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if plain_loop_key is not None and plain_loop_key in runs:
        raise ValueError(f"plain_loop_key {plain_loop_key!r} names a run too; give the plain loop a key of its own")

    names = {plain_loop_key: PLAIN_LOOP}

    def decode(key: str, ids: Sequence[int]) -> Decoded:
        started = time.perf_counter()
        if key == plain_loop_key:
            tokens = len(plain_loop(models, ids, config))
            return tokens, time.perf_counter() - started, tokens - 1, tokens - 1, []  # a token a pass after the first
        policy, engine = runs[key]
        result = generate_many(models, [GenerationRequest(list(ids), config, policy)], engine=engine)[0]
        seconds = time.perf_counter() - started
        names[key] = result.policy
        shapes = cycle_shapes(result.block_sizes, result.tree_nodes)
        return len(result.token_ids), seconds, sum(result.acceptance_lengths), result.cycles, shapes

    keys = [*runs, *([plain_loop_key] if plain_loop_key is not None else [])]
    for key in keys:
        for ids in prompts_ids:
            decode(key, ids)
    decoded: dict[str, list[list[Decoded]]] = {key: [[] for _ in prompts_ids] for key in keys}
    order = random.Random(0)
    for _ in range(rounds):
        for index, ids in enumerate(prompts_ids):
            for key in order.sample(keys, len(keys)):
                decoded[key][index].append(decode(key, ids))
    speeds = {}
    for key in keys:
        medians = [sorted(runs_, key=lambda run: run[1] / max(run[0], 1))[len(runs_) // 2] for runs_ in decoded[key]]
        speeds[key] = PolicySpeed(
            policy=names[key],
            tokens=sum(tokens for tokens, *_ in medians),
            seconds=sum(seconds for _, seconds, *_ in medians),
            tau=pooled_tau((committed, cycles) for _, _, committed, cycles, _ in medians),
            shapes=shape_counts(shapes for *_, shapes in medians) if key != plain_loop_key else (),
            generations=len(medians) if key != plain_loop_key else 0,
        )
    return speeds
