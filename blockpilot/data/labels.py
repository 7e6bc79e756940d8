"""The label schema (one Parquet row per (prompt, turn, temperature)), and reading labels back.

Columns (lists follow `candidates`):

    prompt_id, source, prompt, turn           which prompt (`prompt_id` is stable and unique)
    prompt_tokens, temperature, seed          the generation it was measured on (seeds seed, seed+1, ...
    samples                                   when `samples` > 1 runs are pooled at T > 0)
    train_block_size, candidates, tau         B, the swept b, mean acceptance length per b
    new_tokens, cycles                        per b: output tokens and draft/verify cycles
    best_block_size                           B* = argmax tau, ties to the smaller b
    table_commits, table_anchors              the acceptance table a(i, b) (replay sweeps): per candidate,
                                              the commits at every cursor of every sample, concatenated;
                                              the cursors per sample (see `blockpilot.table`)
    table_tokens                              every sample's generated sequence g_0..g_{n-1} concatenated
                                              (n = its cursors + 1): each cursor's block's first token
    table_confidences                         the drafter's top probability in every slot of the largest
                                              candidate D's block at every cursor of every sample: cursors x
                                              (D - 1) values per sample, row-major, NaN in the slots of a block
                                              cut to the generation budget (what draft-then-trim decides with)
    tree_budgets, table_tree_commits          draft trees (`blockpilot.table`): the budgets in drafted nodes, and
                                              per budget t(i, N) at every cursor of every sample, concatenated
                                              (trees as deep as the largest candidate)
    tree_tau, tree_cycles                     per tree budget: mean acceptance length and cycles of its walks
    anchor_entropy, anchor_top_probs          per cursor of the table, the target distribution at the
                                              anchor (T = 1): entropy in nats and top-k probabilities
    topk_ids, topk_probs, entropy             the prefill distribution (T = 1), top k + entropy in nats
    vocab_size                                its width (the target head's rows)
    probs_fp16                                the whole distribution, fp16, when asked for (else null)
    target_id, drafter_id, sweep_mode, max_new_tokens
    error, error_kind                         null, or why this prompt has no label (the row is kept) and
                                              what kind of failure that is (empty, too_long, source, no_cycle,
                                              oom, exception)

Keeping the table lets a label objective (max tau, or tau(b) / c(b)) or a walk (per-step choices) change
without relabeling.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa

logger = logging.getLogger(__name__)

KEY_COLUMNS = ("prompt_id", "temperature")

# Top probabilities of the target's distribution at each anchor that a label row keeps (`anchor_top_probs`).
ANCHOR_TOP_K = 4

# The version of the label schema, kept in every label file's Parquet metadata. Raise it when a column is added or
# changes meaning; a file of another version is refused with what to rerun, never read in part.
# 1: the acceptance table with sequences and confidences. 2: draft trees (tree_budgets, table_tree_commits, tree_tau,
# tree_cycles).
LABEL_SCHEMA_VERSION = 2
_VERSION_KEY = b"blockpilot.label_schema_version"

LABEL_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("source", pa.string()),
        pa.field("prompt", pa.string()),
        pa.field("turn", pa.int32()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("temperature", pa.float32(), nullable=False),
        pa.field("seed", pa.int64()),
        pa.field("samples", pa.int32()),
        pa.field("train_block_size", pa.int32()),
        pa.field("candidates", pa.list_(pa.int32())),
        pa.field("tau", pa.list_(pa.float32())),
        pa.field("new_tokens", pa.list_(pa.int32())),
        pa.field("cycles", pa.list_(pa.int32())),
        pa.field("best_block_size", pa.int32()),
        pa.field("table_commits", pa.list_(pa.list_(pa.int16()))),
        pa.field("table_anchors", pa.list_(pa.int32())),
        pa.field("table_tokens", pa.list_(pa.int32())),
        pa.field("table_confidences", pa.list_(pa.float32())),
        pa.field("tree_budgets", pa.list_(pa.int32())),
        pa.field("table_tree_commits", pa.list_(pa.list_(pa.int16()))),
        pa.field("tree_tau", pa.list_(pa.float32())),
        pa.field("tree_cycles", pa.list_(pa.int32())),
        pa.field("anchor_entropy", pa.list_(pa.float16())),
        pa.field("anchor_top_probs", pa.list_(pa.list_(pa.float16()))),
        pa.field("topk_ids", pa.list_(pa.int32())),
        pa.field("topk_probs", pa.list_(pa.float32())),
        pa.field("entropy", pa.float32()),
        pa.field("vocab_size", pa.int32()),
        pa.field("probs_fp16", pa.list_(pa.float16())),
        pa.field("target_id", pa.string()),
        pa.field("drafter_id", pa.string()),
        pa.field("sweep_mode", pa.string()),
        pa.field("max_new_tokens", pa.int32()),
        pa.field("error", pa.string()),
        pa.field("error_kind", pa.string()),
    ],
    metadata={_VERSION_KEY: str(LABEL_SCHEMA_VERSION).encode()},
)


_HALF_COLUMNS = ("probs_fp16", "anchor_entropy")


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Label rows (dicts with the schema's keys; missing keys are null) as a table of LABEL_SCHEMA."""
    import numpy as np

    columns = {name: [row.get(name) for row in rows] for name in LABEL_SCHEMA.names}
    for name in _HALF_COLUMNS:
        columns[name] = [None if v is None else np.asarray(v, dtype=np.float16) for v in columns[name]]
    columns["anchor_top_probs"] = [
        None if v is None else [np.asarray(p, dtype=np.float16) for p in v] for v in columns["anchor_top_probs"]
    ]
    return pa.Table.from_pydict(columns, schema=LABEL_SCHEMA)


def write_label_file(table: pa.Table, path: str | Path) -> Path:
    """Write label rows as one Parquet file whole (staged beside it, then renamed: readers never see half a file),
    with the schema's version in its metadata."""
    import os

    import pyarrow.parquet as pq

    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp")
    pq.write_table(table.cast(LABEL_SCHEMA), staging)
    os.replace(staging, path)
    return path


def check_label_version(schema: pa.Schema, file: Path) -> None:
    """Refuse a label file written under another label schema version."""
    found = (schema.metadata or {}).get(_VERSION_KEY)
    if found != str(LABEL_SCHEMA_VERSION).encode():
        version = found.decode() if found else "before versions"
        raise ValueError(
            f"{str(file)!r} holds labels of schema version {version}; this version of blockpilot reads "
            f"{LABEL_SCHEMA_VERSION}: label again into a new folder (`blockpilot label ... --out NEW`)"
        )


def label_key(prompt_id: str, temperature: float) -> tuple[str, float]:
    """The identity of a label row; temperature rounded as stored (float32)."""
    return prompt_id, round(float(temperature), 4)


def parquet_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*.parquet") if not _hidden(p.relative_to(path)))


def _hidden(relative: Path) -> bool:
    """Whether a Parquet reader skips this path inside a dataset folder: a part of it starts with "_" or "."."""
    return any(part.startswith(("_", ".")) for part in relative.parts)


def read_label_files(
    path: str | Path, columns: Iterable[str] | None = None, quarantine: bool = False
) -> tuple[pa.Table, list[Path]]:
    """Every readable label file under `path`, concatenated, and the files that could not be read.

    A job killed mid-write can leave a truncated file: it is skipped (and, when `quarantine`, renamed with a
    leading "_" that every Parquet reader skips), so that its prompts count as unlabeled and are labeled again.
    A file of another label schema version is refused (`check_label_version`).
    """
    import pyarrow.parquet as pq

    tables, broken = [], []
    for file in parquet_files(path):
        try:
            schema = pq.read_schema(file)
        except (pa.ArrowInvalid, OSError) as error:
            schema, failure = None, error
        if schema is not None:
            check_label_version(schema, file)  # raises: a whole file of another version is not damage
            try:
                tables.append(pq.read_table(file, columns=list(columns) if columns else None))
                continue
            except (pa.ArrowInvalid, OSError) as error:
                failure = error
        logger.warning("skipping unreadable label file %s: %s", file, failure)
        broken.append(file)
        if quarantine:
            file.rename(file.with_name(f"_corrupt-{file.name}"))
    if not tables:
        schema = LABEL_SCHEMA if columns is None else pa.schema([LABEL_SCHEMA.field(c) for c in columns])
        return schema.empty_table(), broken
    return pa.concat_tables(tables), broken


def labeled_keys(path: str | Path, quarantine: bool = True) -> set[tuple[str, float]]:
    """(prompt_id, temperature) of every row already written under `path`."""
    table, _ = read_label_files(path, columns=KEY_COLUMNS, quarantine=quarantine)
    return {
        label_key(p, t) for p, t in zip(table["prompt_id"].to_pylist(), table["temperature"].to_pylist(), strict=True)
    }


def deduplicate(table: pa.Table) -> pa.Table:
    """One row per (prompt_id, temperature): the first written wins."""
    seen: set[tuple[str, float]] = set()
    keep = []
    for index, (prompt_id, temperature) in enumerate(
        zip(table["prompt_id"].to_pylist(), table["temperature"].to_pylist(), strict=True)
    ):
        key = label_key(prompt_id, temperature)
        if key not in seen:
            seen.add(key)
            keep.append(index)
    return table if len(keep) == table.num_rows else table.take(keep)


def read_labels(path: str | Path, columns: Iterable[str] | None = None) -> pa.Table:
    """All labels under `path` (a file or a folder of Parquet files), one row per key; only `columns` (and the
    key columns) when given."""
    if not parquet_files(path):
        raise FileNotFoundError(f"no label Parquet files at {str(path)!r}")
    if columns is not None:
        columns = list(dict.fromkeys([*KEY_COLUMNS, *columns]))
    table, _ = read_label_files(path, columns=columns)
    return deduplicate(table)


# The columns holding one entry per candidate b, in the order of `candidates`.
PER_CANDIDATE_COLUMNS = ("candidates", "tau", "new_tokens", "cycles", "table_commits")


def with_candidates(table: pa.Table, candidates: Iterable[int]) -> pa.Table:
    """Label rows narrowed to `candidates`, a subset of the rows' own (BlockPilot's B-2..B+2 out of labels that
    also hold autoregression, say): each per-candidate column keeps those entries, `best_block_size` is B* among
    them, and `table_confidences` (of the largest candidate's block) become null where that candidate goes."""
    import numpy as np

    from blockpilot.blocks import best_block_size

    wanted = sorted({int(b) for b in candidates})
    if table.num_rows == 0:
        return table
    present = {tuple(c) for c in table["candidates"].to_pylist()}
    if len(present) != 1:
        raise ValueError(f"rows sweep different candidates: {sorted(present)}")
    labeled = present.pop()
    missing = [b for b in wanted if b not in labeled]
    if not wanted or missing:
        raise ValueError(f"candidates {wanted}: expected a subset of the labels' {list(labeled)}")
    rows, width, keep = table.num_rows, len(labeled), [labeled.index(b) for b in wanted]
    picks = pa.array((np.arange(rows)[:, None] * width + np.asarray(keep)[None, :]).ravel())
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * len(keep))
    for name in PER_CANDIDATE_COLUMNS:
        if name not in table.column_names:
            continue
        column = table[name].combine_chunks()
        if column.null_count == rows:  # rows without acceptance tables (a live sweep's)
            continue
        if column.null_count:
            raise ValueError(f"label column {name!r} is missing in {column.null_count} of {rows} rows")
        narrowed = pa.ListArray.from_arrays(offsets, column.flatten().take(picks), type=column.type)
        table = table.set_column(table.column_names.index(name), table.schema.field(name), narrowed)
    best = [best_block_size(wanted, tau) for tau in table["tau"].to_pylist()]
    index = table.column_names.index("best_block_size")
    table = table.set_column(index, table.schema.field(index), pa.array(best, type=table.schema.field(index).type))
    if max(wanted) != max(labeled) and "table_confidences" in table.column_names:
        index = table.column_names.index("table_confidences")
        field = table.schema.field(index)
        table = table.set_column(index, field, pa.nulls(rows, type=field.type))
    return table
