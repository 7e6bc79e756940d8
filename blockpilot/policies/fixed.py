"""The policies without a model: fixed b (DFlash as published), autoregressive decoding, and the entropy heuristic."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from blockpilot.checks import positive_int
from blockpilot.policies.base import BlockSizePolicy, PrefillState


@dataclass(frozen=True)
class FixedBlockSize(BlockSizePolicy):
    """The same b for every request (what DFlash does, with b = B)."""

    block_size: int
    name: str = field(default="fixed", init=False)
    adapts = False

    @property
    def block_size_choices(self) -> tuple[int, ...]:
        return (self.block_size,)

    def __post_init__(self) -> None:
        positive_int(self.block_size, "block_size")

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.block_size


@dataclass(frozen=True)
class FixedTree(BlockSizePolicy):
    """A draft tree of `nodes` drafted nodes, `depth` - 1 levels deep, for every request (DDTree with a fixed budget):
    the block size is the tree's depth."""

    nodes: int
    depth: int
    name: str = field(default="tree", init=False)
    adapts = False

    @property
    def block_size_choices(self) -> tuple[int, ...]:
        return (self.depth,)

    def __post_init__(self) -> None:
        positive_int(self.nodes, "nodes")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 2:
            raise ValueError(f"a tree is at least 2 deep (its root and one level), got depth {self.depth!r}")

    @property
    def tree_nodes(self) -> int:
        return self.nodes

    @property
    def tree_depth(self) -> int:
        return self.depth

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.depth


@dataclass(frozen=True)
class Autoregressive(BlockSizePolicy):
    """One token per target pass: what runs without a drafter."""

    name: str = field(default="autoregressive", init=False)
    adapts = False

    @property
    def block_size_choices(self) -> tuple[int, ...]:
        return (1,)

    def initial_block_size(self, prefill: PrefillState) -> int:
        return 1


@dataclass(frozen=True)
class EntropyHeuristic(BlockSizePolicy):
    """A training-free baseline: the more confident the first next-token distribution, the longer the block.

    b = round(max_block_size - (max_block_size - min_block_size) * min(H / high_entropy, 1)), with H the
    entropy (nats) of the prefill distribution: H = 0 drafts `max_block_size`, H >= `high_entropy` drafts
    `min_block_size`.
    """

    min_block_size: int
    max_block_size: int
    high_entropy: float = 3.0
    name: str = field(default="entropy", init=False)

    @property
    def block_size_choices(self) -> tuple[int, ...]:
        return tuple(range(self.min_block_size, self.max_block_size + 1))

    def __post_init__(self) -> None:
        positive_int(self.min_block_size, "min_block_size")
        positive_int(self.max_block_size, "max_block_size")
        if self.min_block_size > self.max_block_size:
            raise ValueError(
                f"min_block_size ({self.min_block_size}) must not exceed max_block_size ({self.max_block_size})"
            )
        if not (self.high_entropy > 0 and math.isfinite(self.high_entropy)):
            raise ValueError(f"high_entropy must be a positive number of nats, got {self.high_entropy!r}")

    def initial_block_size(self, prefill: PrefillState) -> int:
        confidence = 1.0 - min(prefill.entropy / self.high_entropy, 1.0)
        span = self.max_block_size - self.min_block_size
        return self.min_block_size + int(round(span * confidence))
