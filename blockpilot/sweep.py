"""The per-prompt block-size sweep: tau for every candidate b, from acceptance tables or from live runs.

Two modes with one accounting (only tokens that reach the output count, as in `GenerationResult`):

* `replay` (default): one reference generation per prompt (per sample at T > 0) gives the target's output
  sequence and its context features; the acceptance table (`blockpilot.table`) then holds a(i, b) for every
  cursor and candidate, and each candidate's tau is a walk through it. Reference generations of many prompts
  run together in one batched engine. Exact at T = 0; exact in distribution at T > 0 under `match` (see the
  table's docstring). `rejection` draws its own randomness per draft and has no such replay: sweep it live.
* `live`: one full speculative generation per candidate, as the BlockPilot code does.

At T > 0, `samples` generations are pooled per prompt (seeds seed, seed + 1, ...): every cycle of every run
counts, so tau is the pooled mean acceptance length.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from blockpilot.blocks import best_block_size
from blockpilot.checks import distinct_block_sizes, distinct_tree_budgets, mean_or_nan, positive_int
from blockpilot.decoding.acceptance import VERIFY_RULES, VerifyRule
from blockpilot.decoding.engine import generate_many
from blockpilot.decoding.request import GenerationConfig, GenerationRequest, GenerationResult
from blockpilot.models.loading import SpeculativeModels
from blockpilot.policies.base import PrefillState
from blockpilot.policies.fixed import FixedBlockSize
from blockpilot.table import AcceptanceTable, acceptance_table

SweepMode = Literal["replay", "live"]
SWEEP_MODES: tuple[str, ...] = ("replay", "live")


@dataclass(frozen=True)
class SweepConfig:
    candidates: tuple[int, ...]
    temperature: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    mode: SweepMode = "replay"
    verify: VerifyRule = "match"
    samples: int = 1  # at T > 0: generations pooled per prompt (seeds seed, seed + 1, ...); T = 0 runs one
    tree_budgets: tuple[int, ...] = ()  # replay: draft trees walked too, max(candidates) deep (`blockpilot.table`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", distinct_block_sizes(self.candidates))
        object.__setattr__(self, "tree_budgets", distinct_tree_budgets(self.tree_budgets))
        if self.mode not in SWEEP_MODES:
            raise ValueError(f"mode must be one of {SWEEP_MODES}, got {self.mode!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
        if self.mode == "replay" and self.temperature > 0 and self.verify != "match":
            raise ValueError(
                "replay sweeps the 'match' rule only at temperature > 0; sweep 'rejection' with mode='live'"
            )
        positive_int(self.samples, "samples")
        self.generation_config(0)  # validates temperature and max_new_tokens

    @property
    def runs_per_prompt(self) -> int:
        return self.samples if self.temperature > 0 else 1

    def generation_config(self, seed: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            verify=self.verify,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
        )


@dataclass
class PromptSweep:
    """One prompt's sweep. Lists follow `candidates`; tau is NaN where no cycle ran."""

    candidates: list[int]
    tau: list[float]
    acceptance_lengths: list[list[int]]  # every candidate's walk (pooled over samples)
    new_tokens: list[int]
    cycles: list[int]
    token_ids: list[int]  # the (first) output the tau values were measured on
    prefill: PrefillState = field(repr=False)
    tables: list[AcceptanceTable] = field(default_factory=list, repr=False)  # replay: one per sample
    # replay: per cursor of every table (samples concatenated), the target distribution at the anchor (the one
    # that produced the block's first token): entropy (m,) and top-k probabilities (m, k).
    anchor_entropy: np.ndarray | None = field(default=None, repr=False)
    anchor_top_probs: np.ndarray | None = field(default=None, repr=False)
    # replay with tree budgets: every tree budget's tau and cycles, as `tau` and `cycles` are every candidate's.
    tree_tau: list[float] | None = None
    tree_cycles: list[int] | None = None

    @property
    def best_block_size(self) -> int:
        return best_block_size(self.candidates, self.tau)


def reference_block_size(models: SpeculativeModels, candidates: Sequence[int]) -> int:
    """The block size of the reference generations: the drafter's training size B, swept or not.

    The reference is the target's own sequence whatever b drafts it (its greedy output at T = 0, a sample of it
    under `match` at T > 0), so only its speed depends on b, and B is where the drafter drafts best. Running it at
    the largest candidate instead (b = 18 for {1, 2, 4, 8, 14..18} and B = 6) verifies three times the tokens a
    cycle for about the same tau. Without a known B: the largest candidate."""
    train = models.train_block_size
    return train if train is not None else max(candidates)


def sweep_prompts(
    models: SpeculativeModels,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    config: SweepConfig,
    *,
    max_batch: int = 8,
    slot_hits: np.ndarray | None = None,
    stage_seconds: dict[str, float] | None = None,
    engine: Any | None = None,
) -> list[PromptSweep]:
    """tau for every candidate on each prompt (prompt i seeded by seeds[i]); generations batched. `engine`: what
    runs the replay's reference generations (an `Engine` built with `record=True`, its compiled shapes reused), else
    one shaped for them, run eagerly.

    `stage_seconds`, when given, adds the wall seconds of each stage under its name: "reference" (the reference
    generations) and "tables" (building the acceptance tables) in replay, "live" (every candidate's generations)
    in live mode. What bounds the replay sweep's speed is their ratio."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    runs = config.runs_per_prompt
    if config.mode == "live":
        with _timed(stage_seconds, "live"):
            return _live(models, prompts, seeds, config, runs, max_batch)
    if models.drafter is None:
        raise ValueError("a sweep needs a drafter")
    reference = FixedBlockSize(reference_block_size(models, config.candidates))
    requests = [
        GenerationRequest(prompt, config.generation_config(seed + sample), reference, record=True)
        for prompt, seed in zip(prompts, seeds, strict=True)
        for sample in range(runs)
    ]
    with _timed(stage_seconds, "reference"):
        results = generate_many(models, requests, max_batch=max_batch, engine=engine)
    sweeps = []
    for index, prompt in enumerate(prompts):
        mine = results[index * runs : (index + 1) * runs]
        with _timed(stage_seconds, "tables"):
            tables = [
                acceptance_table(
                    models,
                    len(prompt),
                    r.token_ids,
                    r.record.context_features,
                    config.candidates,
                    config.max_new_tokens,
                    slot_hits,
                    config.tree_budgets,
                )
                for r in mine
            ]
        for r in mine:
            r.record.context_features = None  # the table holds what was needed
        walks = [[step for table in tables for step in table.walk(b)] for b in config.candidates]
        tree_walks = [[step for table in tables for step in table.walk_tree(n)] for n in config.tree_budgets]
        sweeps.append(
            PromptSweep(
                candidates=list(config.candidates),
                tau=[mean_or_nan(walk) for walk in walks],
                acceptance_lengths=walks,
                new_tokens=[sum(len(r.token_ids) for r in mine)] * len(config.candidates),
                cycles=[len(walk) for walk in walks],
                token_ids=mine[0].token_ids,
                prefill=mine[0].prefill,
                tables=tables,
                anchor_entropy=torch.cat([r.record.entropy[: len(r.token_ids) - 1] for r in mine]).cpu().numpy(),
                anchor_top_probs=torch.cat([r.record.top_probs[: len(r.token_ids) - 1] for r in mine]).cpu().numpy(),
                tree_tau=[mean_or_nan(walk) for walk in tree_walks] if tree_walks else None,
                tree_cycles=[len(walk) for walk in tree_walks] if tree_walks else None,
            )
        )
    return sweeps


@contextmanager
def _timed(seconds: dict[str, float] | None, stage: str) -> Iterator[None]:
    """Adds the block's wall seconds to `seconds[stage]`; does nothing without `seconds`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started


def _live(models, prompts, seeds, config, runs, max_batch) -> list[PromptSweep]:
    """One full generation per candidate (per sample), batched across prompts."""
    by_candidate: list[list[GenerationResult]] = []
    for b in config.candidates:
        requests = [
            GenerationRequest(prompt, config.generation_config(seed + sample), FixedBlockSize(b))
            for prompt, seed in zip(prompts, seeds, strict=True)
            for sample in range(runs)
        ]
        by_candidate.append(generate_many(models, requests, max_batch=max_batch))
    sweeps = []
    for index in range(len(prompts)):
        mine = [results[index * runs : (index + 1) * runs] for results in by_candidate]
        walks = [[step for r in runs_of_b for step in r.acceptance_lengths] for runs_of_b in mine]
        sweeps.append(
            PromptSweep(
                candidates=list(config.candidates),
                tau=[mean_or_nan(walk) for walk in walks],
                acceptance_lengths=walks,
                new_tokens=[sum(len(r.token_ids) for r in runs_of_b) for runs_of_b in mine],
                cycles=[len(walk) for walk in walks],
                token_ids=mine[-1][0].token_ids,
                prefill=mine[0][0].prefill,
            )
        )
    return sweeps


def sweep_prompt(models: SpeculativeModels, prompt_ids: Sequence[int], config: SweepConfig, seed: int = 0) -> PromptSweep:
    """One prompt's sweep; see `sweep_prompts`."""
    return sweep_prompts(models, [list(prompt_ids)], [seed], config, max_batch=1)[0]

