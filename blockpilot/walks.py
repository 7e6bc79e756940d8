"""The metrics of block-size policies over label rows, defined once: the label summary, the predictor's and the step
model's reports, MLflow, the demo and the notebooks all read these names.

A policy's walks over a set of rows commit tokens in cycles, each cycle priced by the cost curve c(b), and each
request what it pays beyond its cycles (`CycleCost.request`, where the rows carry their prompts' lengths): its start,
every shape's alike, and, where it drafts or keeps the option to, its prompt's drafter context:

    tau_<policy>         committed tokens / cycles
    throughput_<policy>  committed tokens / cost (tokens per second with a calibrated curve, per cycle without)

Policies by name:

    autoregressive  b = 1 every cycle: no drafting (tau 1, priced at the autoregressive step's cost)
    B            the drafter's training block size, every cycle
    best_fixed   the one candidate with the highest throughput over the rows evaluated (`best_fixed_b` names it;
                 under a uniform cost, the one with the highest tau); autoregression among them where labeled
    oracle       the static oracle: each row's own best single b (hindsight, per row)
    step_oracle  the per-step oracle: the cheapest walk choosing b at every cycle (rows with acceptance tables)
    tree<N>      the draft tree of N nodes, every cycle (rows whose tables hold trees; priced by `CycleCost.tree`)
    best_tree    the one tree budget with the highest throughput (`best_tree_nodes` names it)
    best_shape   the one shape, block size or tree budget, with the highest throughput
    shape_oracle each row's own best shape (hindsight, per row)
    pred         the per-request predictor under test (`scoring`); `request` the same as a step model's prior
    step         the per-step model under test

Without tree prices in a measured cost curve, the tree policies report tau only.

Each metric is computed over all rows (no prefix) and over each group of rows a caller names: per temperature
(`T<t>/`, `temperature_groups`), per source (`source/<name>/`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from blockpilot.blocks import AUTOREGRESSIVE
from blockpilot.cost import CycleCost
from blockpilot.table import AcceptanceTable

# The block sizes `CycleCost.request` reads for a tree's cycles: any that drafts.
TREE = (0,)


@dataclass
class FixedWalks:
    """What each candidate's fixed-b walks spend on each row: (N, K) committed tokens, cycles and cost."""

    tokens: np.ndarray
    cycles: np.ndarray
    cost: np.ndarray

    def rows(self, index: np.ndarray) -> FixedWalks:
        return FixedWalks(self.tokens[index], self.cycles[index], self.cost[index])

    def per_row(self, choice: np.ndarray) -> np.ndarray:
        """(N, 3) each row's (tokens, cycles, cost) when row i keeps candidate `choice[i]` for its whole generation."""
        picked = (np.arange(len(choice)), np.asarray(choice, dtype=np.int64))
        return np.stack([self.tokens[picked], self.cycles[picked], self.cost[picked]], axis=1)

    def chosen(self, choice: np.ndarray) -> tuple[float, float, float]:
        """(tokens, cycles, cost) over the rows when row i keeps candidate `choice[i]` for its whole generation."""
        tokens, cycles, cost = self.per_row(choice).sum(axis=0)
        return float(tokens), float(cycles), float(cost)

    def cheapest(self) -> np.ndarray:
        """(N,) each row's candidate of the highest throughput (the static oracle), near-ties to the smaller b."""
        rate = self.tokens / np.maximum(self.cost, 1e-12)
        return np.argmax(rate - 1e-9 * np.arange(rate.shape[1])[None, :], axis=1)

    def best_fixed(self) -> int:
        """The one candidate of the highest throughput over all the rows, near-ties to the smaller b."""
        rate = self.tokens.sum(axis=0) / np.maximum(self.cost.sum(axis=0), 1e-12)
        return int(np.argmax(rate - 1e-9 * np.arange(len(rate))))


def fixed_walks_of_tables(
    tables: Sequence[Sequence[AcceptanceTable]],
    cost: CycleCost,
    prompt_tokens: Sequence[int] | None = None,
) -> FixedWalks:
    """`FixedWalks` of rows with acceptance tables (each row's tables summed, a request each), walked with every
    candidate; with the rows' `prompt_tokens`, each request also pays what it does beyond its cycles
    (`CycleCost.request`: its start, and its prompt's drafter context where the candidate drafts)."""
    candidates = tables[0][0].candidates
    shape = (len(tables), len(candidates))
    tokens, cycles, spent = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for i, row in enumerate(tables):
        prompt = prompt_tokens[i] if prompt_tokens is not None else 0
        for table in row:
            for k, b in enumerate(candidates):
                steps = len(table.walk(b))
                tokens[i, k] += table.n - 1
                cycles[i, k] += steps
                spent[i, k] += table.walk_cost([b] * steps, cost=cost) + cost.request([b], prompt)
    return FixedWalks(tokens, cycles, spent)


@dataclass
class TreeWalks:
    """What each tree budget's walks spend on each row (`walks`, a column per budget), and whether the cost curve
    priced them (else each cycle costs 1 and only tau is reported)."""

    walks: FixedWalks
    budgets: tuple[int, ...]
    priced: bool

    @classmethod
    def priced_by(
        cls,
        tokens: np.ndarray,
        cycles: np.ndarray,
        budgets: tuple[int, ...],
        cost: CycleCost,
        beyond_cycles: np.ndarray | None = None,  # (N,) what each row's requests pay beyond their cycles
    ) -> TreeWalks:
        """Walks that committed `tokens` in `cycles` (N, T), each cycle priced `cost.tree(N)` and each row's requests
        `beyond_cycles` (`CycleCost.request`) where the curve prices trees (the uniform one does), else each cycle
        1."""
        priced = cost.is_uniform or bool(cost.trees)
        price = np.asarray([cost.tree(n) if priced else 1.0 for n in budgets])
        spent = cycles * price[None, :]
        if priced and beyond_cycles is not None:
            spent = spent + np.asarray(beyond_cycles, dtype=np.float64)[:, None]
        return cls(FixedWalks(tokens, cycles, spent), budgets, priced)


def tree_walks_of_tables(
    tables: Sequence[Sequence[AcceptanceTable]],
    cost: CycleCost,
    prompt_tokens: Sequence[int] | None = None,
) -> TreeWalks | None:
    """`TreeWalks` of every tree budget over rows whose tables hold trees (None when they do not), each cycle
    priced `cost.tree(N)` (1 a cycle where the curve prices no trees); with the rows' `prompt_tokens`, each request
    also pays what it does beyond its cycles (`CycleCost.request`; a tree drafts)."""
    budgets = tables[0][0].tree_budgets if tables and tables[0] else ()
    if not budgets or any(table.tree_budgets != budgets for row in tables for table in row):
        return None
    shape = (len(tables), len(budgets))
    tokens, cycles = np.zeros(shape), np.zeros(shape)
    for i, row in enumerate(tables):
        for table in row:
            for j, nodes in enumerate(budgets):
                tokens[i, j] += table.n - 1
                cycles[i, j] += len(table.walk_tree(nodes))
    prompts = prompt_tokens if prompt_tokens is not None else [0] * len(tables)
    beyond = np.asarray([len(row) * cost.request(TREE, prompt) for row, prompt in zip(tables, prompts, strict=True)])
    return TreeWalks.priced_by(tokens, cycles, budgets, cost, beyond)


def put_tree_policies(metrics: dict[str, float], prefix: str, chains: FixedWalks, tree_walks: TreeWalks, rows: np.ndarray) -> None:
    """Every fixed tree budget, the best one (and `best_tree_nodes`), the best fixed shape and each row's best shape
    (chains' columns first) over `rows`; tau only where the trees are not priced."""
    trees, budgets, priced = tree_walks.walks.rows(rows), tree_walks.budgets, tree_walks.priced
    everyone = len(trees.tokens)
    shown: dict[str, tuple[float, float, float]] = {
        f"tree{nodes}": trees.chosen(np.full(everyone, j)) for j, nodes in enumerate(budgets)
    }
    best = trees.best_fixed()
    shown["best_tree"] = trees.chosen(np.full(everyone, best))
    chain_cost = chains.cost if priced else chains.cycles  # unpriced trees: shapes compare by tau
    shapes = FixedWalks(
        np.concatenate([chains.tokens, trees.tokens], axis=1),
        np.concatenate([chains.cycles, trees.cycles], axis=1),
        np.concatenate([chain_cost, trees.cost], axis=1),
    )
    shown["best_shape"] = shapes.chosen(np.full(everyone, shapes.best_fixed()))
    shown["shape_oracle"] = shapes.chosen(shapes.cheapest())
    for name, spent in shown.items():
        put_policy(metrics, prefix, name, *spent)
        if not priced:
            del metrics[f"{prefix}throughput_{name}"]
    metrics[f"{prefix}best_tree_nodes"] = float(budgets[best])


def step_oracle(
    tables: Sequence[AcceptanceTable], cost: CycleCost, prompt_tokens: int = 0
) -> tuple[float, float, float]:
    """(tokens, cycles, cost) of the per-step oracle over `tables` (a request each): the walk of the lowest cost (its
    cycles counted on that walk's price; with a uniform price, the fewest cycles). With `prompt_tokens`, each request
    also pays what it does beyond its cycles (`CycleCost.request`), so the cheapest walk is the cheaper of
    autoregression throughout and the cheapest of all (the dynamic program's, a draft after autoregressive cycles
    paying their flush) with its drafter context added."""
    tokens = float(sum(t.n - 1 for t in tables))
    cycles = float(sum(t.cost_to_go(CycleCost.uniform())[0][1] for t in tables))
    if cost.is_uniform:
        return tokens, cycles, cycles
    spent = 0.0
    for table in tables:
        cheapest = float(table.cost_to_go_keeping_option(cost, cost.after_autoregression)[0][0, 1])
        drafted = cheapest + cost.request(TREE, prompt_tokens)
        if AUTOREGRESSIVE in table.candidates:
            alone = [AUTOREGRESSIVE] * (table.n - 1)
            spent += min(table.walk_cost(alone, cost=cost) + cost.request(alone, prompt_tokens), drafted)
        else:
            spent += drafted
    return tokens, cycles, spent


def modeled_throughput(tokens: float, cost: float) -> float:
    """Committed tokens / cost of walks (NaN where they cost nothing): the `throughput_<policy>` metric."""
    return tokens / cost if cost else math.nan


# The gate between an adaptive choice and the fixed one it would replace (`adapts`): how sure the validation rows
# must be, and by how much the adaptive choice must be faster. The margin: a calibrated curve prices two shapes to
# within a few percent of each other (two compiles of one cycle differ by that much on a CPU), so a smaller modeled
# gain is not one live. Small zoo, T = 0: a predictor modeled 0.8% faster in 91% of resamples decoded 0.980x live;
# mini, T = 0: 2.7% faster in 64%, 0.957x (docs/log.md, 2026-11-29).
ADAPT_CONFIDENCE = 0.9
ADAPT_MARGIN = 0.02


def faster_share(
    faster: np.ndarray,  # (N, 3) each row's (tokens, cycles, cost) under the policy said to be faster
    than: np.ndarray,  # (N, 3) the same rows' under the other policy
    margin: float = 0.0,
    resamples: int = 2000,
    seed: int = 0,
) -> float:
    """The share of paired bootstrap resamples of the rows (a resample draws N rows with replacement, each with both
    policies' walks) in which `faster`'s modeled throughput is more than (1 + `margin`) times `than`'s: how sure
    these rows make it that `faster` decodes faster on prompts like them, not only on these. 0.0 without rows."""
    if len(faster) != len(than):
        raise ValueError(f"faster_share compares the same rows: got {len(faster)} and {len(than)}")
    if len(faster) == 0:
        return 0.0
    draws = np.random.default_rng(seed).integers(0, len(faster), size=(resamples, len(faster)))
    drawn_faster, drawn_than = faster[draws].sum(axis=1), than[draws].sum(axis=1)  # (resamples, 3)
    # tokens / cost of each: compared as tokens_f * cost_t > (1 + margin) tokens_t * cost_f, dividing by no cost
    wins = drawn_faster[:, 0] * drawn_than[:, 2] > (1.0 + margin) * drawn_than[:, 0] * drawn_faster[:, 2]
    return float(wins.mean())


def adapts(
    adaptive: np.ndarray,
    alternative: np.ndarray,
    confidence: float = ADAPT_CONFIDENCE,
    margin: float = ADAPT_MARGIN,
) -> tuple[bool, float]:
    """Whether an adaptive policy replaces a simpler `alternative` on these rows (each (N, 3), as `faster_share`
    reads them), and the share of resamples that says so: its walks must decode more than `margin` faster over the
    rows, and in at least a share `confidence` of the paired bootstrap resamples, so that a gain these prompts show
    by chance, or one the cost curve cannot tell, does not cost live. Every gate between an adaptive choice and the
    fixed one it would replace asks this."""
    if not 0.0 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0, 1), got {confidence}")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    share = faster_share(adaptive, alternative, margin)
    faster = walked_throughput(adaptive) > (1.0 + margin) * walked_throughput(alternative)
    return bool(faster and share >= confidence), share


def walked_throughput(per_row: np.ndarray) -> float:
    """The modeled throughput of walks given per row, (N, 3) (tokens, cycles, cost)."""
    tokens, _, cost = per_row.sum(axis=0)
    return modeled_throughput(float(tokens), float(cost))


def put_policy(metrics: dict[str, float], prefix: str, name: str, tokens: float, cycles: float, cost: float) -> None:
    """`tau_<name>` and `throughput_<name>` (under `prefix`) of walks that committed `tokens` in `cycles` at `cost`."""
    metrics[f"{prefix}tau_{name}"] = tokens / cycles if cycles else math.nan
    metrics[f"{prefix}throughput_{name}"] = modeled_throughput(tokens, cost)


def put_fixed_policies(
    metrics: dict[str, float],
    prefix: str,
    walks: FixedWalks,
    candidates: tuple[int, ...],
    train_block_size: int | None,
) -> None:
    """Autoregression, fixed B, the best fixed b (and `best_fixed_b`) and the static oracle of `walks`."""
    everyone = len(walks.tokens)
    if AUTOREGRESSIVE in candidates:
        autoregressive = np.full(everyone, candidates.index(AUTOREGRESSIVE))
        put_policy(metrics, prefix, "autoregressive", *walks.chosen(autoregressive))
    if train_block_size in candidates:
        put_policy(metrics, prefix, "B", *walks.chosen(np.full(everyone, candidates.index(train_block_size))))
    best = walks.best_fixed()
    put_policy(metrics, prefix, "best_fixed", *walks.chosen(np.full(everyone, best)))
    metrics[f"{prefix}best_fixed_b"] = float(candidates[best])
    put_policy(metrics, prefix, "oracle", *walks.chosen(walks.cheapest()))


def temperature_groups(temperatures: Sequence[float]) -> dict[str, np.ndarray]:
    """Row indices of every metric group: all rows (no prefix), then each temperature (`T<t>/`)."""
    values = np.asarray(temperatures, dtype=np.float64)
    groups = {"": np.arange(len(values))}
    return groups | {f"T{t:g}/": np.flatnonzero(values == t) for t in sorted(set(values.tolist()))}


def policy_table(title: str, metrics: dict[str, float], columns: Sequence[tuple[str, str]]) -> str:
    """`metrics` as a table: a line per group (all, each temperature) and measure (tau, throughput), a column per
    (header, policy name) of `columns` that has a value; missing values print as nan."""
    columns = [(header, key) for header, key in columns if any(k.endswith(f"tau_{key}") for k in metrics)]
    lines = [title, f"  {'group':<6} {'':>10} " + " ".join(f"{header:>8}" for header, _ in columns)]
    groups = [""] + sorted({k.split("/", 1)[0] + "/" for k in metrics if k.startswith("T")})
    for group in groups:
        for measure in ("tau", "throughput"):
            values = [metrics.get(f"{group}{measure}_{key}", math.nan) for _, key in columns]
            name = group.rstrip("/") or "all"
            lines.append(f"  {name:<6} {measure:>10} " + " ".join(f"{value:>8.3f}" for value in values))
    return "\n".join(lines)


POLICY_COLUMNS = (
    ("AR", "autoregressive"),
    ("fixed B", "B"),
    ("best b", "best_fixed"),
    ("chosen", "pred"),
    ("request", "request"),
    ("step", "step"),
    ("rule", "rule"),
    ("static", "oracle"),
    ("per-step", "step_oracle"),
    ("tree", "best_tree"),
    ("shape or", "shape_oracle"),
)


def walk_metrics(
    walks: FixedWalks,
    groups: dict[str, np.ndarray],  # metric prefix -> row indices ("" for all rows)
    candidates: tuple[int, ...],
    train_block_size: int | None,
    policies: dict[str, Callable[[np.ndarray], tuple[float, float, float]]] | None = None,
    step_oracles: np.ndarray | None = None,  # (N, 3) each row's per-step oracle (tokens, cycles, cost)
    trees: TreeWalks | None = None,
) -> dict[str, float]:
    """Every metric of the module docstring for each group of rows: the fixed policies of `walks`, each policy under
    test (`policies[name](rows)` gives its (tokens, cycles, cost) over those row indices), the per-step oracle
    when the rows' `step_oracles` are given, and the tree policies with `trees` (`tree_walks_of_tables`)."""
    metrics: dict[str, float] = {}
    for prefix, rows in groups.items():
        if len(rows) == 0:
            continue
        put_fixed_policies(metrics, prefix, walks.rows(rows), candidates, train_block_size)
        for name, spent in (policies or {}).items():
            put_policy(metrics, prefix, name, *spent(rows))
        if step_oracles is not None:
            put_policy(metrics, prefix, "step_oracle", *step_oracles[rows].sum(axis=0))
        if trees is not None:
            put_tree_policies(metrics, prefix, walks.rows(rows), trees, rows)
    return metrics
