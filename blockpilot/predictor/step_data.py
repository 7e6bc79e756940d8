"""The step model's data, from label rows with acceptance tables: training cycles with every candidate's regret,
and the model's walks over held-out tables, scored with the metrics of `blockpilot.walks`.

Labels: Q(i, b) of `AcceptanceTable.cost_to_go` under a cycle cost (committed tokens per unit cost is what is
maximized); for a load-aware model, under the cost at each of its batch sizes, every cycle once per load. The last
cycle depends on the path to cursor i, so the training cycles are those of every candidate's fixed-b walk over each
table, each with the last cycle that walk ran; the model learns each candidate's regret there, Q(i, b) - min_b
Q(i, b) (`regret_dataset`: along any walk the regrets add up to its excess cost). Evaluation walks each held-out
table cycle by cycle with the model's choices (`walk_step_model`), as the engine runs it live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from blockpilot.blocks import AUTOREGRESSIVE
from blockpilot.cost import CycleCost, nearest_batch_size
from blockpilot.predictor.confidence import ConfidenceRule, walk_rule
from blockpilot.predictor.step_features import CycleView, anchor_tokens
from blockpilot.predictor.step_model import StepModel
from blockpilot.predictor.training import is_validation
from blockpilot.table import AcceptanceTable, tables_from_row
from blockpilot.walks import (
    ADAPT_CONFIDENCE,
    ADAPT_MARGIN,
    POLICY_COLUMNS,
    FixedWalks,
    adapts,
    fixed_walks_of_tables,
    policy_table,
    put_policy,
    step_oracle,
    temperature_groups,
    tree_walks_of_tables,
    walk_metrics,
)

STEP_COLUMNS = ["prompt_id", "temperature", "candidates", "train_block_size", "max_new_tokens", "vocab_size"]
STEP_COLUMNS += ["table_commits", "table_anchors", "table_tokens", "anchor_top_probs"]
STEP_COLUMNS += ["tree_budgets", "table_tree_commits"]


@dataclass(frozen=True)
class Anchors:
    """The target's top-1 probability at every cursor 1 .. n - 1 of one table (entry i - 1 is cursor i), (n - 1,);
    and the row's temperature."""

    confidence: np.ndarray
    temperature: float

    def view(self, table: AcceptanceTable, cursors: np.ndarray, **known: Any) -> CycleView:
        """The `CycleView` of the cycles at `cursors` (M,) of `table`; `known` holds what the walk knows besides
        (the last cycle, the prior, the load)."""
        cursors = np.asarray(cursors, dtype=np.int64)
        if table.tokens is None:
            raise ValueError("a step model reads the block's first tokens: the table must know its sequence")
        return CycleView(
            self.confidence[cursors - 1],
            self.temperature,
            cursors,
            anchor_tokens(table.tokens, cursors),
            **known,
        )


@dataclass
class StepRow:
    """One label row's tables with the anchors of every cursor (samples in table order)."""

    prompt_id: str
    temperature: float
    tables: list[AcceptanceTable]
    anchors: list[Anchors]  # one per table
    prior_block_size: int | None = None  # the per-request predictor's b0 for the row, when there is one
    prior_probabilities: np.ndarray | None = None  # (K,) its probability of every candidate
    prompt_tokens: int = 0  # its prompt's length: the drafter's context a request that may draft writes


def step_rows(table: pa.Table, prior: Any | None = None) -> list[StepRow]:
    """Label rows with acceptance tables as `StepRow`s; rows without them (errors, live sweeps) are skipped. With a
    per-request predictor `prior` (a `BlockSizePredictor`), each row carries b0, its choice from the row's prefill
    distribution, and its probabilities over the candidates."""
    missing = [c for c in STEP_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"labels lack the columns a step model needs: {missing}")
    table = table.filter(pc.and_(pc.is_valid(table["table_commits"]), pc.is_valid(table["anchor_top_probs"])))
    priors = _prior_choices(prior, table) if prior is not None else [(None, None)] * table.num_rows
    out = []
    columns = STEP_COLUMNS + (["prompt_tokens"] if "prompt_tokens" in table.column_names else [])
    for row, (b0, probabilities) in zip(table.select(columns).to_pylist(), priors, strict=True):
        tables = tables_from_row(row)
        if not tables:
            continue
        confidence = np.asarray([top[0] for top in row["anchor_top_probs"]], dtype=np.float32)
        anchors, start = [], 0
        for t in tables:
            anchors.append(Anchors(confidence[start : start + t.n - 1], float(row["temperature"])))
            start += t.n - 1
        if start != len(confidence):
            raise ValueError(f"row {row['prompt_id']!r}: {len(confidence)} anchor features for {start} table anchors")
        prompt_tokens = int(row.get("prompt_tokens") or 0)
        out.append(
            StepRow(row["prompt_id"], float(row["temperature"]), tables, anchors, b0, probabilities, prompt_tokens)
        )
    if not out:
        raise ValueError("no label row carries an acceptance table with anchor features (label with --mode replay)")
    return out


def _prior_choices(predictor: Any, table: pa.Table) -> list[tuple[int, np.ndarray]]:
    """The per-request predictor's b0 and probabilities over the candidates (K,) for every row of `table`, from
    the rows' prefill columns."""
    from blockpilot.predictor.inputs import DENSE_COLUMN, INPUT_COLUMNS, PredictorInputs, input_arrays

    if predictor.config.tree_budgets:
        raise ValueError("a predictor over tree shapes is no step model's prior: train the prior without --trees")
    candidates = {tuple(c) for c in table["candidates"].to_pylist()}
    if candidates != {tuple(predictor.config.candidates)}:
        raise ValueError(
            f"the per-request predictor's candidates {list(predictor.config.candidates)} are not the labels' "
            f"{[list(c) for c in sorted(candidates)]}"
        )
    dense = predictor.config.kind == "dense"
    columns = table.select([*INPUT_COLUMNS, *([DENSE_COLUMN] if dense else [])]).to_pydict()
    inputs = PredictorInputs.from_arrays(input_arrays(columns, dense))
    return list(zip(*predictor.decide(inputs), strict=True))


def fixed_walk_cycles(table: AcceptanceTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every cycle of every candidate's fixed-b walk over `table`: (cursor, last acceptance length, last b)
    per cycle, each (M,), M = the cycles of all walks; (0, 0) before a walk's first cycle."""
    cursors, last_accepted, last_sizes = [], [], []
    for b in table.candidates:
        cursor, accepted, size = 1, 0, 0
        for step in table.walk(b):
            cursors.append(cursor)
            last_accepted.append(accepted)
            last_sizes.append(size)
            cursor, accepted, size = cursor + step, step, b
    return np.asarray(cursors, dtype=np.int64), np.asarray(last_accepted), np.asarray(last_sizes)


def regret_dataset(
    rows: list[StepRow], model: StepModel, cost: CycleCost
) -> tuple[np.ndarray, np.ndarray]:
    """(X (M, F), R (M, K)): the features `model` reads of every cycle of every candidate's fixed-b walk
    (`fixed_walk_cycles`), and the regret of choosing each candidate there: Q(i, b) - min_b Q(i, b), what the choice
    adds to the cost of the rest of the generation, in cycles of the smallest candidate at the price used. For a
    load-aware model, every cycle once per load n, priced with c(b, n). A lone row's cycles are priced as the model's
    own walk pays them, its choice computed in each (`CycleCost.deciding`), and a draft after autoregressive cycles
    also pays the flush of what they kept (`AcceptanceTable.cost_to_go_keeping_option`, by the cycle's last b).

    Since Q(i, b) = c(b) + min Q at the cursor the cycle lands on, the regrets of any walk's cycles add up to that
    walk's cost over the per-step oracle's: the mean regret is what a policy loses, cycle for cycle. A relative
    regret, Q / min Q - 1, divides by the cost left to the end, so the last cycles of a sequence outweighed the rest
    (docs/log.md, "The regret a step model learns")."""
    spec = model.config.features
    features, regrets = [], []
    for load in model.config.loads or (None,):
        priced = (cost if load is None else cost.at_batch(load)).deciding()
        for row in rows:
            for t, anchors in zip(row.tables, row.anchors, strict=True):
                if t.n < 2:
                    continue
                _, by_state = t.cost_to_go_keeping_option(priced, priced.after_autoregression)  # (2, K, n - 1)
                unit = priced(min(t.candidates))
                cursors, last_accepted, last_sizes = fixed_walk_cycles(t)
                held = (last_sizes == AUTOREGRESSIVE).astype(np.int64)  # what the row kept before the cycle
                q = by_state[held, :, cursors - 1]  # (M, K)
                view = anchors.view(
                    t,
                    cursors,
                    last_accepted=last_accepted,
                    last_block_size=last_sizes,
                    prior_block_size=row.prior_block_size,
                    prior_probabilities=row.prior_probabilities,
                    batch_rows=load or 1,
                )
                features.append(spec.build(view))
                regrets.append((q - q.min(axis=1, keepdims=True)) / unit)
    return np.concatenate(features).astype(np.float32), np.concatenate(regrets).astype(np.float32)


def walk_step_model(
    model: StepModel,
    table: AcceptanceTable,
    anchors: Anchors,
    prior_block_size: int | None = None,
    prior_probabilities: np.ndarray | None = None,
    batch_rows: int = 1,
) -> tuple[list[int], list[int]]:
    """(block sizes, acceptance lengths) of the step model's walk over `table`, cycle by cycle, as the engine runs
    it: b0 drafts the first cycle when there is one, the model picks every other b from what it reads (at a
    temperature where the model keeps the prior, b0 drafts every cycle)."""
    spec, candidates = model.config.features, table.candidates
    if spec.prior and (prior_block_size is None or prior_probabilities is None):
        raise ValueError("this step model reads a per-request prior: walk it with the prior's b0 and probabilities")
    keeps_prior = model.config.keeps_prior_at(anchors.temperature)

    def choose(cursor: int, last_size: int | None, last_accepted: int | None) -> int:
        if prior_block_size is not None and (last_size is None or keeps_prior):
            return prior_block_size
        view = anchors.view(
            table,
            [cursor],
            last_accepted=last_accepted or 0,
            last_block_size=last_size or 0,
            prior_block_size=prior_block_size,
            prior_probabilities=prior_probabilities,
            batch_rows=batch_rows,
        )
        return candidates[int(model.choose(spec.build(view))[0])]

    return table.walk_policy(choose)


def _step_walks(row: StepRow, model: StepModel, cost: CycleCost, load: int) -> tuple[float, float, float]:
    """(tokens, cycles, cost) of the step model's walks over the row's tables (a request each): a lone row's cycles
    priced with the model's choice computed in each (`CycleCost.deciding`), and what keeping its option to draft
    costs beyond them (`CycleCost.request`), unless it keeps the prior's b0 at the row's temperature (then what a
    fixed walk pays)."""
    keeps_prior = model.config.keeps_prior_at(row.temperature)
    priced = cost if keeps_prior else cost.deciding()
    tokens = cycles = spent = 0.0
    for table, anchors in zip(row.tables, row.anchors, strict=True):
        sizes, _ = walk_step_model(model, table, anchors, row.prior_block_size, row.prior_probabilities, load)
        tokens += table.n - 1
        cycles += len(sizes)
        spent += table.walk_cost(sizes, cost=priced)
        spent += priced.request(sizes, row.prompt_tokens, keeps_option=not keeps_prior)
    return tokens, cycles, spent


def _rule_walks(row: StepRow, rule: ConfidenceRule, cost: CycleCost) -> tuple[float, float, float]:
    """(tokens, cycles, cost) of the confidence rule's walks over the row's tables, with what a request pays beyond
    its cycles (`CycleCost.request`; keeping the option to draft unless the rule never drafts at its temperature)."""
    tokens = cycles = spent = 0.0
    for table, anchors in zip(row.tables, row.anchors, strict=True):
        sizes = walk_rule(rule, table, anchors)
        tokens += table.n - 1
        cycles += len(sizes)
        keeps_option = not rule.never_drafts(row.temperature)  # else autoregressive for good
        spent += table.walk_cost(sizes, cost=cost) + cost.request(sizes, row.prompt_tokens, keeps_option)
    return tokens, cycles, spent


def _priced_at(cost: CycleCost, load: int | None) -> tuple[CycleCost, int]:
    """The curve that prices cycles at `load` rows (`CycleCost.at_batch`), and that load: by default the smallest
    batch size of `cost`, the curve `cost(b)` prices with."""
    if load is None:
        return cost, nearest_batch_size(cost.seconds, 1)
    return cost.at_batch(load), load


def _request_walks(rows: list[StepRow], walks: FixedWalks) -> np.ndarray | None:
    """(N, 3) each row's walks under the per-request predictor's b0 kept throughout (None where a row has no b0)."""
    if any(row.prior_block_size is None for row in rows):
        return None
    candidates = rows[0].tables[0].candidates
    return walks.per_row(np.asarray([candidates.index(row.prior_block_size) for row in rows]))


def evaluate_step_model(
    model: StepModel | None,
    rows: list[StepRow],
    cost: CycleCost,
    train_block_size: int | None = None,
    load: int | None = None,
    rule: ConfidenceRule | None = None,
) -> dict[str, float]:
    """The metrics of `blockpilot.walks` on the rows' tables, over all rows and per temperature: fixed B, the best
    fixed b, the static oracle, the per-request predictor (`request`, when the rows carry its b0), the step model
    (`step`, when given; after b0 when it reads one; its lone cycles priced with its choice computed in each, where
    `cost` measured that: `CycleCost.deciding`), the confidence `rule` (when given; priced by its own curve
    where it chooses, by `cost` where it is scored) and the per-step oracle. Fixed B is the model's training block
    size, else `train_block_size`. Cycles are priced at `load` rows (`CycleCost.at_batch`), or at the smallest batch
    size of `cost` without one; a load-aware model reads that load."""
    candidates = rows[0].tables[0].candidates
    if model is not None and model.config.candidates != candidates:
        raise ValueError(f"the step model's candidates {list(model.config.candidates)} are not the labels' {list(candidates)}")
    cost, load = _priced_at(cost, load)
    tables, prompts = [row.tables for row in rows], [row.prompt_tokens for row in rows]
    walks = fixed_walks_of_tables(tables, cost, prompts)
    walked = {"request": _request_walks(rows, walks)}
    if model is not None:
        walked["step"] = np.asarray([_step_walks(row, model, cost, load) for row in rows])
    if rule is not None:
        walked["rule"] = np.asarray([_rule_walks(row, rule, cost) for row in rows])
    policies = {
        name: (lambda index, per_row=per_row: tuple(per_row[index].sum(axis=0)))
        for name, per_row in walked.items()
        if per_row is not None
    }
    oracles = np.asarray([step_oracle(row.tables, cost, row.prompt_tokens) for row in rows])
    train = model.config.train_block_size if model is not None else train_block_size
    groups = temperature_groups([row.temperature for row in rows])
    trees = tree_walks_of_tables(tables, cost, prompts)
    return walk_metrics(walks, groups, candidates, train, policies, oracles, trees)


def split_step_rows(rows: list[StepRow], share: float, seed: int) -> tuple[list[StepRow], list[StepRow]]:
    """(fit, validation) by prompt, as the per-request predictor's training splits its labels (`is_validation`);
    (rows, []) where a side would be empty."""
    validation = [row for row in rows if is_validation(row.prompt_id, share, seed)]
    if not validation or len(validation) == len(rows):
        return rows, []
    return [row for row in rows if not is_validation(row.prompt_id, share, seed)], validation


def prior_temperatures(
    model: StepModel,
    rows: list[StepRow],
    cost: CycleCost,
    load: int | None = None,
    confidence: float = ADAPT_CONFIDENCE,
    margin: float = ADAPT_MARGIN,
) -> tuple[tuple[float, ...], dict[str, float]]:
    """The temperatures of `rows` at which `model` choosing every cycle does not surely walk faster (modeled tokens a
    second) than the per-request prior's b0 kept to the end (`walks.adapts` at `confidence` and `margin`), and the
    figures that say so: `T<t>/throughput_step`, `T<t>/throughput_request` (and their `tau_`) and `T<t>/p_faster`
    (the share of resamples in which the model was faster by the margin). Priced as `evaluate_step_model` prices
    them."""
    if not model.config.prior:
        raise ValueError("prior_temperatures compares a step model with its per-request prior: it has none")
    if model.config.prior_temperatures:
        raise ValueError("prior_temperatures compares the model's own choices: ask before its temperatures are set")
    cost, load = _priced_at(cost, load)
    prior = _request_walks(
        rows, fixed_walks_of_tables([row.tables for row in rows], cost, [row.prompt_tokens for row in rows])
    )
    if prior is None:
        raise ValueError("prior_temperatures walks the prior's b0: build the rows with it (step_rows(table, prior))")
    stepped = np.asarray([_step_walks(row, model, cost, load) for row in rows])
    metrics: dict[str, float] = {}
    kept = []
    for group, index in temperature_groups([row.temperature for row in rows]).items():
        put_policy(metrics, group, "step", *stepped[index].sum(axis=0))
        put_policy(metrics, group, "request", *prior[index].sum(axis=0))
        if group:
            adapted, metrics[f"{group}p_faster"] = adapts(stepped[index], prior[index], confidence, margin)
            if not adapted:
                kept.append(rows[index[0]].temperature)
    return tuple(kept), metrics


def format_prior_temperatures(kept: tuple[float, ...], metrics: dict[str, float]) -> str:
    """One line: at each temperature, the model's and the prior's modeled tokens a second on the validation rows,
    and which one decides there."""
    temperatures = sorted({float(k[1:].split("/", 1)[0]) for k in metrics if k.startswith("T")})
    parts = []
    for t in temperatures:
        step, request = metrics[f"T{t:g}/throughput_step"], metrics[f"T{t:g}/throughput_request"]
        who = "keeps the prior's b0" if t in kept else "chooses every cycle"
        share = metrics[f"T{t:g}/p_faster"]
        parts.append(
            f"T = {t:g} {who} (step {step:,.1f}, prior {request:,.1f} modeled tokens/s; the model faster by the "
            f"margin in {share:.0%} of resamples)"
        )
    return "[step] on the held-out share of --labels: " + "; ".join(parts)


def format_step_metrics(title: str, metrics: dict[str, float]) -> str:
    """The evaluation's table, a column for each policy that was evaluated."""
    return policy_table(title, metrics, POLICY_COLUMNS)

