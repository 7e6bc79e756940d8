"""Small rules that many modules apply, each written once. Torch-free, so the command line can use them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def positive_int(value: Any, what: str) -> int:
    """`value` if it is an integer >= 1 (a bool is not), else ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def non_negative_number(value: Any, what: str) -> float:
    """`value` as a float if it is a finite number >= 0 (a bool is not), else ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def distinct_block_sizes(values: Iterable[Any], what: str = "candidates") -> tuple[int, ...]:
    """Distinct integers >= 1, sorted; ValueError naming `what` otherwise (or when empty)."""
    values = tuple(values)
    if not values:
        raise ValueError(f"{what} is empty: expected at least one block size")
    for value in values:
        positive_int(value, f"each of {what}")
    if len(set(values)) != len(values):
        raise ValueError(f"{what} must be distinct, got {list(values)}")
    return tuple(sorted(values))


def distinct_tree_budgets(values: Iterable[Any], what: str = "tree_budgets") -> tuple[int, ...]:
    """Draft-tree budgets in nodes: distinct integers >= 1, sorted, or none at all (no trees); ValueError naming
    `what` otherwise."""
    values = tuple(values)
    return distinct_block_sizes(values, what) if values else ()


class ContextOverflow(ValueError):
    """A prompt that leaves no room for the requested new tokens in the target's context."""


def check_fits_context(prompt_tokens: int, max_new_tokens: int, context: int | None) -> None:
    """The one rule for "prompt + max_new_tokens fits the context" (no limit when `context` is None)."""
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise ContextOverflow(
            f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the target's context of "
            f"{context} positions"
        )


def mean_or_nan(values: Iterable[float]) -> float:
    """The mean, or NaN for no values (a prompt with no draft/verify cycle has no tau)."""
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def differing_fields(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The keys of two flat fingerprints whose values differ (or that only one has), sorted."""
    return sorted(key for key in {*found, *wanted} if found.get(key) != wanted.get(key))
