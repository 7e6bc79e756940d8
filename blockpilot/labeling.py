"""From prompt records to label rows: the per-prompt work of the labeling stage, Ray-free.

A task is (prompt record, temperature). Each user turn becomes one row (multi-turn sets continue the
conversation with the target's own answer, as DFlash's benchmark does). A prompt that cannot be labeled
(empty, longer than the target's context, undecodable, a failure inside the sweep) still yields its
rows, with `error` set, so that the job goes on, the summary counts it and a rerun does not retry it.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from blockpilot.data.labels import LABEL_SCHEMA, label_key
from blockpilot.data.sources import PromptRecord

if TYPE_CHECKING:  # torch-heavy; imported where used so that the command line starts fast
    from blockpilot.models.loading import SpeculativeModels
    from blockpilot.sweep import SweepMode


@dataclass(frozen=True)
class LabelSettings:
    candidates: tuple[int, ...] | None = None  # None: B-2..B+2 around the drafter's training block size
    temperatures: tuple[float, ...] = (0.0,)
    mode: SweepMode = "replay"  # or "live"
    max_new_tokens: int = 128
    top_k: int = 32
    dense: bool = False  # also store the whole prefill distribution (fp16)
    seed: int = 0
    samples: int = 1  # generations pooled per row at T > 0 (a row's tau is then a mean over them)

    def __post_init__(self) -> None:
        if not self.temperatures:
            raise ValueError("temperatures is empty: expected at least one")
        for t in self.temperatures:
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                raise ValueError(f"temperatures must be finite numbers >= 0, got {t!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.mode not in ("replay", "live"):
            raise ValueError(f"mode must be 'replay' or 'live', got {self.mode!r}")


def task_seed(base_seed: int, prompt_id: str, temperature: float) -> int:
    """A seed per (prompt, temperature), stable across runs and machines, so a row can be reproduced."""
    digest = hashlib.sha256(f"{base_seed}:{prompt_id}:{float(temperature):.4f}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def turn_ids(record: PromptRecord) -> list[str]:
    """The prompt ids of a record's rows: the record id, or `<id>#t<k>` per turn of a multi-turn record."""
    if len(record.turns) <= 1:
        return [record.id]
    return [f"{record.id}#t{k}" for k in range(len(record.turns))]


def task_keys(record: PromptRecord, temperature: float) -> list[tuple[str, float]]:
    return [label_key(prompt_id, temperature) for prompt_id in turn_ids(record)]


class PromptError(ValueError):
    """This prompt cannot be labeled; the reason goes into the row's `error`."""


@dataclass
class Labeler:
    """Labels tasks with one set of loaded models."""

    models: SpeculativeModels
    settings: LabelSettings
    candidates: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        from blockpilot.sweep import SweepConfig, default_candidates

        if self.models.drafter is None:
            raise ValueError("labeling needs a drafter")
        self.candidates = tuple(sorted(self.settings.candidates or default_candidates(self.models.train_block_size)))
        SweepConfig(candidates=self.candidates, mode=self.settings.mode)  # validate early, before any prompt

    def _check(self, record: PromptRecord, text: str, prompt_ids: Sequence[int]) -> None:
        if record.error:
            raise PromptError(record.error)
        if not text.strip():
            raise PromptError("empty prompt")
        context = getattr(self.models.target.config, "max_position_embeddings", None)
        needed = len(prompt_ids) + self.settings.max_new_tokens
        if context is not None and needed > context:
            raise PromptError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens={self.settings.max_new_tokens} exceeds the "
                f"target's context of {context} positions"
            )

    def label(self, record: PromptRecord, temperature: float) -> list[dict[str, Any]]:
        """The rows of one task: one per turn; after a failed turn, the later turns carry the error too."""
        rows: list[dict[str, Any]] = []
        messages: list[dict[str, str]] = []
        error: str | None = None
        turns = record.turns or ("",)
        for turn, (prompt_id, text) in enumerate(zip(turn_ids(record), turns, strict=True)):
            base = self._base_row(record, prompt_id, turn, text, temperature)
            if error is not None:
                rows.append({**base, "error": f"an earlier turn failed: {error}"})
                continue
            messages.append({"role": "user", "content": text})
            try:
                prompt_ids = self.models.encode_prompt(messages) if text.strip() else []
                self._check(record, text, prompt_ids)
                row, answer = self._measure(prompt_ids, base)
                rows.append(row)
                messages.append({"role": "assistant", "content": answer})
            except PromptError as failure:
                error = str(failure)
                rows.append({**base, "error": error})
            except Exception as failure:  # a failure on one prompt must not end the job
                error = f"{type(failure).__name__}: {failure}"
                rows.append({**base, "error": error})
        return rows

    def _base_row(self, record: PromptRecord, prompt_id: str, turn: int, text: str, temperature: float) -> dict:
        """Every column of the schema, measured ones still null."""
        return {
            **dict.fromkeys(LABEL_SCHEMA.names),
            "prompt_id": prompt_id,
            "source": record.source,
            "prompt": text,
            "turn": turn,
            "temperature": float(temperature),
            "seed": task_seed(self.settings.seed, prompt_id, temperature),
            "samples": self.settings.samples if temperature > 0 else 1,
            "train_block_size": self.models.train_block_size,
            "candidates": list(self.candidates),
            "target_id": self.models.target_id,
            "drafter_id": self.models.drafter_id,
            "sweep_mode": self.settings.mode,
            "max_new_tokens": self.settings.max_new_tokens,
        }

    def _measure(self, prompt_ids: list[int], base: dict[str, Any]) -> tuple[dict[str, Any], str]:
        from blockpilot.sweep import SweepConfig, sweep_prompt

        config = SweepConfig(
            candidates=self.candidates,
            temperature=base["temperature"],
            max_new_tokens=self.settings.max_new_tokens,
            stop_token_ids=tuple(self.models.stop_token_ids()),
            seed=base["seed"],
            mode=self.settings.mode,
            samples=base["samples"],
        )
        sweep = sweep_prompt(self.models, prompt_ids, config)
        if not any(sweep.cycles):
            raise PromptError("the generation ended at its first token: no draft/verify cycle to measure")
        ids, probs = sweep.prefill.top_k(self.settings.top_k)
        row = {
            **base,
            "prompt_tokens": len(prompt_ids),
            "tau": sweep.tau,
            "new_tokens": sweep.new_tokens,
            "cycles": sweep.cycles,
            "best_block_size": sweep.best_block_size,
            "topk_ids": ids.tolist(),
            "topk_probs": probs.tolist(),
            "entropy": sweep.prefill.entropy,
            "vocab_size": int(sweep.prefill.probs.shape[-1]),
            "probs_fp16": sweep.prefill.probs.half().tolist() if self.settings.dense else None,
        }
        answer = (
            self.models.tokenizer.decode(sweep.token_ids, skip_special_tokens=True) if self.models.tokenizer else ""
        )
        return row, answer


@dataclass
class LabelSummary:
    rows: int
    errors: int
    new_rows: int
    seconds: float
    candidates: list[int]
    mean_tau: dict[int, float]
    best_block_size_histogram: dict[int, int]
    error_examples: list[str] = field(default_factory=list)

    @property
    def prompts_per_s(self) -> float:
        return self.new_rows / self.seconds if self.seconds > 0 else math.nan

    def format(self) -> str:
        lines = [
            f"rows: {self.rows} ({self.new_rows} new, {self.errors} with errors)",
            f"throughput: {self.prompts_per_s:.2f} prompts/s over {self.seconds:.1f} s",
            "mean tau per candidate: " + ", ".join(f"b={b}: {t:.3f}" for b, t in self.mean_tau.items()),
            "B* histogram: " + ", ".join(f"b={b}: {n}" for b, n in self.best_block_size_histogram.items()),
        ]
        lines += [f"error: {example}" for example in self.error_examples]
        return "\n".join(lines)


def summarize(rows: Iterable[dict[str, Any]], new_rows: int, seconds: float) -> LabelSummary:
    rows = list(rows)
    good = [r for r in rows if not r.get("error")]
    candidates = sorted({b for r in good for b in r["candidates"]})
    mean_tau = {}
    for b in candidates:
        values = [
            t for r in good for c, t in zip(r["candidates"], r["tau"], strict=True) if c == b and not math.isnan(t)
        ]
        mean_tau[b] = sum(values) / len(values) if values else math.nan
    histogram = Counter(r["best_block_size"] for r in good)
    errors = [r for r in rows if r.get("error")]
    return LabelSummary(
        rows=len(rows),
        errors=len(errors),
        new_rows=new_rows,
        seconds=seconds,
        candidates=candidates,
        mean_tau=mean_tau,
        best_block_size_histogram={b: histogram.get(b, 0) for b in candidates},
        error_examples=[f"{r['prompt_id']}: {r['error']}" for r in errors[:5]],
    )
