"""What the per-step model reads before a cycle, declared once: the engine (live), training (every cycle of the
label tables' walks) and table walks (evaluation) all build the model's input with `StepFeatures.build` from a
`CycleView` of the cycles they decide.

Features of the cycle at cursor i (its block's first token is g_{i-1}; nothing extra is computed for them):
- the target's distribution that produced g_{i-1} (at the first cycle, the prefill's): its top-1 probability at
  T = 1 (`top_probability`, which the cycle computes anyway; its entropy and top 4 walked no better, and cost the
  compiled cycle more, docs/log.md); the sampling temperature; log(1 + i);
- the last cycle: log(1 + a) and a / b of its acceptance length a and block size b (both 0 before the first cycle);
- the block's first token g_{i-1} and the one before it (`NO_TOKEN` at cursor 1), each read through a learned
  embedding: where the generation is (a separator, the middle of a number, a copied span) says how far the drafter
  will be right, and the anchor's distribution does not;
- with a per-request prior: log(b0), b0 the per-request predictor's choice for the request (which also drafts the
  first cycle), and its probability of every candidate;
- for a load-aware model: log of the rows in the cycle's batch, which picks the model's head for that load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

TOKEN_FEATURES = ("anchor_token", "previous_token")
NO_TOKEN = -1  # the token before the first block's first one: there is none in the generation


@dataclass(frozen=True)
class CycleView:
    """What is known of N cycles before each is drafted. Arrays have N rows; a scalar holds for every cycle."""

    confidence: np.ndarray  # (N,) the target's top-1 probability at the anchor (T = 1)
    temperature: np.ndarray | float
    cursor: np.ndarray  # (N,) i: the tokens generated before the block
    tokens: np.ndarray | None  # (N, 2) `anchor_tokens`: the block's first token and the one before it
    last_accepted: np.ndarray | int = 0  # the last cycle's acceptance length; 0 before the first cycle
    last_block_size: np.ndarray | int = 0  # the last cycle's b; 0 before the first cycle
    prior_block_size: np.ndarray | int | None = None  # b0, the per-request predictor's choice
    prior_probabilities: np.ndarray | None = None  # (K,) or (N, K) its probability of every candidate
    batch_rows: np.ndarray | int = 1  # the rows in each cycle's batch


def anchor_tokens(generated: Sequence[int] | np.ndarray, cursors: Sequence[int] | np.ndarray) -> np.ndarray:
    """(N, 2) token features of the cycles at `cursors` (N,): the block's first token g_{i-1} and the one before it
    g_{i-2} (`NO_TOKEN` at cursor 1), from the generated sequence g_0.. (at least up to g_{i-1})."""
    generated, cursors = np.asarray(generated, dtype=np.int64), np.asarray(cursors, dtype=np.int64)
    before = np.where(cursors >= 2, generated[np.maximum(cursors - 2, 0)], NO_TOKEN)
    return np.stack([generated[cursors - 1], before], axis=1)


def tail_tokens(tails: Sequence[Sequence[int]]) -> np.ndarray:
    """(N, 2) `anchor_tokens` of N live rows from the tails of their generations (each ending at the block's first
    token): a tail of one token is the generation's first (cursor 1), with no token before it."""
    if not all(tails):
        raise ValueError("every row's generation tail needs its block's first token")
    pairs = [(tail[-1], NO_TOKEN if len(tail) == 1 else tail[-2]) for tail in tails]
    return np.asarray(pairs, dtype=np.int64)


def _needs(value: object, what: str) -> object:
    if value is None:
        raise ValueError(f"this step model reads {what}: give it with the cycles")
    return value


class _Numpy:
    """The array operations a column is computed with, on the host (`StepFeatures.build`)."""

    log, log1p, where, maximum = np.log, np.log1p, np.where, np.maximum

    @staticmethod
    def floats(value: object) -> np.ndarray:
        return np.asarray(value, dtype=np.float32)


class _Torch:
    """The same operations on tensors, on the device and inside a compiled cycle (`StepFeatures.cycle_parts`)."""

    log, log1p, where = torch.log, torch.log1p, torch.where

    @staticmethod
    def maximum(value: torch.Tensor, floor: float) -> torch.Tensor:
        return value.clamp(min=floor)

    @staticmethod
    def floats(value: object) -> torch.Tensor:
        return torch.as_tensor(value).float()


def _accepted_share(view: CycleView, xp: type = _Numpy) -> object:
    accepted, size = xp.floats(view.last_accepted), xp.floats(view.last_block_size)
    return xp.where(size > 0, accepted / xp.maximum(size, 1.0), 0.0 * size)


Column = Callable[[CycleView, type], object]


@dataclass(frozen=True)
class Group:
    """Columns computed together from a `CycleView`; `per_request`: fixed for every cycle of a lone row's request (its
    temperature, its prior's choice, its load of one), which the decision inside the cycle folds into one bias."""

    names: tuple[str, ...]
    column: Column
    per_request: bool = False


@dataclass(frozen=True)
class StepFeatures:
    """The step model's input columns, in order, and how each is computed from a `CycleView`: the same formulas on
    numpy arrays (`build`: training, table walks, the host's hook) and on tensors (`cycle_parts`: the decision
    inside the compiled cycle)."""

    candidates: tuple[int, ...]
    prior: bool = False  # reads the per-request predictor's b0 and probabilities
    load: bool = False  # reads the rows in the cycle's batch (a load-aware model)

    @cached_property
    def groups(self) -> tuple[Group, ...]:
        groups = [
            Group(("anchor_top1",), lambda v, xp: v.confidence),
            Group(("temperature",), lambda v, xp: v.temperature, per_request=True),
            Group(("log_cursor",), lambda v, xp: xp.log1p(xp.floats(v.cursor))),
            Group(("log1p_last_accepted",), lambda v, xp: xp.log1p(xp.floats(v.last_accepted))),
            Group(("last_accepted_share",), _accepted_share),
            Group(TOKEN_FEATURES, lambda v, xp: _needs(v.tokens, "the block's first tokens")),
        ]
        if self.prior:
            prior = "the per-request predictor's choice"
            groups.append(
                Group(
                    ("log_prior_b",),
                    lambda v, xp: xp.log(xp.floats(_needs(v.prior_block_size, prior))),
                    per_request=True,
                )
            )
            groups.append(
                Group(
                    tuple(f"prior_p_b{b}" for b in self.candidates),
                    lambda v, xp: _needs(v.prior_probabilities, prior),
                    per_request=True,
                )
            )
        if self.load:
            groups.append(Group(("log_batch_rows",), lambda v, xp: xp.log(xp.floats(v.batch_rows)), per_request=True))
        return tuple(groups)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(name for group in self.groups for name in group.names)

    @cached_property
    def cycle_groups(self) -> tuple[Group, ...]:
        """The groups whose columns change from one cycle of a lone row to the next, in order: `cycle_parts`'s."""
        return tuple(group for group in self.groups if not group.per_request)

    @cached_property
    def cycle_names(self) -> tuple[str, ...]:
        return tuple(name for group in self.cycle_groups for name in group.names)

    @cached_property
    def token_columns(self) -> list[int]:
        """The columns holding token ids: looked up in an embedding, never standardized."""
        return [self.names.index(name) for name in TOKEN_FEATURES]

    @cached_property
    def load_column(self) -> int | None:
        """The column of log(batch rows), which picks a load-aware model's head; None without one."""
        return self.names.index("log_batch_rows") if self.load else None

    def build(self, view: CycleView) -> np.ndarray:
        """(N, len(names)) float32: every column of every cycle of `view`."""
        n = len(np.asarray(view.confidence))
        out = np.empty((n, len(self.names)), dtype=np.float32)
        start = 0
        for group in self.groups:
            width = len(group.names)
            value = np.asarray(group.column(view, _Numpy), dtype=np.float32)
            if width == 1 and value.ndim == 1:
                value = value[:, None]  # (N,) -> (N, 1); a scalar or a (K,) row broadcasts as it is
            out[:, start : start + width] = value
            start += width
        return out

    def cycle_parts(self, view: CycleView) -> list[torch.Tensor]:
        """`build`'s columns of each of `cycle_groups` on the device, (N, its width) float32 each, from a `CycleView`
        of tensors (each (N,) or (N, k); a Python number holds for every cycle), its per-request fields unread. Traces
        into a compiled cycle: no host copy, and no feature vector, which a consumer multiplies part by part."""
        n = view.confidence.shape[0]
        parts = []
        for group in self.cycle_groups:
            width = len(group.names)
            value = _Torch.floats(group.column(view, _Torch)).to(view.confidence.device)
            parts.append(value.reshape(n, width) if value.dim() else value.expand(n, width))
        return parts
