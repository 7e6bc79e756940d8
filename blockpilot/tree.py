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

import torch
import torch.nn.functional as F

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
    children = {
        (parent, token): node for node, (parent, token) in enumerate(zip(tree.parents, tree.tokens)) if parent != DEAD
    }
    path, node = [], 0
    for token in continuation:
        node = children.get((node, int(token)), DEAD)
        if node == DEAD:
            break
        path.append(node)
    return path


def grow_trees(
    top_logprobs: torch.Tensor,  # (n, L, k) each drafted slot's top k, most likely first; -inf where nothing grows
    top_ids: torch.Tensor,  # (n, L, k)
    budgets: torch.Tensor,  # (n,) the nodes each row's tree keeps
    slots: int,  # S: the root and at most S - 1 nodes
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's best-first tree (`tree.best_first_tree`'s, up to exact ties) in fixed-shape tensor steps, so it
    compiles and replays with the cycle: tokens, depths, parents (n, S), ancestors (n, S, S) and each node's
    probability (n, S), in `DraftTree`'s layout (nodes by decreasing probability, dead nodes past the tree).

    The N = S - 1 most probable continuations of length d are extensions of the N most probable of length d - 1
    (a continuation's prefix is at least as probable, and each of N better prefixes extends to a better
    continuation), so a beam of N over the levels holds every candidate; the tree is the best N of all levels. A
    child ties its parent when its token has probability 1: keys fall by 1e-9 a level, so parents come first."""
    n, levels, k = top_logprobs.shape
    nodes = slots - 1
    device = top_logprobs.device
    beams_scores, beams_parent, beams_token = [], [], []
    scores = torch.zeros(n, 1, dtype=torch.float64, device=device)
    for level in range(levels):  # (n, beam) x (k,) -> the best `nodes` of the level
        candidates = (scores[:, :, None] + top_logprobs[:, level, None, :].double()).flatten(1)
        if candidates.shape[1] < nodes:
            candidates = F.pad(candidates, (0, nodes - candidates.shape[1]), value=-torch.inf)
        scores, index = candidates.topk(nodes, dim=1)
        beams_parent.append(torch.div(index, k, rounding_mode="floor"))
        beams_token.append(top_ids[:, level].gather(1, (index % k)))
        beams_scores.append(scores)
    every_score = torch.cat(beams_scores, dim=1)  # (n, L * N)
    level_of = torch.arange(levels, device=device).repeat_interleave(nodes)  # (L * N,)
    key = every_score - 1e-9 * level_of
    _, order = key.topk(nodes, dim=1)  # (n, N): the tree's nodes 1 .. N, best first
    chosen_score = every_score.gather(1, order)
    node_index = torch.arange(1, slots, device=device)
    alive = torch.isfinite(chosen_score) & (node_index[None, :] <= budgets[:, None])
    # Each beam entry's node (-1: not in the tree), to find a chosen node's parent among the level above.
    node_of = torch.full((n, levels * nodes), -1, dtype=torch.long, device=device)
    node_of.scatter_(1, order, torch.where(alive, node_index[None, :], -1))
    level = level_of[order]  # (n, N)
    beam_parent = torch.cat(beams_parent, dim=1).gather(1, order)  # the parent's place in the level above
    above = node_of.gather(1, ((level - 1).clamp(min=0) * nodes + beam_parent))
    parent = torch.where(level == 0, torch.zeros_like(above), above)
    alive = alive & (parent >= 0)
    root = torch.zeros(n, 1, dtype=torch.long, device=device)
    tokens = torch.cat([root, torch.where(alive, torch.cat(beams_token, dim=1).gather(1, order), 0)], dim=1)
    depths = torch.cat([root, torch.where(alive, level + 1, 0)], dim=1)
    parents = torch.cat([root - 1, torch.where(alive, parent, -1)], dim=1)
    probabilities = torch.cat([root + 1.0, torch.where(alive, chosen_score.exp(), 0.0)], dim=1).float()
    ancestors = torch.eye(slots, dtype=torch.bool, device=device).expand(n, -1, -1).clone()
    current = parents
    for _ in range(levels):  # climb one level a step: every node's ancestors, the root included
        ancestors |= F.one_hot(current.clamp(min=0), slots).bool() & (current >= 0)[..., None]
        current = torch.where(current >= 0, parents.gather(1, current.clamp(min=0)), current)
    return tokens, depths, parents, ancestors, probabilities
