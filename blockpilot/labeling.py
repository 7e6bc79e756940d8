"""From prompt records to label rows: the per-prompt work of the labeling stage, Ray-free.

A task is (prompt record, temperature). Each user turn becomes one row (multi-turn sets continue the
conversation with the target's own answer, as DFlash's benchmark does). The tasks of a batch are swept
together: their reference generations share one batched engine, turn by turn.

Failures: a prompt that cannot be labeled for a reason of its own (empty, longer than the target's context,
unreadable in its source, a generation with no cycle) still yields its rows, with `error` and `error_kind`
set, so that the job goes on, the summary counts it and a rerun does not retry it. Out of memory on a batch
retries its prompts one at a time; a prompt that is out of memory alone gets an `oom` error row. A failure of the
device (a device assert, a driver error) is raised as `DeviceFailure`: the labeling actor exits, Ray restarts it
and retries its batch, and nothing of it is recorded as done.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from blockpilot.checks import check_fits_context, distinct_block_sizes, distinct_tree_budgets, positive_int
from blockpilot.data.labels import ANCHOR_TOP_K, LABEL_SCHEMA, label_key
from blockpilot.data.sources import PromptRecord
from blockpilot.decoding.compiled import COMPILE_MODES, compile_mode
from blockpilot.decoding.engine import COMPILE_HELP
from blockpilot.decoding.rows import is_device_failure as engine_device_failure
from blockpilot.options import block_size_list, option, positive_int_arg, temperature_list, tree_budget_list
from blockpilot.predictor.inputs import DENSE_COLUMN, prefill_columns
from blockpilot.sweep import SWEEP_MODES

if TYPE_CHECKING:
    from blockpilot.models.loading import SpeculativeModels
    from blockpilot.sweep import PromptSweep


@dataclass(frozen=True)
class LabelSettings:
    """How every row of a label set is measured (part of the output folder's fingerprint)."""

    candidates: tuple[int, ...] | None = option(
        None,
        type=block_size_list,
        help="block sizes, e.g. 1,6,7,8,9,10 (default: 1, autoregression, and B-2..B+2 around the drafter's training "
        "block size B)",
    )
    tree_budgets: tuple[int, ...] = option(
        (7, 15, 31, 63),
        type=tree_budget_list,
        help="draft-tree budgets in nodes whose commits the tables keep too, trees as deep as the largest candidate "
        "(2^k - 1 nodes and the root fill a verify's bucket; replay only; none: no trees)",
    )
    temperatures: tuple[float, ...] = option((0.0,), type=temperature_list, help="e.g. 0,1")
    mode: str = option("replay", choices=SWEEP_MODES, help="replay: acceptance tables; live: one run per b")
    max_new_tokens: int = option(128, type=positive_int_arg, help="tokens generated per prompt")
    top_k: int = option(32, type=positive_int_arg, help="prefill distribution entries stored")
    dense: bool = option(False, help="also store the whole prefill distribution (fp16)")
    seed: int = option(0, type=int, help="base seed of every (prompt, temperature) task")
    samples: int = option(
        1, type=positive_int_arg, help="at T > 0, generations pooled per row (tau becomes a mean over them)"
    )
    compile: str = option("auto", choices=COMPILE_MODES, help="the engine's cycle: " + COMPILE_HELP)

    def __post_init__(self) -> None:
        if self.candidates is not None:
            object.__setattr__(self, "candidates", distinct_block_sizes(self.candidates))
        object.__setattr__(self, "tree_budgets", distinct_tree_budgets(self.tree_budgets))
        if not self.temperatures:
            raise ValueError("temperatures is empty: expected at least one")
        for t in self.temperatures:
            if isinstance(t, bool) or not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                raise ValueError(f"temperatures must be finite numbers >= 0, got {t!r}")
        positive_int(self.top_k, "top_k")
        positive_int(self.max_new_tokens, "max_new_tokens")
        positive_int(self.samples, "samples")
        if self.mode not in SWEEP_MODES:
            raise ValueError(f"mode must be one of {SWEEP_MODES}, got {self.mode!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs' rows comparable: everything but the temperatures (more may be added later) and how the
        cycle runs (compiled or not, the same tokens)."""
        from blockpilot.blocks import LABEL_CANDIDATES_RULE

        settings = {k: v for k, v in asdict(self).items() if k not in ("temperatures", "compile")}
        return settings | {"candidates": self.candidates or LABEL_CANDIDATES_RULE}


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
    """This prompt cannot be labeled; the reason goes into the row's `error`, its kind into `error_kind`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class DeviceFailure(RuntimeError):
    """The device failed (not the prompt, not memory): the process must restart before it labels again."""


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def is_device_failure(error: BaseException) -> bool:
    """A failure of the device rather than of the prompt or of memory: a restart and a retry, never an error row."""
    return isinstance(error, DeviceFailure) or engine_device_failure(error)


def _free_device_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class _Turn:
    """One row in the making: its task, its turn, the conversation so far."""

    record: PromptRecord
    temperature: float
    turn: int
    base: dict[str, Any]
    messages: list[dict[str, str]]
    rows: list[dict[str, Any]]  # the task's rows, shared by its turns


# The longest prompt a label row may have: the engine's rows hold it and max_new_tokens.
LABEL_PROMPT_TOKENS = 2048


def label_prompt_limit(context: int | None, max_new_tokens: int) -> int:
    """The longest prompt a label row may have beside `max_new_tokens` in a target's context (None: unbounded);
    ValueError when the context leaves no room for a prompt (checked before any row is written)."""
    if context is not None and max_new_tokens >= context:
        raise ValueError(
            f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the target's context of {context} "
            "positions: ask for fewer new tokens"
        )
    return min(LABEL_PROMPT_TOKENS, context - max_new_tokens) if context else LABEL_PROMPT_TOKENS


@dataclass
class Labeler:
    """Labels tasks with one set of loaded models."""

    models: SpeculativeModels
    settings: LabelSettings
    max_batch: int = 8  # reference generations run together
    candidates: tuple[int, ...] = field(init=False)
    prompt_limit: int = field(init=False, default=LABEL_PROMPT_TOKENS)
    engine: Any = field(init=False, default=None)  # the engine of the reference generations

    def __post_init__(self) -> None:
        from blockpilot.blocks import label_candidates
        from blockpilot.sweep import SweepConfig

        if self.models.drafter is None:
            raise ValueError("labeling needs a drafter")
        self.candidates = self.settings.candidates or label_candidates(self.models.train_block_size)
        SweepConfig(candidates=self.candidates, mode=self.settings.mode)  # validate early, before any prompt
        if self.settings.mode == "replay":
            self.engine = self._reference_engine()

    def _reference_engine(self) -> Any:
        """The engine of the replay's reference generations, compiled once for every batch: its rows hold the longest
        prompt a row may have (`LABEL_PROMPT_TOKENS`, at most what the context leaves) and `max_new_tokens`. Refused
        before any row is written when the context leaves no room for a prompt."""
        from blockpilot.decoding.engine import Engine, keep_compiled_kernels

        new_tokens = self.settings.max_new_tokens
        context = getattr(self.models.target.config.get_text_config(), "max_position_embeddings", None)
        self.prompt_limit = label_prompt_limit(context, new_tokens)
        reach = max(max(self.candidates), max(self.settings.tree_budgets, default=0) + 1)
        keep_compiled_kernels()
        compiled = compile_mode(self.settings.compile, self.models.device) != "off"
        return Engine(
            self.models,
            max_batch=self.max_batch,
            width=max(self.candidates),
            capacity=self.prompt_limit + new_tokens + reach,
            compile=self.settings.compile,
            record=True,
            # Batch work: a batch's last rows run at its full rows, so the cycle compiles once a span, not once a
            # row count too (4 shapes to 1 on the tiny zoo's labels, about 20 s each on a CPU).
            row_buckets=(self.max_batch,) if compiled else None,
            # Its rows share b: only a batch's last cycles, rows gone, would pack, each count of rows left a compile.
            pack_rows=False,
        )

    def label(self, record: PromptRecord, temperature: float) -> list[dict[str, Any]]:
        """The rows of one task: one per turn; after a failed turn, the later turns carry the error too."""
        return self.label_many([(record, temperature)])[0]

    def label_many(self, tasks: Sequence[tuple[PromptRecord, float]]) -> list[list[dict[str, Any]]]:
        """The rows of each task; the tasks' turns are swept together, turn by turn."""
        out: list[list[dict[str, Any]]] = [[] for _ in tasks]
        alive = []
        for index, (record, temperature) in enumerate(tasks):
            if record.error:
                alive.append(None)
                out[index] = [
                    {**self._base_row(record, pid, k, text, temperature), "error": record.error, "error_kind": "source"}
                    for k, (pid, text) in enumerate(zip(turn_ids(record), record.turns or ("",), strict=True))
                ]
            else:
                alive.append([])
        depth = max((len(record.turns or ("",)) for record, _ in tasks), default=0)
        for turn in range(depth):
            pending: list[tuple[int, _Turn, list[int]]] = []
            for index, (record, temperature) in enumerate(tasks):
                turns = record.turns or ("",)
                if alive[index] is None or turn >= len(turns):
                    continue
                text = turns[turn]
                base = self._base_row(record, turn_ids(record)[turn], turn, text, temperature)
                failed = next((r["error"] for r in out[index] if r.get("error")), None)
                if failed is not None:
                    out[index].append({**base, "error": f"an earlier turn failed: {failed}", "error_kind": "source"})
                    continue
                alive[index].append({"role": "user", "content": text})
                try:
                    prompt_ids = self._prompt_ids(text, alive[index])
                except PromptError as failure:
                    out[index].append({**base, "error": str(failure), "error_kind": failure.kind})
                    continue
                pending.append((index, _Turn(record, temperature, turn, base, alive[index], out[index]), prompt_ids))
            for (index, item, _), (row, answer) in zip(pending, self._measure([(t, p) for _, t, p in pending]), strict=True):
                out[index].append(row)
                if answer is not None:
                    alive[index].append({"role": "assistant", "content": answer})
        return out

    def _prompt_ids(self, text: str, messages: list[dict[str, str]]) -> list[int]:
        if not text.strip():
            raise PromptError("empty", "empty prompt")
        prompt_ids = self.models.encode_prompt(messages)
        context = getattr(self.models.target.config, "max_position_embeddings", None)
        try:
            check_fits_context(len(prompt_ids), self.settings.max_new_tokens, context)
        except ValueError as error:
            raise PromptError("too_long", str(error)) from None
        if self.engine is not None and len(prompt_ids) > self.prompt_limit:
            raise PromptError(
                "too_long", f"prompt of {len(prompt_ids)} tokens: labeling holds prompts of at most {self.prompt_limit}"
            )
        return prompt_ids

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

    def _measure(self, items: Sequence[tuple[_Turn, list[int]]]) -> list[tuple[dict[str, Any], str | None]]:
        """Sweep the turns (grouped by temperature: one sweep configuration each); (row, answer) per turn."""
        from blockpilot.sweep import SweepConfig, sweep_prompts

        results: list[tuple[dict[str, Any], str | None] | None] = [None] * len(items)
        for temperature in sorted({item.temperature for item, _ in items}):
            group = [i for i, (item, _) in enumerate(items) if item.temperature == temperature]
            config = SweepConfig(
                candidates=self.candidates,
                temperature=temperature,
                max_new_tokens=self.settings.max_new_tokens,
                stop_token_ids=tuple(self.models.stop_token_ids()),
                mode=self.settings.mode,
                samples=self.settings.samples,
                tree_budgets=self.settings.tree_budgets,
            )
            prompts = [items[i][1] for i in group]
            seeds = [items[i][0].base["seed"] for i in group]
            try:
                sweeps = sweep_prompts(self.models, prompts, seeds, config, max_batch=self.max_batch, engine=self.engine)
            except Exception as error:
                if is_device_failure(error):
                    raise DeviceFailure(str(error)) from error
                if is_out_of_memory(error):
                    _free_device_memory()
                # One prompt's failure (or the batch's memory) must not fail its neighbours: one by one.
                sweeps = [self._sweep_alone(prompt, seed, config) for prompt, seed in zip(prompts, seeds, strict=True)]
            for i, sweep in zip(group, sweeps, strict=True):
                results[i] = self._row(items[i][0].base, items[i][1], sweep)
        return results  # type: ignore[return-value]

    def _sweep_alone(self, prompt: list[int], seed: int, config: Any) -> PromptSweep | Exception:
        from blockpilot.sweep import sweep_prompts

        try:
            return sweep_prompts(self.models, [prompt], [seed], config, max_batch=1, engine=self.engine)[0]
        except Exception as error:
            if is_device_failure(error):
                raise DeviceFailure(str(error)) from error
            if is_out_of_memory(error):
                _free_device_memory()
                return PromptError("oom", f"out of memory even alone: {error}")
            return error

    def _row(
        self, base: dict[str, Any], prompt_ids: list[int], sweep: PromptSweep | Exception
    ) -> tuple[dict[str, Any], str | None]:
        from blockpilot.table import table_columns

        if isinstance(sweep, PromptError):
            return {**base, "error": str(sweep), "error_kind": sweep.kind}, None
        if isinstance(sweep, Exception):
            return {**base, "error": f"{type(sweep).__name__}: {sweep}", "error_kind": "exception"}, None
        if not any(sweep.cycles):
            message = "the generation ended at its first token: no draft/verify cycle to measure"
            return {**base, "error": message, "error_kind": "no_cycle"}, None
        inputs = prefill_columns(sweep.prefill, self.settings.top_k, self.settings.dense)
        row = {
            **base,
            "prompt_tokens": len(prompt_ids),
            "tau": sweep.tau,
            "new_tokens": sweep.new_tokens,
            "cycles": sweep.cycles,
            "tree_tau": sweep.tree_tau,
            "tree_cycles": sweep.tree_cycles,
            "best_block_size": sweep.best_block_size,
            **table_columns(sweep.tables),
            "anchor_entropy": None if sweep.anchor_entropy is None else sweep.anchor_entropy.tolist(),
            "anchor_top_probs": None if sweep.anchor_top_probs is None else sweep.anchor_top_probs[:, :ANCHOR_TOP_K].tolist(),
            "topk_ids": inputs["topk_ids"].tolist(),
            "topk_probs": inputs["topk_probs"].tolist(),
            "entropy": inputs["entropy"],
            "vocab_size": int(sweep.prefill.next_token_logits.shape[-1]),
            DENSE_COLUMN: None if inputs[DENSE_COLUMN] is None else inputs[DENSE_COLUMN].tolist(),
        }
        tokenizer = self.models.tokenizer
        answer = tokenizer.decode(sweep.token_ids, skip_special_tokens=True) if tokenizer else ""
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
    already_labeled: int = 0  # rows present when the job started
    error_examples: list[str] = field(default_factory=list)
    # Fixed B, best fixed b, static and per-step oracle, in tau and modeled throughput (`scoring.headroom`).
    headroom: dict[str, float] | None = None

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
        if self.headroom:
            from blockpilot.scoring import format_metrics

            lines.append(format_metrics("what b (and trees) can gain on these labels", self.headroom, prediction=False))
        return "\n".join(lines)


SUMMARY_COLUMNS = ("prompt_id", "candidates", "tau", "best_block_size", "error")


def summarize(rows: Iterable[dict[str, Any]], new_rows: int, seconds: float, already_labeled: int = 0) -> LabelSummary:
    """Counts, mean tau per candidate and the B* histogram of label rows (only `SUMMARY_COLUMNS` are read)."""
    from blockpilot.checks import mean_or_nan

    rows = list(rows)
    good = [r for r in rows if not r.get("error")]
    candidates = sorted({b for r in good for b in r["candidates"]})
    mean_tau = {
        b: mean_or_nan(
            t for r in good for c, t in zip(r["candidates"], r["tau"], strict=True) if c == b and not math.isnan(t)
        )
        for b in candidates
    }
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
        already_labeled=already_labeled,
        error_examples=[f"{r['prompt_id']}: {r['error']}" for r in errors[:5]],
    )


HEADROOM_COLUMNS = (
    "prompt_id",
    "source",
    "temperature",
    "train_block_size",
    "candidates",
    "tau",
    "cycles",
    "table_commits",
    "table_anchors",
    "tree_budgets",
    "tree_tau",
    "tree_cycles",
    "max_new_tokens",
    "error",
)


def label_headroom(path: Any, cost: Any = None) -> dict[str, float] | None:
    """`scoring.headroom` of the label rows under `path` that carry acceptance tables (None when none do)."""
    import pyarrow.compute as pc

    from blockpilot.data.labels import read_labels
    from blockpilot.scoring import headroom, label_arrays

    table = read_labels(path, columns=HEADROOM_COLUMNS)
    table = table.filter(pc.and_(pc.is_null(table["error"]), pc.is_valid(table["table_commits"])))
    if table.num_rows == 0 or len({tuple(c) for c in table["candidates"].to_pylist()}) != 1:
        return None
    return headroom(label_arrays(table, cost=cost, inputs=False))
