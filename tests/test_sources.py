"""Prompt sources: every registry set through `datasets.load_dataset` on local hub-shaped fixtures, and files."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from blockpilot.data.sources import (
    DATASETS_DIR_ENV,
    REASONING_SUFFIX,
    REGISTRY,
    content_id,
    load_prompt_source,
    load_prompts,
    prompt_texts,
)

FIXTURES = Path(__file__).parent / "fixtures" / "datasets"


@pytest.fixture
def local_datasets(monkeypatch):
    monkeypatch.setenv(DATASETS_DIR_ENV, str(FIXTURES))


EXPECTED_FIRST = {
    "gsm8k": ("gsm8k:0", "A baker makes 12 rolls an hour for 5 hours. How many rolls is that?" + REASONING_SUFFIX),
    "math500": ("math500:test/algebra/1.json", "What is $2^{10}$?" + REASONING_SUFFIX),
    "aime24": ("aime24:60", "Find the remainder when $7^{100}$ is divided by $13$." + REASONING_SUFFIX),
    "humaneval": (
        "humaneval:HumanEval/0",
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        'def add(a: int, b: int) -> int:\n    """Return a + b."""\n\n```',
    ),
    "mbpp": ("mbpp:2", "Write a function to find the shared elements from the given two lists."),
    "swe-bench": (
        "swe-bench:example__widgets-101",
        "You are working in the repository example/widgets. Write a patch (a unified diff) that resolves this "
        "issue:\n\nWidget.resize crashes when the width is zero.",
    ),
    "sharegpt": ("sharegpt:conv-1", "How do I sort a list in Python?"),
    "wsc": (
        "wsc:0",
        "The trophy doesn't fit into the suitcase because it is too large.\nIn the sentence above, who or what "
        "does 'it' refer to: 'the trophy' or 'the suitcase'?",
    ),
    "copa": (
        "copa:1",
        "Premise: The man broke his toe.\nWhat was the cause?\nOption 1: He dropped a hammer on his foot.\n"
        "Option 2: He got a hole in his sock.\nAnswer with the better option and explain why.",
    ),
    "alpaca": ("alpaca:0", "Give three tips for staying healthy."),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_FIRST))
def test_registry_sets_load_and_format(local_datasets, name):
    records = load_prompt_source(name)
    expected_id, expected_prompt = EXPECTED_FIRST[name]
    assert records[0].id == expected_id
    assert records[0].turns == (expected_prompt,)
    assert all(r.source == name and r.error is None for r in records)
    assert len({r.id for r in records}) == len(records)


def test_mt_bench_is_multi_turn(local_datasets):
    records = load_prompt_source("mt-bench")
    assert [r.id for r in records] == ["mt-bench:81", "mt-bench:82"]
    assert records[0].turns == (
        "Write a short poem about the sea.",
        "Now rewrite it so that every line starts with the letter S.",
    )


def test_alpaca_appends_the_input_and_copa_asks_for_effects(local_datasets):
    assert load_prompt_source("alpaca")[1].turns == ("Translate the sentence to French.\n\nGood morning.",)
    assert "What was the effect?" in load_prompt_source("copa")[1].turns[0]
    assert load_prompt_source("sharegpt")[1].turns == ("Name three colours.",)


def test_every_registry_entry_has_a_fixture():
    assert set(REGISTRY) == {p.stem for p in FIXTURES.glob("*.jsonl")}
    assert set(REGISTRY) == set(EXPECTED_FIRST) | {"mt-bench"}


def test_unknown_source_fails_before_anything_runs():
    with pytest.raises(ValueError, match=r"unknown prompt source 'gsm9k'.*jsonl:PATH"):
        load_prompts("gsm9k")


def test_registry_set_without_hub_or_local_copy_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv(DATASETS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match=r"gsm8k.*BLOCKPILOT_DATASETS_DIR/gsm8k.jsonl"):
        load_prompt_source("gsm8k")


def test_local_files(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"id": "x1", "prompt": "hello"})
        + "\n"
        + json.dumps({"turns": ["one", "two"]})
        + "\n"
        + json.dumps({"text": "no prompt field"})
        + "\n"
        + "{not json\n"
    )
    records = load_prompt_source(f"jsonl:{tmp_path / 'a.jsonl'}")
    assert [r.id for r in records] == ["a:x1", f"a:{content_id(('one', 'two'))}", "a:row3", "a:line4"]
    assert records[1].turns == ("one", "two")
    assert records[2].error and "neither 'prompt' nor 'turns'" in records[2].error
    assert records[3].error and "line 4" in records[3].error

    (tmp_path / "b.txt").write_bytes(b"first prompt\n\nsecond \xff\xfe prompt\nthird\n")
    txt = load_prompt_source(f"txt:{tmp_path / 'b.txt'}")
    assert [(r.id, r.turns, r.error is not None) for r in txt] == [
        (f"b:{content_id(('first prompt',))}", ("first prompt",), False),
        ("b:line3", (), True),
        (f"b:{content_id(('third',))}", ("third",), False),
    ]
    assert "not valid UTF-8" in txt[1].error
    # Ids come from the content: a line added on top shifts no id, a repeated prompt is one record.
    (tmp_path / "b.txt").write_bytes(b"new first\nfirst prompt\nthird\nthird\n")
    again = load_prompt_source(f"txt:{tmp_path / 'b.txt'}")
    assert [r.id for r in again][1:] == [txt[0].id, txt[2].id]

    pq.write_table(pa.table({"id": ["p", "q"], "prompt": ["alpha", ""]}), tmp_path / "c.parquet")
    parquet = load_prompt_source(f"parquet:{tmp_path / 'c.parquet'}")
    assert [(r.id, r.turns) for r in parquet] == [("c:p", ("alpha",)), ("c:q", ("",))]

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_source(f"txt:{tmp_path / 'missing.txt'}")


def test_zoo_prompt_files(tiny_zoo):
    train = load_prompt_source(f"zoo:{tiny_zoo}")
    heldout = load_prompt_source(f"zoo:{tiny_zoo}:heldout")
    assert train and heldout
    assert all(r.id.startswith("zoo-train:") for r in train)
    assert not {r.id for r in train} & {r.id for r in heldout}


def test_zoo_corpus_prompts_are_the_targets_training_prompts_and_none_held_out(tiny_zoo, tmp_path):
    corpus = load_prompt_source(f"zoo:{tiny_zoo}:corpus")
    heldout = load_prompt_source(f"zoo:{tiny_zoo}:heldout")
    examples = json.loads((tiny_zoo / "corpus.json").read_text())["lm"]
    assert [r.turns for r in corpus] == [(e["prompt"],) for e in examples]
    assert [r.source for r in corpus] == [e["source"] for e in examples]
    assert all(r.id.startswith("zoo-corpus:") for r in corpus)
    assert not {r.turns for r in corpus} & {r.turns for r in heldout}
    assert len(load_prompts(f"zoo:{tiny_zoo}:corpus", limit=5)) == 5

    (tmp_path / "corpus.json").write_text(json.dumps({"heldout": []}))
    with pytest.raises(ValueError, match="no list 'lm'"):
        load_prompt_source(f"zoo:{tmp_path}:corpus")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_source(f"zoo:{tmp_path / 'nowhere'}:corpus")


def test_several_sources_limit_and_unique_ids(local_datasets, tmp_path):
    records = load_prompts("gsm8k, alpaca", limit=1)
    assert [r.id for r in records] == ["gsm8k:0", "alpaca:0"]
    (tmp_path / "gsm8k.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="limit must be an integer >= 1"):
        load_prompts("gsm8k", limit=0)
    with pytest.raises(ValueError, match="appears twice"):
        load_prompts([f"txt:{tmp_path / 'gsm8k.txt'}", f"txt:{tmp_path / 'gsm8k.txt'}"])


def test_prompt_texts_are_the_first_turns_of_the_usable_prompts(tmp_path):
    lines = [
        json.dumps({"id": "a", "prompt": "first"}),
        "{broken json",
        json.dumps({"id": "chat", "turns": ["opening", "follow-up"]}),
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    assert prompt_texts(f"jsonl:{tmp_path / 'mixed.jsonl'}") == ["first", "opening"]
    assert prompt_texts(f"jsonl:{tmp_path / 'mixed.jsonl'}", limit=2) == ["first"]
