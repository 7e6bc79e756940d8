"""Prompt sources: the paper's benchmark sets (through `datasets.load_dataset`), and local files.

A source spec is one of:

* a registry name: gsm8k, math500, aime24, humaneval, mbpp, swe-bench, mt-bench, sharegpt, wsc, copa,
  alpaca (each with its hub id, split and prompt format);
* `jsonl:PATH` (rows with `prompt` or `turns`, optional `id` and `source`), `txt:PATH` (a prompt a line),
  `parquet:PATH` (columns as jsonl);
* `zoo:DIR` (the zoo's `prompts/train.jsonl`), `zoo:DIR:heldout`, or `zoo:DIR:corpus`: the prompts of the
  target's training texts (the zoo's `corpus.json`; thousands, none of them held out), for labels beyond the
  train split's few hundred.

Several specs may be joined with commas. With no hub reachable, a registry set loads from the HF cache,
or from `$BLOCKPILOT_DATASETS_DIR/<name>.jsonl` (or `.parquet`): a local copy shaped like the hub's rows.

Every prompt gets a stable, unique id: `<source>:<row id>` where the data has ids, else (registry sets) the
row index, and (files) a digest of the prompt's text, so that editing a file does not shift the ids of the
prompts after the edit (a prompt repeated in one file is one record). Multi-turn prompts are one record with
several user turns.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockpilot.checks import positive_int

DATASETS_DIR_ENV = "BLOCKPILOT_DATASETS_DIR"

REASONING_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: user turns (one, or several for multi-turn sets); `error` marks a prompt that cannot be used."""

    id: str
    source: str
    turns: tuple[str, ...]
    error: str | None = None


@dataclass(frozen=True)
class HubDataset:
    """A benchmark set on the hub and how its rows become prompts."""

    path: str
    split: str
    format: Callable[[dict[str, Any]], list[str]]  # row -> user turns
    config: str | None = None
    id_field: str | None = None  # a stable row id in the data; else the row index
    description: str = ""


def _math(field_name: str) -> Callable[[dict[str, Any]], list[str]]:
    return lambda row: [f"{row[field_name]}{REASONING_SUFFIX}"]


def _humaneval(row: dict[str, Any]) -> list[str]:
    return [
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{row['prompt']}\n```"
    ]


def _swe_bench(row: dict[str, Any]) -> list[str]:
    return [
        f"You are working in the repository {row['repo']}. Write a patch (a unified diff) that resolves this "
        f"issue:\n\n{row['problem_statement']}"
    ]


def _sharegpt(row: dict[str, Any]) -> list[str]:
    turns = [turn["value"] for turn in row["conversations"] if turn.get("from") in ("human", "user")]
    return turns[:1]


def _wsc(row: dict[str, Any]) -> list[str]:
    options = " or ".join(f"'{option}'" for option in row["options"])
    return [f"{row['text']}\nIn the sentence above, who or what does '{row['pronoun']}' refer to: {options}?"]


def _copa(row: dict[str, Any]) -> list[str]:
    relation = "cause" if row["question"] == "cause" else "effect"
    return [
        f"Premise: {row['premise']}\nWhat was the {relation}?\n"
        f"Option 1: {row['choice1']}\nOption 2: {row['choice2']}\nAnswer with the better option and explain why."
    ]


def _alpaca(row: dict[str, Any]) -> list[str]:
    return [f"{row['instruction']}\n\n{row['input']}" if row.get("input") else row["instruction"]]


REGISTRY: dict[str, HubDataset] = {
    "gsm8k": HubDataset("openai/gsm8k", "test", _math("question"), config="main", description="grade-school math"),
    "math500": HubDataset("HuggingFaceH4/MATH-500", "test", _math("problem"), id_field="unique_id"),
    "aime24": HubDataset("HuggingFaceH4/aime_2024", "train", _math("problem"), id_field="id"),
    "humaneval": HubDataset("openai/openai_humaneval", "test", _humaneval, id_field="task_id"),
    "mbpp": HubDataset(
        "google-research-datasets/mbpp", "test", lambda row: [row["prompt"]], config="sanitized", id_field="task_id"
    ),
    "swe-bench": HubDataset("princeton-nlp/SWE-bench_Lite", "test", _swe_bench, id_field="instance_id"),
    "mt-bench": HubDataset(
        "HuggingFaceH4/mt_bench_prompts",
        "train",
        lambda row: list(row["prompt"]),
        id_field="prompt_id",
        description="multi-turn",
    ),
    "sharegpt": HubDataset("Aeala/ShareGPT_Vicuna_unfiltered", "train", _sharegpt, id_field="id"),
    "wsc": HubDataset("ErnestSDavis/winograd_wsc", "test", _wsc, config="wsc273"),
    "copa": HubDataset("pkavumba/balanced-copa", "test", _copa, id_field="id"),
    "alpaca": HubDataset("tatsu-lab/alpaca", "train", _alpaca),
}


def _local_copy(name: str) -> Path | None:
    folder = os.environ.get(DATASETS_DIR_ENV)
    if not folder:
        return None
    for suffix in (".jsonl", ".json", ".parquet"):
        candidate = Path(folder) / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def load_hub_rows(name: str) -> Iterable[dict[str, Any]]:
    """Rows of a registry set via `datasets.load_dataset`: the local copy when one is configured, else the hub
    (or the HF cache when offline)."""
    import datasets

    spec = REGISTRY[name]
    local = _local_copy(name)
    if local is not None:
        kind = "parquet" if local.suffix == ".parquet" else "json"
        return datasets.load_dataset(kind, data_files=str(local), split="train")
    try:
        return datasets.load_dataset(spec.path, spec.config, split=spec.split)
    except Exception as error:  # offline, missing from the cache, renamed upstream ...
        raise FileNotFoundError(
            f"prompt source {name!r}: could not load {spec.path} ({spec.split}) with datasets.load_dataset: {error}. "
            f"Without a hub, put a copy of its rows at ${DATASETS_DIR_ENV}/{name}.jsonl"
        ) from error


def _registry_records(name: str) -> list[PromptRecord]:
    spec = REGISTRY[name]
    records = []
    for index, row in enumerate(load_hub_rows(name)):
        row_id = row.get(spec.id_field) if spec.id_field else None
        key = f"{name}:{row_id if row_id is not None else index}"
        try:
            turns = tuple(str(turn) for turn in spec.format(row))
        except (KeyError, TypeError) as error:
            records.append(PromptRecord(key, name, (), f"row {index} does not have the {name} fields: {error!r}"))
            continue
        records.append(PromptRecord(key, name, turns))
    return records


def content_id(turns: tuple[str, ...]) -> str:
    """A short digest of a prompt's turns: its id in a file without ids."""
    return hashlib.sha256(json.dumps(list(turns)).encode()).hexdigest()[:12]


def _row_record(row: dict[str, Any], index: int, default_source: str) -> PromptRecord:
    source = str(row.get("source") or default_source)
    if "turns" in row and row["turns"] is not None:
        turns = tuple(str(t) for t in row["turns"])
    elif "prompt" in row and row["prompt"] is not None:
        turns = (str(row["prompt"]),)
    else:
        return PromptRecord(f"{default_source}:row{index + 1}", source, (), f"row {index + 1} has neither 'prompt' nor 'turns'")
    key = f"{default_source}:{row['id'] if row.get('id') is not None else content_id(turns)}"
    return PromptRecord(key, source, turns)


def _unique(records: list[PromptRecord]) -> list[PromptRecord]:
    """A prompt repeated in one file (same id) is labeled once."""
    seen: set[str] = set()
    out = []
    for record in records:
        if record.id not in seen:
            seen.add(record.id)
            out.append(record)
    return out


def _jsonl_records(path: Path, source: str) -> list[PromptRecord]:
    records = []
    for index, line in enumerate(path.read_bytes().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            records.append(PromptRecord(f"{source}:line{index + 1}", source, (), f"line {index + 1}: {error}"))
            continue
        records.append(_row_record(row if isinstance(row, dict) else {"prompt": row}, index, source))
    return _unique(records)


def _txt_records(path: Path, source: str) -> list[PromptRecord]:
    records = []
    for index, raw in enumerate(path.read_bytes().splitlines()):
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as error:
            records.append(PromptRecord(f"{source}:line{index + 1}", source, (), f"line {index + 1} is not valid UTF-8: {error}"))
            continue
        if text:
            records.append(PromptRecord(f"{source}:{content_id((text,))}", source, (text,)))
    return _unique(records)


def _parquet_records(path: Path, source: str) -> list[PromptRecord]:
    import pyarrow.parquet as pq

    return _unique([_row_record(row, i, source) for i, row in enumerate(pq.read_table(path).to_pylist())])


def _file(spec: str, text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt source {spec!r}: file {str(path)!r} does not exist")
    return path


ZOO_SPLITS = ("train", "heldout", "corpus")
ZOO_SPLITS_SUFFIXES = tuple(f":{split}" for split in ZOO_SPLITS)
# The part of a zoo's corpus.json the target is trained on: examples with an id, a source and a prompt.
ZOO_CORPUS_PART = "lm"


def zoo_prompt_file(zoo: Path, split: str) -> Path:
    """Where a zoo (`blockpilot zoo build`) keeps the prompts of one split."""
    if split not in ZOO_SPLITS:
        raise ValueError(f"a zoo's prompt split is one of {ZOO_SPLITS}, got {split!r}")
    return zoo / "corpus.json" if split == "corpus" else zoo / "prompts" / f"{split}.jsonl"


def zoo_prompts(zoo: Path, split: str = "train") -> list[PromptRecord]:
    """A zoo's prompts of one split, each with its task family as `source` (what `zoo:DIR[:split]` loads)."""
    path = zoo_prompt_file(zoo, split)
    if split != "corpus":
        return _jsonl_records(path, f"zoo-{split}")
    examples = json.loads(path.read_text()).get(ZOO_CORPUS_PART)
    if not isinstance(examples, list):
        raise ValueError(f"{str(path)!r} has no list {ZOO_CORPUS_PART!r} of training examples")
    rows = [{key: example.get(key) for key in ("id", "source", "prompt")} for example in examples]
    return _unique([_row_record(row, index, "zoo-corpus") for index, row in enumerate(rows)])


def load_prompt_source(spec: str) -> list[PromptRecord]:
    """The records of one source spec (see the module docstring)."""
    spec = spec.strip()
    kind, _, rest = spec.partition(":")
    if kind in REGISTRY and not rest:
        return _registry_records(kind)
    if kind == "jsonl" and rest:
        path = _file(spec, rest)
        return _jsonl_records(path, path.stem)
    if kind == "txt" and rest:
        path = _file(spec, rest)
        return _txt_records(path, path.stem)
    if kind == "parquet" and rest:
        path = _file(spec, rest)
        return _parquet_records(path, path.stem)
    if kind == "zoo" and rest:
        folder, _, split = rest.rpartition(":") if rest.endswith(ZOO_SPLITS_SUFFIXES) else (rest, "", "train")
        zoo = Path(folder).expanduser()
        _file(spec, str(zoo_prompt_file(zoo, split)))  # names the spec when the zoo has no such file
        return zoo_prompts(zoo, split)
    raise ValueError(
        f"unknown prompt source {spec!r}: expected one of {sorted(REGISTRY)}, or jsonl:PATH, txt:PATH, "
        "parquet:PATH, zoo:DIR[:train|heldout|corpus]"
    )


def load_prompts(specs: str | Iterable[str], limit: int | None = None) -> list[PromptRecord]:
    """Records of every spec (comma-separated or a list), in order, ids unique; `limit` per source."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    specs = list(specs)
    if not specs:
        raise ValueError("no prompt source given")
    if limit is not None:
        positive_int(limit, "limit")
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for spec in specs:
        for record in load_prompt_source(spec)[:limit]:
            if record.id in seen:
                raise ValueError(f"prompt id {record.id!r} appears twice; ids must be unique across sources")
            seen.add(record.id)
            records.append(record)
    return records


def prompt_texts(specs: str | Iterable[str], limit: int | None = None) -> list[str]:
    """The first user turn of every usable prompt of `specs` (records that carry an error left out): what one
    generation, a calibration or a benchmark prompts the target with."""
    return [record.turns[0] for record in load_prompts(specs, limit) if record.error is None and record.turns]
