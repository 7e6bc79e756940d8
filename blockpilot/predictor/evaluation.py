"""The predictor on label rows: its choices, their metrics (`blockpilot.scoring`), and the report's figures."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from blockpilot.predictor.model import BlockSizePredictor
from blockpilot.scoring import LabelArrays, choice_walks, evaluate_choices
from blockpilot.walks import ADAPT_CONFIDENCE, ADAPT_MARGIN, adapts, temperature_groups, walked_throughput


@torch.no_grad()
def predict_indices(model: BlockSizePredictor, arrays: LabelArrays, batch_size: int = 512) -> np.ndarray:
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(arrays), batch_size):
        inputs = arrays.batch(slice(start, start + batch_size)).to(device)
        out.append(model.choose(model(inputs), inputs.temperature).cpu())
    return torch.cat(out).numpy()


def evaluate_predictor(model: BlockSizePredictor, arrays: LabelArrays) -> dict[str, float]:
    return evaluate_choices(predict_indices(model, arrays), arrays)


def fixed_choices(
    model: BlockSizePredictor,
    train: LabelArrays,
    val: LabelArrays,
    confidence: float = ADAPT_CONFIDENCE,
    margin: float = ADAPT_MARGIN,
) -> tuple[tuple[tuple[float, int], ...], dict[str, float]]:
    """The temperatures at which the predictor's choices do not surely decode faster (modeled tokens a second) on
    the validation rows `val` than one fixed shape (`walks.adapts` at `confidence` and `margin`), each with that
    shape: the fastest single shape on the training rows `train` at that temperature (chosen there, so that the
    comparison on `val` is fair). A request at such a temperature then needs no predictor pass. Returns
    `PredictorConfig.fixed_at` and the figures, as `T<t>/throughput_pred`, `T<t>/throughput_fixed`,
    `T<t>/fixed_index` and `T<t>/p_faster` (the share of resamples in which the predictor was faster by the margin)."""
    if model.config.fixed_at:
        raise ValueError("fixed_choices compares the predictor's own choices: ask before its fixed_at is set")
    shapes = range(len(model.config.shapes))
    # Each shape's walks over the rows, as `evaluate_choices` prices a choice (without its oracles).
    train_walks, val_walks = choice_walks(train), choice_walks(val)
    train_groups = temperature_groups(train.temperature.tolist())
    val_groups = temperature_groups(val.temperature.tolist())
    chosen = predict_indices(model, val)
    metrics: dict[str, float] = {}
    fixed = []
    for t in sorted(set(val.temperature.tolist()) & set(train.temperature.tolist())):
        group = f"T{t:g}/"
        fitted, rows = train_walks.rows(train_groups[group]), val_walks.rows(val_groups[group])
        fitted_throughput = [walked_throughput(fitted.per_row(np.full(len(fitted.tokens), i))) for i in shapes]
        best = max(shapes, key=lambda index: (fitted_throughput[index], -index))  # ties to the smaller
        predicted, alone = rows.per_row(chosen[val_groups[group]]), rows.per_row(np.full(len(rows.tokens), best))
        adapted, share = adapts(predicted, alone, confidence, margin)
        metrics |= {
            f"{group}throughput_pred": walked_throughput(predicted),
            f"{group}throughput_fixed": walked_throughput(alone),
            f"{group}fixed_index": float(best),
            f"{group}p_faster": share,
        }
        if not adapted:
            fixed.append((float(t), best))
    return tuple(fixed), metrics


def format_fixed_choices(model: BlockSizePredictor, metrics: dict[str, float]) -> str:
    """One line: at each temperature, the predictor's and the fixed shape's modeled tokens a second on the validation
    rows, and which one a request there gets."""
    fixed = dict(model.config.fixed_at)
    parts = []
    for t in sorted({float(k[1:].split("/", 1)[0]) for k in metrics}):
        shape = model.config.shapes[int(metrics[f"T{t:g}/fixed_index"])]
        name = f"b = {shape[0]}" if shape[1] is None else f"a tree of {shape[1]} nodes"
        who = f"gets the fixed {name}" if t in fixed else "gets the predictor's choice"
        pred, alone = metrics[f"T{t:g}/throughput_pred"], metrics[f"T{t:g}/throughput_fixed"]
        share = metrics[f"T{t:g}/p_faster"]
        parts.append(
            f"T = {t:g} {who} (predictor {pred:,.1f}, fixed {name} {alone:,.1f} modeled tokens/s; the predictor "
            f"faster by the margin in {share:.0%} of resamples)"
        )
    return "[predictor] on the validation rows: " + "; ".join(parts)


def predictor_figures(predictor: BlockSizePredictor, arrays: LabelArrays) -> dict[str, Any]:
    """Confusion matrix (B* vs predicted b) and the tau and throughput of each policy, as matplotlib figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    choice = predict_indices(predictor, arrays)
    size = arrays.shapes
    confusion = np.zeros((size, size), dtype=int)
    for truth, guess in zip(arrays.best_index, choice, strict=True):
        confusion[truth, guess] += 1
    matrix_figure, ax = plt.subplots(figsize=(4.5, 4))
    ax.imshow(confusion, cmap="Blues")
    labels = [str(b) for b in arrays.candidates] + [f"t{n}" for n in arrays.tree_budgets if arrays.over_shapes]
    ax.set_xticks(range(size), labels)
    ax.set_yticks(range(size), labels)
    ax.set_xlabel("predicted b")
    ax.set_ylabel("B*")
    for i in range(size):
        for j in range(size):
            ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=8)
    matrix_figure.tight_layout()
    metrics = evaluate_choices(choice, arrays)
    bars_figure, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    names = ["fixed B", "best fixed", "predictor", "static oracle", "per-step oracle"]
    for ax, prefix, unit in ((axes[0], "tau_", "mean tau"), (axes[1], "throughput_", f"tokens / {arrays.cost.unit}")):
        keys = ["B", "best_fixed", "pred", "oracle", "step_oracle"]
        values = [metrics.get(prefix + key, math.nan) for key in keys]
        shown = [0 if math.isnan(v) else v for v in values]
        ax.bar(names, shown, color=["#999", "#777", "#2a7", "#35a", "#a53"])
        finite = [v for v in values if not math.isnan(v)]
        ax.set_ylim(min(finite) * 0.97, max(finite) * 1.01)
        ax.set_ylabel(unit)
        ax.tick_params(axis="x", labelrotation=30)
    bars_figure.tight_layout()
    return {"confusion_matrix.png": matrix_figure, "tau_by_policy.png": bars_figure}


# What a comparison of predictors draws beside them: the fixed shapes and the oracles, by `walks` name.
COMPARED_BASELINES = (
    ("autoregressive", "autoregressive"),
    ("best_fixed", "best fixed b"),
    ("best_tree", "best fixed tree"),
    ("oracle", "static oracle"),
    ("step_oracle", "per-step oracle"),
    ("shape_oracle", "shape oracle"),
)


def comparison_figure(predictors: dict[str, dict[str, float]], baselines: dict[str, float] | None = None) -> Any:
    """Held-out tau and modeled throughput of each predictor (its `eval` metrics, `tau_pred`/`throughput_pred`)
    beside the fixed shapes and oracles of `baselines`: by default the metrics of the predictor that evaluated the
    most of them (the one whose candidates include autoregression)."""
    if not predictors:
        raise ValueError("no predictors to compare: expected at least one predictor's eval metrics")
    if baselines is None:
        baselines = max(predictors.values(), key=lambda m: sum(f"tau_{key}" in m for key, _ in COMPARED_BASELINES))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A configuration tag reads "name: what it is"; the bars carry the name, the predictor first, top down.
    bars = [(name.split(":")[0], metrics, "pred") for name, metrics in predictors.items()]
    bars += [(label, baselines, key) for key, label in COMPARED_BASELINES if f"tau_{key}" in baselines]
    figure, axes = plt.subplots(1, 2, figsize=(10, 1.2 + 0.32 * len(bars)), sharey=True)
    colors = ["#2a7"] * len(predictors) + ["#999"] * (len(bars) - len(predictors))
    for ax, prefix, unit in ((axes[0], "tau_", "mean tau"), (axes[1], "throughput_", "modeled throughput")):
        values = [metrics.get(prefix + key, math.nan) for _, metrics, key in bars]
        drawn = ax.barh(range(len(bars)), [0 if math.isnan(v) else v for v in values], color=colors)
        shown = ["-" if math.isnan(v) else f"{v:,.0f}" if v >= 100 else f"{v:.2f}" for v in values]
        ax.bar_label(drawn, labels=shown, fontsize=7, padding=2)
        ax.set_yticks(range(len(bars)), [name for name, _, _ in bars])
        ax.set_xlabel(unit)
        ax.margins(x=0.15)
    axes[0].invert_yaxis()  # the axes share it
    figure.suptitle("predictors on the held-out labels")
    figure.tight_layout()
    return figure
