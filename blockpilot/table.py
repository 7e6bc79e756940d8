"""The acceptance table of one generated sequence, and every walk, oracle and label derived from it.

For a generated sequence g_0..g_{n-1} after a prompt of P tokens, and the target's context features of
every position: a(i, b) = the tokens a block of size b anchored at cursor i commits = (drafts of that block
that match g_i, g_{i+1}, ...) + 1 for the target's own token, capped at n - i. The block sits at position
P + i - 1 with g_{i-1} first and sees the context strictly before that position and nothing of other blocks:
DFlash's own training layout, so one call of the drafting primitive per candidate fills a column (in chunks
of anchors, so memory stays bounded on long sequences). As in a live run, a block at cursor i is cut to
max_new_tokens - i slots.

A candidate's walk is index-chasing: c = 1; repeat c += a(c, b). At T = 0 it equals a live run of b exactly.
At T > 0 under `match` (greedy drafts kept while they equal the target's samples), a live run's acceptances
are a function of its sampled sequence, which is a sample of the target whatever b is: walks over one shared
sample are exact in distribution for every b, and couple the candidates (their differences have less variance).

The table also keeps, for the largest candidate D, the drafter's confidence (top probability) in every slot of the
block at every cursor (the labels' `table_confidences`: what a confidence rule for the per-step choice reads).

The table also holds draft trees (`blockpilot.tree`) of every budget N in `tree_budgets`, D deep: t(i, N) =
1 + the nodes of the path of the best-first tree of N nodes, drafted from the D block's slots at cursor i, that spells
g_i, g_{i+1}, ...; capped at n - i. A live tree cycle commits the longest prefix of the target's picks that is a path
of its tree, and those picks are the sequence itself (greedy at T = 0; at T > 0 the engine's sample at each position,
which is the target's sample whatever the tree), so tree walks are exact as the chains' are.

With a cost per cycle c(b) (`blockpilot.cost`), the per-step oracle is the cheapest way from cursor 1 to n
when b may change at every cycle: J(n) = 0, J(i) = min_b c(b) + J(i + a(i, b)), right to left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from blockpilot.blocks import AUTOREGRESSIVE
from blockpilot.checks import distinct_block_sizes, distinct_tree_budgets, mean_or_nan
from blockpilot.models.drafter import Blocks, DeferredSlots
from blockpilot.models.loading import SpeculativeModels
from blockpilot.policies.base import draft_confidence
from blockpilot.tree import TOP_K, best_first_tree, path_nodes

# Elements of draft logits (anchors x slots x vocabulary) one primitive call may produce.
LOGITS_BUDGET = 1 << 26
# Draft slots computed at a time past the last layer's attention, each time only for the blocks whose drafts
# were all right so far (a block commits up to its first wrong draft).
SLOTS_PER_STAGE = 4

CostFn = Callable[[int], float]


def unit_cost(block_size: int) -> float:
    """Every cycle costs 1: modeled throughput is then tokens per cycle, i.e. tau."""
    return 1.0


@dataclass
class AcceptanceTable:
    """a(i, b) of one sequence: `commits[k, i - 1]` for candidate `candidates[k]` and cursor i = 1 .. n - 1."""

    candidates: tuple[int, ...]
    commits: np.ndarray  # (K, n - 1) int16
    max_new_tokens: int  # blocks at cursor i were cut to max_new_tokens - i slots, as a live run cuts them
    tokens: np.ndarray | None = None  # (n,) the sequence g_0..g_{n-1}, when known (labels from this version on)
    # (n - 1, D - 1) float32 for D = max(candidates): the drafter's top probability in slot j of the D block at
    # cursor i is confidences[i - 1, j - 1]; NaN in the slots a block cut to the generation budget lacks.
    confidences: np.ndarray | None = None
    # Draft trees of each budget (drafted nodes), max(candidates) deep: `tree_commits[j, i - 1]` = t(i, N_j).
    tree_budgets: tuple[int, ...] = ()
    tree_commits: np.ndarray | None = None  # (len(tree_budgets), n - 1) int16

    def __post_init__(self) -> None:
        if self.tokens is not None and len(self.tokens) != self.n:
            raise ValueError(f"a table of {self.n} tokens was given a sequence of {len(self.tokens)}")
        expected = (self.n - 1, max(self.candidates) - 1)
        if self.confidences is not None and self.confidences.shape != expected:
            raise ValueError(f"confidences of shape {self.confidences.shape} for a table that needs {expected}")
        trees = (len(self.tree_budgets), self.n - 1)
        if self.tree_budgets and (self.tree_commits is None or self.tree_commits.shape != trees):
            found = None if self.tree_commits is None else self.tree_commits.shape
            raise ValueError(f"tree commits of shape {found} for a table of tree budgets {self.tree_budgets}: expected {trees}")

    @property
    def n(self) -> int:
        """Length of the generated sequence (g_0 from the prefill included)."""
        return self.commits.shape[1] + 1

    def row(self, block_size: int) -> np.ndarray:
        return self.commits[self.candidates.index(block_size)]

    def block_size_at(self, cursor: int, block_size: int) -> int:
        """The size a block of b really has at `cursor` (cut to the generation budget)."""
        return min(block_size, self.max_new_tokens - cursor)

    def walk(self, block_size: int, start: int = 1, stop: int | None = None) -> list[int]:
        """Acceptance lengths of a fixed-b run over the sequence: from cursor `start` until it reaches `stop`
        (default: the end)."""
        stop = self.n if stop is None else min(stop, self.n)
        if not 1 <= start <= max(stop, 1):
            raise ValueError(f"a walk starts at a cursor within [1, {stop}], got {start}")
        return _chase(self.row(block_size), start, stop)

    def walk_tree(self, nodes: int) -> list[int]:
        """Acceptance lengths of a run verifying the best-first tree of `nodes` nodes every cycle."""
        if nodes not in self.tree_budgets:
            raise ValueError(f"this table has trees of {list(self.tree_budgets)} nodes, not {nodes}: relabel with it")
        return _chase(self.tree_commits[self.tree_budgets.index(nodes)], 1, self.n)

    def walk_policy(self, choose: Callable[[int, int | None, int | None], int]) -> tuple[list[int], list[int]]:
        """(block sizes, acceptance lengths) of a per-step policy: `choose(cursor, previous b, previous
        acceptance length)` picks a candidate before each cycle."""
        sizes, lengths, cursor, previous_b, previous_a = [], [], 1, None, None
        while cursor < self.n:
            b = choose(cursor, previous_b, previous_a)
            step = int(self.row(b)[cursor - 1])
            sizes.append(b)
            lengths.append(step)
            cursor += step
            previous_b, previous_a = b, step
        return sizes, lengths

    def tau(self) -> list[float]:
        """Mean acceptance length of every candidate's walk (NaN when the sequence has no cycle)."""
        return [mean_or_nan(self.walk(b)) for b in self.candidates]

    def walk_cost(self, sizes: Sequence[int], start: int = 1, cost: CostFn = unit_cost) -> float:
        """Total cost of the cycles of a walk whose chosen block sizes are `sizes`."""
        total, cursor = 0.0, start
        for b in sizes:
            total += cost(self.block_size_at(cursor, b))
            cursor += int(self.row(b)[cursor - 1])
        return total

    def cost_to_go(self, cost: CostFn = unit_cost) -> tuple[np.ndarray, np.ndarray]:
        """The per-step oracle by dynamic programming: (J (n + 1,) cost from each cursor to the end, J[n] = 0,
        and Q (K, n - 1) the cost of choosing each candidate at each cursor and acting optimally after)."""
        best, q = self.cost_to_go_keeping_option(cost, 0.0)
        return best[0], q[0]

    def cost_to_go_keeping_option(self, cost: CostFn, switching: float) -> tuple[np.ndarray, np.ndarray]:
        """`cost_to_go` of a lone row that keeps the option to draft: a cycle that drafts after autoregressive ones
        first pays `switching` (`CycleCost.after_autoregression`): the pass that writes the drafter context they kept
        (`blocks.flushes`; context kept to the end is never written; the flush of a run of more than
        `PENDING_CONTEXT` autoregressive positions is left out) and the switch. (J (2, n + 1), Q (2, K, n - 1)) by
        what the row holds before the cycle: 0, nothing kept (after a draft, or before the first cycle); 1, kept by the
        autoregressive cycle before."""
        n, k = self.n, len(self.candidates)
        best = np.zeros((2, n + 1))
        q = np.zeros((2, k, max(n - 1, 0)))
        for cursor in range(n - 1, 0, -1):
            for index, b in enumerate(self.candidates):
                step = int(self.commits[index, cursor - 1])
                drafts = b != AUTOREGRESSIVE
                rest = best[0 if drafts else 1, cursor + step]
                q[0, index, cursor - 1] = cost(self.block_size_at(cursor, b)) + rest
                q[1, index, cursor - 1] = q[0, index, cursor - 1] + (switching if drafts else 0.0)
            best[:, cursor] = q[:, :, cursor - 1].min(axis=1)
        return best, q


def _chase(commits: np.ndarray, start: int, stop: int) -> list[int]:
    """The acceptance lengths of cycles from cursor `start` until `stop`, each committing `commits[cursor - 1]`."""
    lengths, cursor = [], start
    while cursor < stop:
        step = int(commits[cursor - 1])
        lengths.append(step)
        cursor += step
    return lengths


@torch.inference_mode()
def acceptance_table(
    models: SpeculativeModels,
    prompt_length: int,
    tokens: Sequence[int],  # g_0..g_{n-1}
    features: torch.Tensor,  # (>= prompt_length + n - 1, F): the target's context features of every position
    candidates: Sequence[int],
    max_new_tokens: int,
    slot_hits: np.ndarray | None = None,  # (K, max b - 1, 2): per candidate and draft slot, [right, drafted] += ...
    tree_budgets: Sequence[int] = (),
    top_k: int = TOP_K,
) -> AcceptanceTable:
    """a(i, b) for every cursor and candidate: one drafting-primitive call per candidate (chunked), the largest
    candidate's draft confidences in every slot, and t(i, N) for every tree budget N, from trees branching into the
    `top_k` tokens of each of that block's slots.

    A block's drafts past its first wrong one change nothing to a(i, b), so the last layer's per-token part and the
    head run only on the slots blocks reach (`_accepted_drafts`), except for the largest candidate, whose every slot's
    confidence the table keeps, and unless `slot_hits` asks for every slot's accuracy."""
    candidates = distinct_block_sizes(candidates)
    drafter, device = models.drafter, models.device
    if drafter is None:
        raise ValueError("an acceptance table needs a drafter")
    n = len(tokens)
    context_length = prompt_length + n - 1
    if features.shape[0] < context_length:
        raise ValueError(f"features cover {features.shape[0]} positions; the table needs {context_length}")
    tree_budgets = distinct_tree_budgets(tree_budgets)
    commits = np.ones((len(candidates), max(n - 1, 0)), dtype=np.int16)
    generated = np.asarray(tokens, dtype=np.int64)
    largest = max(candidates)
    confidences = torch.full((max(n - 1, 0), largest - 1), torch.nan)
    # The largest block's top k log-probabilities (-inf past a block cut to the budget) and tokens per slot.
    top_logprobs = torch.full((max(n - 1, 0), largest - 1, top_k), -torch.inf)
    top_ids = torch.zeros((max(n - 1, 0), largest - 1, top_k), dtype=torch.int64)

    def table() -> AcceptanceTable:
        trees = tree_commit_rows(top_logprobs.numpy(), top_ids.numpy(), generated, tree_budgets) if tree_budgets else None
        return AcceptanceTable(
            candidates, commits, max_new_tokens, generated, confidences.numpy(), tree_budgets, trees
        )

    if n < 2:
        return table()
    sequence = torch.as_tensor(list(tokens), device=device)
    context = features[:context_length].to(device)[None]
    context_kv = drafter.encode_context(context, torch.arange(context_length, device=device)[None])
    embed, head = models.target.get_input_embeddings(), models.target.get_output_embeddings()
    cursors = torch.arange(1, n, device=device)
    # The sequence, padded past its end with a token id no draft equals.
    padded = torch.cat([sequence, torch.full((max(candidates),), -1, device=device, dtype=sequence.dtype)])
    vocab = head.weight.shape[0]
    for column, b in enumerate(candidates):
        sizes = torch.clamp(max_new_tokens - cursors, max=b)
        drafting = (sizes > 1).nonzero().flatten()
        chunk = max(1, LOGITS_BUDGET // (b * vocab))
        for start in range(0, drafting.numel(), chunk):
            rows = drafting[start : start + chunk]
            width = int(sizes[rows].max())
            blocks = drafter.draft_over_one_context(
                embed,
                context_kv,
                Blocks(sequence[cursors[rows] - 1], prompt_length + cursors[rows] - 1, sizes[rows], width),
                models.mask_token_id,
                defer_last_layer=True,
            )
            accepted, logits = _accepted_drafts(
                blocks,
                head,
                padded,
                cursors[rows],
                sizes[rows],
                slot_hits[column] if slot_hits is not None else None,
                every_slot=b == largest,
            )
            step = torch.minimum(accepted + 1, n - cursors[rows])
            on_host = rows.cpu()
            commits[column, on_host.numpy()] = step.cpu().numpy()
            if b == largest:
                in_block = (torch.arange(1, width, device=device)[None, :] < sizes[rows][:, None])[..., None]
                confidences[on_host, : width - 1] = torch.where(in_block[..., 0], draft_confidence(logits), torch.nan).cpu()
                if tree_budgets:
                    logprobs, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(top_k, vocab), dim=-1)
                    top_logprobs[on_host, : width - 1, : ids.shape[-1]] = logprobs.masked_fill(~in_block, -torch.inf).cpu()
                    top_ids[on_host, : width - 1, : ids.shape[-1]] = ids.cpu()
    return table()


def tree_commit_rows(
    top_logprobs: np.ndarray,  # (n - 1, D - 1, k) per cursor and slot, most likely first, -inf where not drafted
    top_ids: np.ndarray,  # (n - 1, D - 1, k)
    sequence: np.ndarray,  # (n,) g_0..g_{n-1}
    budgets: Sequence[int],
) -> np.ndarray:
    """(len(budgets), n - 1) t(i, N): the tokens a verify of the best-first tree of N nodes at cursor i commits when
    the target's picks are the sequence (one tree of the largest budget per cursor: the smaller ones are its
    first N nodes)."""
    n, largest = len(sequence), max(budgets)
    commits = np.ones((len(budgets), max(n - 1, 0)), dtype=np.int16)
    for cursor in range(1, n):
        tree = best_first_tree(top_logprobs[cursor - 1].tolist(), top_ids[cursor - 1].tolist(), largest, largest + 1)
        path = np.asarray(path_nodes(tree, sequence[cursor:]))
        for j, nodes in enumerate(budgets):
            commits[j, cursor - 1] = min(int((path <= nodes).sum()) + 1, n - cursor)
    return commits


def _accepted_drafts(
    blocks: DeferredSlots,  # m blocks of width W
    head: torch.nn.Module,
    padded: torch.Tensor,  # the sequence, padded past its end with a token no draft equals
    cursors: torch.Tensor,  # (m,) each block's cursor: slot j drafts g_{cursor + j - 1}
    sizes: torch.Tensor,  # (m,) each block's slots
    slot_hits: np.ndarray | None,  # (>= W - 1, 2) of this candidate: every slot computed and counted
    every_slot: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """((m,) drafts of each block that match the sequence before its first wrong one, and the drafted slots'
    logits (m, W - 1, V) when every slot is computed). Slots are computed `SLOTS_PER_STAGE` at a time, each stage
    only for the blocks whose drafts were all right before it, unless every slot is asked for (`every_slot`,
    `slot_hits`)."""
    width = blocks.residual.shape[1]
    every_slot = every_slot or slot_hits is not None
    stage = width if every_slot else SLOTS_PER_STAGE
    accepted = torch.zeros(cursors.shape[0], dtype=torch.int64, device=cursors.device)
    every_logits = None
    alive = torch.arange(cursors.shape[0], device=cursors.device)
    for start in range(1, width, stage):
        stop = min(width, start + stage)
        draft_logits = head(blocks.hidden(alive, start, stop))  # (a, stop - start, V)
        slots = torch.arange(start, stop, device=cursors.device)
        wanted = padded[cursors[alive][:, None] + slots - 1]
        in_block = slots[None, :] < sizes[alive][:, None]
        right = (draft_logits.argmax(dim=-1) == wanted) & in_block
        run = right.to(torch.int64).cumprod(dim=1)
        accepted[alive] += run.sum(dim=1)
        if slot_hits is not None:
            slot_hits[start - 1 : stop - 1, 0] += right.sum(dim=0).cpu().numpy()
            slot_hits[start - 1 : stop - 1, 1] += in_block.sum(dim=0).cpu().numpy()
        if every_slot:
            every_logits = draft_logits
        alive = alive[run[:, -1] > 0]
        if alive.numel() == 0:
            break
    return accepted, every_logits


# ----------------------------------------------------------------------------- in label rows


def table_columns(tables: Sequence[AcceptanceTable]) -> dict[str, list]:
    """The tables of one label row (one per pooled sample) as the row's `table_commits` (per candidate, every
    sample's a(i, b) concatenated), `table_anchors` (cursors per sample), `table_tokens` (every sample's
    sequence g_0..g_{n-1} concatenated, n = cursors + 1) and `table_confidences` (every sample's (n - 1, D - 1)
    confidences, row-major, concatenated) columns; the last two are null unless every table knows them. With tree
    budgets, `tree_budgets` and `table_tree_commits` (per budget, every sample's t(i, N) concatenated)."""
    if not tables:
        return {
            "table_commits": None,
            "table_anchors": None,
            "table_tokens": None,
            "table_confidences": None,
            "tree_budgets": None,
            "table_tree_commits": None,
        }
    known = all(table.tokens is not None for table in tables)
    confident = all(table.confidences is not None for table in tables)
    budgets = tables[0].tree_budgets
    return {
        "tree_budgets": list(budgets) if budgets else None,
        "table_tree_commits": [
            [int(v) for table in tables for v in table.tree_commits[j]] for j in range(len(budgets))
        ]
        if budgets
        else None,
        "table_commits": [
            [int(v) for table in tables for v in table.commits[k]] for k in range(len(tables[0].candidates))
        ],
        "table_anchors": [table.commits.shape[1] for table in tables],
        "table_tokens": [int(v) for table in tables for v in table.tokens] if known else None,
        "table_confidences": np.concatenate([t.confidences.ravel() for t in tables]).tolist() if confident else None,
    }


def tables_from_row(row: dict) -> list[AcceptanceTable]:
    """The acceptance tables stored in a label row (empty for rows without one: live sweeps, errors)."""
    commits, anchors = row.get("table_commits"), row.get("table_anchors")
    if commits is None or anchors is None:
        return []
    candidates = tuple(int(b) for b in row["candidates"])
    matrix = np.asarray(commits, dtype=np.int16).reshape(len(candidates), -1)
    bounds = np.cumsum([0, *anchors])
    sequences: list[np.ndarray | None] = [None] * len(anchors)
    if row.get("table_tokens") is not None:  # labels of earlier versions lack the sequences
        tokens = np.asarray(row["table_tokens"], dtype=np.int64)
        token_bounds = np.cumsum([0, *(a + 1 for a in anchors)])
        if token_bounds[-1] != len(tokens):
            raise ValueError(f"row {row.get('prompt_id')!r}: {len(tokens)} table tokens for {list(anchors)} cursors")
        sequences = [tokens[start:stop] for start, stop in zip(token_bounds[:-1], token_bounds[1:], strict=True)]
    confidences: list[np.ndarray | None] = [None] * len(anchors)
    if row.get("table_confidences") is not None:  # labels of earlier versions lack them
        slots = max(candidates) - 1
        values = np.asarray(row["table_confidences"], dtype=np.float32)
        if len(values) != bounds[-1] * slots:
            raise ValueError(
                f"row {row.get('prompt_id')!r}: {len(values)} confidences for {bounds[-1]} cursors of {slots} slots"
            )
        confidences = [values[start * slots : stop * slots].reshape(-1, slots) for start, stop in zip(bounds, bounds[1:])]
    trees, budgets = None, ()
    if row.get("table_tree_commits") is not None:  # labels of version 2 on, read with that column
        budgets = tuple(int(nodes) for nodes in row["tree_budgets"])
        trees = np.asarray(row["table_tree_commits"], dtype=np.int16).reshape(len(budgets), -1)
    return [
        AcceptanceTable(
            candidates,
            matrix[:, start:stop],
            int(row["max_new_tokens"]),
            sequence,
            confidence,
            budgets,
            trees[:, start:stop] if trees is not None else None,
        )
        for start, stop, sequence, confidence in zip(bounds[:-1], bounds[1:], sequences, confidences, strict=True)
    ]
