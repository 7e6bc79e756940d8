"""The load curve: tokens/s against concurrency, a line per serving mode, as `benchmarks/bench_serve.py` measures it
through the endpoint. Logged to MLflow (experiment `LOAD_EXPERIMENT`, a run per measurement: each mode's tokens/s a
metric whose step is the concurrency, so MLflow's chart view draws the curve too) and read back for the notebooks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from blockpilot.tracking import Tracker, latest_metric_histories

LOAD_EXPERIMENT = "blockpilot-load"
TOKENS_PER_S = "tokens_per_s/"  # + the mode

Curves = dict[str, dict[int, float]]  # mode -> concurrency -> value


def log_load_curve(tracker: Tracker, tokens_per_s: Curves, **others: Curves) -> None:
    """Each mode's tokens/s at each concurrency, the concurrency as the metric's step, and the figure
    (`load_curve_figure`); each of `others` (a latency such as `p99_ms`, tau) likewise, as metrics `NAME/MODE`."""
    for prefix, curves in ((TOKENS_PER_S, tokens_per_s), *((f"{name}/", curves) for name, curves in others.items())):
        for mode, points in curves.items():
            for concurrency, value in sorted(points.items()):
                tracker.log_metrics({prefix + mode: value}, step=concurrency)
    if tracker.enabled:
        tracker.log_figure(load_curve_figure(tokens_per_s), "load_curve.png")


def latest_load_curve() -> tuple[str, Curves] | None:
    """The newest logged load curve: its run's name and each mode's tokens/s by concurrency; None when tracking is
    unavailable or none was logged."""
    return latest_metric_histories(LOAD_EXPERIMENT, TOKENS_PER_S)


def load_curve_figure(tokens_per_s: Mapping[str, Mapping[int, float]], title: str = "") -> Any:
    """Tokens/s against concurrency (log scale), a line per mode; drawn off screen (a notebook shows it as an image)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for mode, points in tokens_per_s.items():
        levels = sorted(points)
        axes.plot(levels, [points[level] for level in levels], marker="o", label=mode)
    axes.set_xscale("log", base=2)
    levels = sorted({level for points in tokens_per_s.values() for level in points})
    axes.set_xticks(levels, [str(level) for level in levels])
    axes.set_xlabel("concurrent requests")
    axes.set_ylabel("generated tokens/s")
    axes.set_title(title or "the load curve through the endpoint")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    return figure
