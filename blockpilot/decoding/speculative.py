"""Generation: autoregressive, fixed-b speculative, and policy-chosen-b speculative, in one loop.

prefill (target, hidden states on) -> first token -> policy picks b -> repeat: draft a block with the
drafter -> verify it with the target -> commit the accepted prefix and the bonus token -> crop the
target's cache -> hand the committed tokens' hidden states to the drafter. Without a drafter (or with
b = 1) a cycle verifies just the last token, which is plain autoregressive decoding.

Terms (block, draft/accepted/bonus tokens, acceptance length) are defined in `acceptance.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from blockpilot.decoding.acceptance import (
    VERIFY_RULES,
    VerifyRule,
    accept_greedy,
    accept_match,
    accept_rejection,
    sample_next,
    sample_tokens,
    temperature_probs,
)
from blockpilot.decoding.policies import BlockSizePolicy, CycleState, FixedBlockSize, PrefillState
from blockpilot.models.drafter import DrafterCache
from blockpilot.models.loading import SpeculativeModels


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    verify: VerifyRule = "match"
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class GenerationResult:
    """Tokens and statistics of one generation.

    End-of-generation accounting: tokens past the first stop token or past `max_new_tokens` never reach
    `token_ids`, and `acceptance_lengths` count only tokens that do. So, always,
    `sum(acceptance_lengths) == len(token_ids) - 1` (the first token comes from the prefill, not from a
    cycle) and `1 <= acceptance_lengths[i] <= block_sizes[i]`. A stop token, when hit, is the last entry
    of `token_ids`.
    """

    token_ids: list[int]
    prompt_length: int
    block_size: int  # chosen after prefill; 1 without a drafter
    block_sizes: list[int]  # per cycle (the last may be cut to fit max_new_tokens)
    acceptance_lengths: list[int]  # per cycle, tokens committed (accepted drafts + bonus)
    stop_reason: Literal["stop", "length", "cancelled"]
    prefill_time_s: float
    decode_time_s: float
    target_forward_passes: int
    drafter_forward_passes: int
    prefill: PrefillState | None = field(default=None, repr=False)
    # (1, P + n - 1, F): the target's context features of every position it processed, when asked for.
    context_features: torch.Tensor | None = field(default=None, repr=False)

    @property
    def cycles(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length; NaN when no cycle ran (the prefill's token was the last)."""
        return sum(self.acceptance_lengths) / self.cycles if self.cycles else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.token_ids) - 1) / self.decode_time_s if self.decode_time_s > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, `tau` and `cycles`; NaN becomes None."""
        out = asdict(self)
        out.pop("prefill")
        out.pop("context_features")
        out["cycles"] = self.cycles
        out["tau"] = None if math.isnan(self.tau) else self.tau
        return out


@dataclass
class DecodeState:
    """Everything a cycle reads and updates."""

    target_cache: Any  # transformers DynamicCache holding positions [0, length)
    drafter_cache: DrafterCache | None
    pending_features: list[torch.Tensor]  # (1, n, F) each: committed, not yet in the drafter cache
    length: int  # tokens in the target cache == position of `last_token`
    last_token: int
    feature_log: list[torch.Tensor] | None = None  # every committed position's features, when collected


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (negative crop works on 4.x and 5.x)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenated outputs of the target layers `layer_ids` ((1, S, H) each; entry 0 is the embeddings)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self) -> float:
        now = self._now()
        elapsed, self.last = now - self.last, now
        return elapsed


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def prefill(
    models: SpeculativeModels,
    input_ids: torch.Tensor,  # (1, P)
) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Run the prompt through the target: (last position's logits (V,), context features (1, P, F) or None, cache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=models.target.config)
    want_features = models.drafter is not None
    out = models.target(
        input_ids=input_ids,
        position_ids=torch.arange(input_ids.shape[1], device=input_ids.device)[None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=want_features,
    )
    features = context_features(out.hidden_states, models.drafter.target_layer_ids) if want_features else None
    return out.logits[0, -1].float(), features, cache


def draft(
    models: SpeculativeModels, state: DecodeState, size: int, config: GenerationConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft the size - 1 tokens after `last_token`: (draft tokens (k,), drafter probs (k, V) or None)."""
    device = models.device
    if size == 1:
        return torch.empty(0, dtype=torch.long, device=device), None
    drafter, cache = models.drafter, state.drafter_cache
    if state.pending_features:
        new_context = torch.cat(state.pending_features, dim=1)
        positions = torch.arange(cache.length, state.length, device=device)[None]
        cache.extend(drafter.encode_context(new_context, positions), new_context.shape[1])
        state.pending_features.clear()
    block_ids = torch.full((1, size), models.mask_token_id, dtype=torch.long, device=device)
    block_ids[0, 0] = state.last_token
    embeds = models.target.get_input_embeddings()(block_ids)
    positions = torch.arange(state.length, state.length + size, device=device)[None]
    hidden = drafter(embeds, positions, cache.layers)
    logits = models.target.get_output_embeddings()(hidden[:, 1:])[0]  # (k, V)
    if config.temperature > 0 and config.verify == "rejection":
        probs = temperature_probs(logits, config.temperature)
        return sample_tokens(probs, generator), probs
    return logits.argmax(dim=-1), None


def verify(
    models: SpeculativeModels,
    state: DecodeState,
    block_ids: torch.Tensor,  # (1, size)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target over the block: (logits (size, V), context features (1, size, F) or None)."""
    want_features = models.drafter is not None
    size = block_ids.shape[1]
    out = models.target(
        input_ids=block_ids,
        position_ids=torch.arange(state.length, state.length + size, device=block_ids.device)[None],
        past_key_values=state.target_cache,
        use_cache=True,
        output_hidden_states=want_features,
    )
    features = context_features(out.hidden_states, models.drafter.target_layer_ids) if want_features else None
    return out.logits[0], features


def accept(
    draft_tokens: torch.Tensor,  # (k,)
    draft_probs: torch.Tensor | None,  # (k, V), only for `rejection` at T > 0
    target_logits: torch.Tensor,  # (k + 1, V)
    config: GenerationConfig,
    generator: torch.Generator,
) -> tuple[int, int]:
    """(number of accepted drafts, bonus token) under the configured rule."""
    if config.temperature == 0:
        return accept_greedy(draft_tokens, target_logits)
    target_probs = temperature_probs(target_logits, config.temperature)
    if draft_probs is not None:
        return accept_rejection(draft_tokens, draft_probs, target_probs, generator)
    return accept_match(draft_tokens, target_probs, generator)


def truncate_at_stop(tokens: list[int], stop_token_ids: Sequence[int]) -> list[int]:
    """Tokens up to and including the first stop token."""
    for index, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: index + 1]
    return tokens


def commit(state: DecodeState, new_tokens: list[int], features: torch.Tensor | None) -> None:
    """Keep the verified block positions that precede the new tokens; the last new token is next cycle's start."""
    committed = len(new_tokens)
    crop_cache(state.target_cache, state.length + committed)
    if features is not None:
        state.pending_features.append(features[:, :committed])
        if state.feature_log is not None:
            state.feature_log.append(features[:, :committed])
    state.length += committed
    state.last_token = new_tokens[-1]


def speculative_cycle(
    models: SpeculativeModels, state: DecodeState, size: int, config: GenerationConfig, generator: torch.Generator
) -> list[int]:
    """One draft/verify cycle with block size `size`: the tokens it commits (1..size of them)."""
    draft_tokens, draft_probs = draft(models, state, size, config, generator)
    block_ids = torch.cat([torch.tensor([state.last_token], device=draft_tokens.device), draft_tokens])[None]
    target_logits, features = verify(models, state, block_ids)
    accepted, bonus = accept(draft_tokens, draft_probs, target_logits, config, generator)
    new_tokens = truncate_at_stop([*draft_tokens[:accepted].tolist(), bonus], config.stop_token_ids)
    commit(state, new_tokens, features)
    return new_tokens


def _prompt_tensor(
    models: SpeculativeModels, prompt_ids: Sequence[int] | torch.Tensor, config: GenerationConfig
) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ValueError("prompt is empty: expected at least one token id")
    vocab = models.target.get_input_embeddings().weight.shape[0]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got min {int(ids.min())}, max {int(ids.max())}")
    context = getattr(models.target.config, "max_position_embeddings", None)
    if context is not None and ids.numel() + config.max_new_tokens > context:
        raise ValueError(
            f"prompt of {ids.numel()} tokens + max_new_tokens={config.max_new_tokens} exceeds the target's "
            f"context of {context} positions"
        )
    return ids.to(models.device)[None]


class Generation:
    """One generation, stepped: iterating yields the tokens each step commits (the prefill's token, then each
    cycle's), which is what streaming needs; `result` is set when the iteration ends.

    Without a drafter this is autoregressive decoding. With one, `policy` picks b after prefill (default:
    the drafter's training block size) and may revise it after every cycle. `collect_features` keeps the
    target's context features of every processed position (what a replay sweep reuses). `cancel()`, from
    any thread, ends the generation after the current cycle (stop_reason "cancelled").
    """

    def __init__(
        self,
        models: SpeculativeModels,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        policy: BlockSizePolicy | None = None,
        config: GenerationConfig | None = None,
        collect_features: bool = False,
    ) -> None:
        self.models = models
        self.config = config or GenerationConfig()
        self.input_ids = _prompt_tensor(models, prompt_ids, self.config)
        if models.drafter is None:
            self.policy: BlockSizePolicy = FixedBlockSize(1)
        else:
            self.policy = policy or FixedBlockSize(models.drafter.block_size)
        self.collect_features = collect_features
        self.result: GenerationResult | None = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    @torch.inference_mode()
    def __iter__(self) -> Iterator[list[int]]:
        models, config, policy = self.models, self.config, self.policy
        drafter, input_ids = models.drafter, self.input_ids
        generator = make_generator(models.device, config.seed)
        timer = _Timer(models.device)

        logits, features, target_cache = prefill(models, input_ids)
        first_token = int(sample_next(logits, config.temperature, generator).item())
        prefill_state = PrefillState(logits, input_ids[0], config.temperature, drafter.block_size if drafter else None)
        block_size = chosen_block_size = _checked(policy.initial_block_size(prefill_state), policy)
        prefill_time = timer.lap()
        yield [first_token]

        state = DecodeState(
            target_cache=target_cache,
            drafter_cache=DrafterCache() if drafter is not None else None,
            pending_features=[features] if features is not None else [],
            length=input_ids.shape[1],
            last_token=first_token,
            feature_log=[features] if self.collect_features and features is not None else None,
        )
        tokens, block_sizes, acceptance_lengths = [first_token], [], []
        stop_reason = "stop" if first_token in config.stop_token_ids else "length"
        while stop_reason != "stop" and len(tokens) < config.max_new_tokens:
            if self._cancelled:
                stop_reason = "cancelled"
                break
            size = min(block_size, config.max_new_tokens - len(tokens))
            new_tokens = speculative_cycle(models, state, size, config, generator)
            tokens.extend(new_tokens)
            block_sizes.append(size)
            acceptance_lengths.append(len(new_tokens))
            if new_tokens[-1] in config.stop_token_ids:
                stop_reason = "stop"
            if drafter is not None:
                cycle = CycleState(len(block_sizes) - 1, block_size, len(new_tokens), len(tokens))
                block_size = _checked(policy.next_block_size(cycle), policy)
            yield new_tokens

        self.result = GenerationResult(
            token_ids=tokens,
            prompt_length=input_ids.shape[1],
            block_size=chosen_block_size,
            block_sizes=block_sizes,
            acceptance_lengths=acceptance_lengths,
            stop_reason=stop_reason,
            prefill_time_s=prefill_time,
            decode_time_s=timer.lap(),
            target_forward_passes=1 + len(block_sizes),
            drafter_forward_passes=sum(size > 1 for size in block_sizes),
            prefill=prefill_state,
            context_features=torch.cat(state.feature_log, dim=1) if state.feature_log else None,
        )


def generate(
    models: SpeculativeModels,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    policy: BlockSizePolicy | None = None,
    config: GenerationConfig | None = None,
    collect_features: bool = False,
) -> GenerationResult:
    """Generate after `prompt_ids` (batch size 1), to the end; see `Generation`."""
    generation = Generation(models, prompt_ids, policy=policy, config=config, collect_features=collect_features)
    for _ in generation:
        pass
    assert generation.result is not None
    return generation.result


def _checked(block_size: int, policy: BlockSizePolicy) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"policy {policy.name!r} returned block size {block_size!r}; expected an integer >= 1")
    return block_size
