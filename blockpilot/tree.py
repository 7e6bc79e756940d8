"""Draft trees (DDTree-style): the most probable continuations of the drafter's per-slot distributions, verified in one
target pass.

One drafter pass over a block of depth D gives a distribution q_d for every drafted slot d = 1 .. D - 1, each
conditioned on the context alone (not on the tokens drafted before it). A continuation (t_1, .., t_d) then has
probability q_1(t_1) .. q_d(t_d) under the drafter, and the `nodes` most probable continuations whose prefixes are
all in the set form a tree: the root is the block's first token (the last committed one), a node at depth d is one
continuation of length d. Built best-first: a node's two successors in probability order are its first child (the
most likely token one level down) and its next sibling (the next most likely token at its own level), so `nodes`
pops of a heap give the best `nodes` continuations, each in the `top_k` tokens of its slot.

A chain of b is the tree that keeps one token a level: b - 1 nodes, top_k = 1.

Layout: node 0 is the root, nodes 1 .. nodes are in the order they were chosen (a parent before its children); a
tree of fewer nodes than the batch's budget is padded with dead nodes (parent -1, never a child).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

DEAD = -1  # the parent of a padding node
TOP_K = 8  # the tokens of each drafted slot a tree may branch into


@dataclass(frozen=True)
class DraftTree:
    """One row's tree over `len(tokens)` slots (root first): token, depth (root 0) and parent (root and dead nodes
    -1) of each node."""

    tokens: list[int]
    depths: list[int]
    parents: list[int]
    probabilities: list[float]  # each node's continuation's probability under the drafter (root 1, padding 0)

    def ancestors(self) -> list[list[bool]]:
        """(S, S): node j is node i or one of its ancestors (a dead node: itself only)."""
        rows: list[list[bool]] = []
        for node, parent in enumerate(self.parents):
            row = list(rows[parent]) if parent != DEAD else [False] * len(self.parents)
            row[node] = True
            rows.append(row)
        return rows

    @property
    def live(self) -> int:
        """Nodes besides the root and the padding."""
        return sum(parent != DEAD for parent in self.parents)


def best_first_tree(
    top_logprobs: Sequence[Sequence[float]],  # (D - 1, k) per drafted slot, most likely first
    top_ids: Sequence[Sequence[int]],  # (D - 1, k)
    nodes: int,
    slots: int,
) -> DraftTree:
    """The `nodes` most probable continuations (at most D - 1 deep, each token in its slot's top k), padded to `slots`
    entries (root included)."""
    depth_limit, k = len(top_logprobs), len(top_logprobs[0]) if top_logprobs else 0
    tokens, depths, parents, probabilities = [0], [0], [DEAD], [1.0]
    # (-log probability, depth, rank at that depth, parent node)
    frontier = [(-top_logprobs[0][0], 1, 0, 0)] if depth_limit and nodes and top_logprobs[0][0] > -math.inf else []
    while frontier and len(tokens) <= nodes:
        negative, depth, rank, parent = heapq.heappop(frontier)
        node = len(tokens)
        tokens.append(int(top_ids[depth - 1][rank]))
        depths.append(depth)
        parents.append(parent)
        probabilities.append(math.exp(-negative))
        # Its next sibling and its first child; a slot past the row's depth (-inf) grows nothing.
        if rank + 1 < k and top_logprobs[depth - 1][rank + 1] > -math.inf:
            step = top_logprobs[depth - 1][rank] - top_logprobs[depth - 1][rank + 1]
            heapq.heappush(frontier, (negative + step, depth, rank + 1, parent))
        if depth < depth_limit and top_logprobs[depth][0] > -math.inf:
            heapq.heappush(frontier, (negative - top_logprobs[depth][0], depth + 1, 0, node))
    if len(tokens) > slots:
        raise ValueError(f"a tree of {len(tokens)} slots does not fit {slots}")
    padding = slots - len(tokens)
    return DraftTree(
        tokens + [0] * padding, depths + [0] * padding, parents + [DEAD] * padding, probabilities + [0.0] * padding
    )


def path_nodes(tree: DraftTree, continuation: Sequence[int]) -> list[int]:
    """The nodes (root excluded, shallowest first) of the tree's path that spells the longest prefix of
    `continuation`: what a verify commits past the root when the target's picks are `continuation`. Node indices
    grow along a path (a parent is chosen before its children), so the tree cut to its first N nodes keeps the path's
    nodes numbered up to N."""
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(tree.parents, tree.tokens)) if parent != DEAD}
    path, node = [], 0
    for token in continuation:
        node = children.get((node, int(token)), DEAD)
        if node == DEAD:
            break
        path.append(node)
    return path
