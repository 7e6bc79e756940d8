"""Measured decode speed of a policy over a set of prompts: the one measurement that the decoding benchmark,
the demo's policy table and the predictors notebook print."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from blockpilot.decoding.engine import generate_many
from blockpilot.decoding.request import GenerationConfig, GenerationRequest
from blockpilot.decoding.width import CyclePrice
from blockpilot.models.loading import SpeculativeModels
from blockpilot.policies.base import BlockSizePolicy


@dataclass(frozen=True)
class PolicySpeed:
    """Generated tokens per second of wall time over all prompts, and the mean tau of the generations that ran
    at least one draft/verify cycle."""

    policy: str  # the resolved policy's name, as every surface reports it
    tokens: int
    seconds: float
    tau: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


def measure_speed(
    models: SpeculativeModels,
    prompts_ids: Sequence[Sequence[int]],
    policy: BlockSizePolicy,
    config: GenerationConfig,
    *,
    max_batch: int = 1,
    cost: CyclePrice | None = None,
) -> PolicySpeed:
    """Decode every prompt under `policy` in one engine, `max_batch` rows at a time (1: one after another),
    verify widths priced with `cost` when given.

    A policy keeps no per-request state, so one instance drives every row."""
    if not prompts_ids:
        raise ValueError("measure_speed needs at least one prompt; got none")
    requests = [GenerationRequest(list(ids), config, policy) for ids in prompts_ids]
    started = time.perf_counter()
    results = generate_many(models, requests, max_batch=max_batch, cost=cost)
    seconds = time.perf_counter() - started
    taus = [r.tau for r in results if r.cycles]
    return PolicySpeed(
        policy=results[0].policy,
        tokens=sum(len(r.token_ids) for r in results),
        seconds=seconds,
        tau=statistics.fmean(taus) if taus else math.nan,
    )
