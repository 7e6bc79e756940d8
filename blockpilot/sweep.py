"""The per-prompt block-size sweep: mean acceptance length tau for every candidate b, and B*.

Two modes with one accounting (only tokens that reach the output count, as in `GenerationResult`):

* `live`: one full speculative generation per candidate, as the BlockPilot code does.
* `replay`: one live generation, with a reference candidate, gives the target's output sequence and the
  target's context features of every position. Each candidate's draft/verify walk is then replayed over
  that sequence with the drafter alone: at each step a candidate drafts a block from its cursor, the
  drafts are compared with the sequence, and the cursor moves by the accepted prefix + 1. The drafter's
  context keys/values depend only on the features, so they are computed once per sequence and shared;
  the walks of all candidates advance together as one batched drafter call per step. The reference
  candidate's walk is its live run's. Candidates of b <= 2 draft one token per step, so their walks
  would set the number of steps; they are drafted at every position of the sequence in one call instead.

At T = 0 the sequence is the target's greedy output whatever b is, so replay and live give the same tau
vector. At T > 0 under `match` (greedy drafts kept while they equal the target's samples) a live run's
acceptances are a function of its sampled sequence, and the sequence is a sample of the target whatever
b is; replaying every candidate over one shared sample keeps each candidate's tau exact in distribution
and couples the candidates, which lowers the variance of their differences. `rejection` draws its own
randomness per draft and has no such replay: sweep it live.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from blockpilot.decoding.acceptance import VERIFY_RULES, VerifyRule
from blockpilot.decoding.policies import FixedBlockSize, PrefillState
from blockpilot.decoding.speculative import GenerationConfig, GenerationResult, generate
from blockpilot.models.loading import SpeculativeModels

# Up to this block size a candidate is drafted at every anchor in one call rather than walked step by step.
EVERY_ANCHOR_MAX_BLOCK = 2

SweepMode = Literal["replay", "live"]
SWEEP_MODES: tuple[str, ...] = ("replay", "live")


def default_candidates(train_block_size: int, spread: int = 2) -> tuple[int, ...]:
    """B - spread .. B + spread around the drafter's training block size (b >= 1)."""
    return tuple(b for b in range(train_block_size - spread, train_block_size + spread + 1) if b >= 1)


@dataclass(frozen=True)
class SweepConfig:
    candidates: tuple[int, ...]
    temperature: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    mode: SweepMode = "replay"
    verify: VerifyRule = "match"
    samples: int = 1  # at T > 0: generations pooled per candidate (seeds seed, seed + 1, ...); T = 0 runs one

    def __post_init__(self) -> None:
        candidates = tuple(self.candidates)
        if not candidates:
            raise ValueError("candidates is empty: expected at least one block size")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in candidates):
            raise ValueError(f"candidates must be integers >= 1, got {list(candidates)}")
        if len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must be distinct, got {list(candidates)}")
        object.__setattr__(self, "candidates", tuple(sorted(candidates)))
        if self.mode not in SWEEP_MODES:
            raise ValueError(f"mode must be one of {SWEEP_MODES}, got {self.mode!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
        if self.mode == "replay" and self.temperature > 0 and self.verify != "match":
            raise ValueError(
                "replay sweeps the 'match' rule only at temperature > 0; sweep 'rejection' with mode='live'"
            )
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"samples must be an integer >= 1, got {self.samples!r}")
        self.generation_config()  # validates temperature, max_new_tokens

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            verify=self.verify,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
        )


def best_block_size(candidates: Sequence[int], tau: Sequence[float]) -> int:
    """argmax of tau over the candidates, ties to the smaller b (NaN never wins)."""
    scored = [(t if not math.isnan(t) else -math.inf, -b, b) for b, t in zip(candidates, tau, strict=True)]
    return max(scored)[2]


@dataclass
class PromptSweep:
    """One prompt's sweep. Lists follow `candidates`; tau is NaN where no cycle ran."""

    candidates: list[int]
    tau: list[float]
    acceptance_lengths: list[list[int]]
    new_tokens: list[int]
    cycles: list[int]
    token_ids: list[int]  # the output the tau values were measured on (replay: the shared sequence)
    prefill: PrefillState = field(repr=False)

    @property
    def best_block_size(self) -> int:
        return best_block_size(self.candidates, self.tau)


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) if values else math.nan


def live_sweep(models: SpeculativeModels, prompt_ids: Sequence[int], config: SweepConfig) -> PromptSweep:
    """One full speculative generation per candidate."""
    results: list[GenerationResult] = [
        generate(models, prompt_ids, policy=FixedBlockSize(b), config=config.generation_config())
        for b in config.candidates
    ]
    return PromptSweep(
        candidates=list(config.candidates),
        tau=[r.tau for r in results],
        acceptance_lengths=[r.acceptance_lengths for r in results],
        new_tokens=[len(r.token_ids) for r in results],
        cycles=[r.cycles for r in results],
        token_ids=results[-1].token_ids,
        prefill=results[0].prefill,
    )


def reference_block_size(models: SpeculativeModels, candidates: Sequence[int]) -> int:
    """The candidate whose live run produces the shared sequence: the training size B when swept, else the
    largest (the fewest target passes)."""
    train = models.train_block_size
    return train if train in candidates else max(candidates)


def replay_sweep(models: SpeculativeModels, prompt_ids: Sequence[int], config: SweepConfig) -> PromptSweep:
    """One live generation, then every candidate's walk replayed over its sequence with the drafter alone."""
    if models.drafter is None:
        raise ValueError("a sweep needs a drafter")
    reference_b = reference_block_size(models, config.candidates)
    reference = generate(
        models,
        prompt_ids,
        policy=FixedBlockSize(reference_b),
        config=config.generation_config(),
        collect_features=True,
    )
    # The reference run is that candidate's live run over the same sequence: its walk is already known.
    others = [b for b in config.candidates if b != reference_b]
    walks = dict(
        zip(
            others,
            replay_walks(
                models, len(prompt_ids), reference.token_ids, reference.context_features, others, config.max_new_tokens
            ),
            strict=True,
        )
    )
    walks[reference_b] = list(reference.acceptance_lengths)
    lengths = [walks[b] for b in config.candidates]
    return PromptSweep(
        candidates=list(config.candidates),
        tau=[_mean(walk) for walk in lengths],
        acceptance_lengths=lengths,
        new_tokens=[len(reference.token_ids)] * len(config.candidates),
        cycles=[len(walk) for walk in lengths],
        token_ids=reference.token_ids,
        prefill=reference.prefill,
    )


@torch.inference_mode()
def replay_walks(
    models: SpeculativeModels,
    prompt_length: int,
    tokens: Sequence[int],  # the generated sequence g_0..g_{n-1} (g_0 from the prefill)
    features: torch.Tensor,  # (1, C >= prompt_length + n - 1, F) target context features
    candidates: Sequence[int],
    max_new_tokens: int,
) -> list[list[int]]:
    """Acceptance lengths of every candidate's walk over `tokens`, as live runs would count them.

    A walk's cursor c counts committed tokens; its block sits at position prompt_length + c - 1 with
    g_{c-1} first, sees the context strictly before that position, and its drafts are compared with
    g_c, g_{c+1}, ... . It commits min(accepted + 1, n - c) tokens: a live run stops at the end of the
    sequence (a stop token, or max_new_tokens, which also caps each block at max_new_tokens - c).
    """
    drafter, target = models.drafter, models.target
    device = models.device
    n = len(tokens)
    sequence = torch.tensor(list(tokens), device=device)
    context_length = prompt_length + n - 1
    if features.shape[1] < context_length:
        raise ValueError(f"features cover {features.shape[1]} positions; the walk needs {context_length}")
    features = features[:, :context_length].to(device)
    context_kv = drafter.encode_context(features, torch.arange(context_length, device=device)[None])
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    cursors = [1] * len(candidates)
    lengths: list[list[int]] = [[] for _ in candidates]
    for walk, b in enumerate(candidates):
        if b <= EVERY_ANCHOR_MAX_BLOCK:
            lengths[walk] = _walk_every_anchor(
                models, embed, head, context_kv, sequence, prompt_length, b, max_new_tokens
            )
            cursors[walk] = n
    while True:
        drafting = []  # (walk index, block size)
        for walk, b in enumerate(candidates):
            if cursors[walk] >= n:
                continue
            size = min(b, max_new_tokens - cursors[walk])
            if size == 1:  # nothing to draft: the target's own token only
                lengths[walk].append(1)
                cursors[walk] += 1
            else:
                drafting.append((walk, size))
        if not drafting:
            if all(c >= n for c in cursors):
                return lengths
            continue
        drafts = _batched_drafts(models, embed, head, context_kv, sequence, prompt_length, cursors, drafting)
        for row, (walk, size) in enumerate(drafting):
            committed = _committed(drafts[row, : size - 1], sequence, cursors[walk])
            lengths[walk].append(committed)
            cursors[walk] += committed


def _walk_every_anchor(models, embed, head, context_kv, sequence, prompt_length, b, max_new_tokens) -> list[int]:
    """A walk of block size b from drafts made at every anchor 1..n-1 in one drafter call."""
    n = sequence.shape[0]
    anchors = list(range(1, n))
    sizes = [min(b, max_new_tokens - c) for c in anchors]
    drafting = [(i, size) for i, size in enumerate(sizes) if size > 1]
    drafts = (
        _batched_drafts(models, embed, head, context_kv, sequence, prompt_length, anchors, drafting)
        if drafting
        else None
    )
    row_of = {i: row for row, (i, _) in enumerate(drafting)}
    lengths, c = [], 1
    while c < n:
        size = sizes[c - 1]
        committed = _committed(drafts[row_of[c - 1], : size - 1], sequence, c) if size > 1 else 1
        lengths.append(committed)
        c += committed
    return lengths


def _committed(drafts: torch.Tensor, sequence: torch.Tensor, cursor: int) -> int:
    """Tokens a block at `cursor` with `drafts` (b - 1,) commits: the drafts' prefix that matches the
    sequence, + the target's own token, at most up to the end of the sequence."""
    wanted = sequence[cursor : cursor + drafts.shape[0]]
    matches = drafts[: wanted.shape[0]] == wanted
    accepted = int(matches.to(torch.int64).cumprod(0).sum())
    return min(accepted + 1, sequence.shape[0] - cursor)


def _batched_drafts(models, embed, head, context_kv, sequence, prompt_length, cursors, drafting) -> torch.Tensor:
    """Greedy drafts (N, S - 1) of the drafting walks' blocks, in one drafter call."""
    device = sequence.device
    width = max(size for _, size in drafting)
    context_length = context_kv[0][0].shape[2]
    starts = torch.tensor([cursors[walk] - 1 for walk, _ in drafting], device=device)
    sizes = torch.tensor([size for _, size in drafting], device=device)
    block_ids = torch.full((len(drafting), width), models.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = sequence[starts]
    anchors = prompt_length + starts
    positions = anchors[:, None] + torch.arange(width, device=device)
    # Context strictly before each anchor; the block's own slots, but not the padding of shorter blocks.
    sees_context = torch.arange(context_length, device=device)[None, :] < anchors[:, None]
    sees_block = torch.arange(width, device=device)[None, :] < sizes[:, None]
    mask = torch.cat([sees_context, sees_block], dim=1)[:, None, None, :].expand(-1, 1, width, -1)
    hidden = models.drafter(embed(block_ids), positions, context_kv, attention_mask=mask)
    return head(hidden[:, 1:]).argmax(dim=-1)


def sweep_prompt(models: SpeculativeModels, prompt_ids: Sequence[int], config: SweepConfig) -> PromptSweep:
    """tau for every candidate on one prompt, in the configured mode; at T > 0, pooled over `samples` runs."""
    sweep = live_sweep if config.mode == "live" else replay_sweep
    samples = config.samples if config.temperature > 0 else 1
    return pool([sweep(models, prompt_ids, replace(config, seed=config.seed + i)) for i in range(samples)])


def pool(sweeps: Sequence[PromptSweep]) -> PromptSweep:
    """Several sweeps of one prompt as one: every cycle of every run counts, so tau is the pooled mean
    acceptance length; the first run's output and prefill stand for the prompt."""
    if len(sweeps) == 1:
        return sweeps[0]
    first = sweeps[0]
    lengths = [[t for s in sweeps for t in s.acceptance_lengths[i]] for i in range(len(first.candidates))]
    return PromptSweep(
        candidates=first.candidates,
        tau=[_mean(walk) for walk in lengths],
        acceptance_lengths=lengths,
        new_tokens=[sum(s.new_tokens[i] for s in sweeps) for i in range(len(first.candidates))],
        cycles=[len(walk) for walk in lengths],
        token_ids=first.token_ids,
        prefill=first.prefill,
    )
