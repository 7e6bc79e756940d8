"""Rules about candidate block sizes, each written once: the candidates around B, and B* (the best candidate)."""

from __future__ import annotations

import math
from collections.abc import Sequence

# BlockPilot's sweep: b in B-2 .. B+2 around the drafter's training block size B.
DEFAULT_SPREAD = 2
# b = 1 is autoregression: no drafter pass, the target's one token a cycle (tau 1, the cheapest cycle). A shape like
# any other: labeled, walked, priced and chosen beside the chains and trees.
AUTOREGRESSIVE = 1
# Positions an autoregressive row that may draft again keeps unencoded before they are written in one pass (a flush).
PENDING_CONTEXT = 16


def candidates_around(train_block_size: int, spread: int = DEFAULT_SPREAD) -> tuple[int, ...]:
    """B - spread .. B + spread around the drafter's training block size B (b >= 1)."""
    return tuple(b for b in range(train_block_size - spread, train_block_size + spread + 1) if b >= 1)


# How `label_candidates` chooses, as a label folder's fingerprint records it: labels of an earlier default differ.
LABEL_CANDIDATES_RULE = "default: 1 and B-2..B+2"


def label_candidates(train_block_size: int, spread: int = DEFAULT_SPREAD) -> tuple[int, ...]:
    """What labels sweep by default: autoregression and BlockPilot's window around B (`candidates_around`)."""
    return tuple(sorted({AUTOREGRESSIVE, *candidates_around(train_block_size, spread)}))


def best_block_size(candidates: Sequence[int], scores: Sequence[float]) -> int:
    """argmax of `scores` over the candidates, ties to the smaller b (NaN never wins)."""
    scored = [(s if not math.isnan(s) else -math.inf, -b, b) for b, s in zip(candidates, scores, strict=True)]
    return max(scored)[2]


def flushes(drafts: bool, pending: int) -> bool:
    """Whether a cycle first writes the drafter's context its rows kept (`pending` positions, the most of any row):
    before it drafts, or before an autoregressive cycle would keep more than `PENDING_CONTEXT`."""
    return pending > 0 if drafts else pending >= PENDING_CONTEXT


def flush_passes(block_sizes: Sequence[int]) -> int:
    """The flushes (`flushes`) of a lone row that keeps the option to draft, over cycles of `block_sizes`: each
    autoregressive cycle keeps its position's context, each drafting one writes what was kept first."""
    passes = pending = 0
    for b in block_sizes:
        drafts = b > AUTOREGRESSIVE
        if flushes(drafts, pending):
            passes, pending = passes + 1, 0
        pending = 0 if drafts else pending + 1
    return passes


def switches(block_sizes: Sequence[int]) -> int:
    """The drafting cycles of a lone row, over cycles of `block_sizes`, that follow an autoregressive one: each finds
    the drafter cold and pays a switch (`CycleCost.switch`)."""
    return sum(before == AUTOREGRESSIVE != b for before, b in zip(block_sizes, block_sizes[1:], strict=False))


def cycle_shapes(block_sizes: Sequence[int], tree_nodes: Sequence[int] = ()) -> list[str]:
    """Each cycle's shape, as every report names it: `b=1` (autoregressive), `b=4` (a chain of 4), `tree:15` (a tree
    of 15 drafted nodes). `tree_nodes`: per cycle, where trees ran (a chain of b counts b - 1; empty: chains)."""
    nodes = tree_nodes or [b - 1 for b in block_sizes]
    return [
        f"b={b}" if b == AUTOREGRESSIVE or count == b - 1 else f"tree:{count}"
        for b, count in zip(block_sizes, nodes, strict=True)
    ]
