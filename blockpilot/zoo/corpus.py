"""The zoo's corpus: chat prompt/response pairs from local sources only, deterministic from a seed.

Two kinds of text, so that continuations range from near-deterministic to hard:

* real text: continuations of the Python standard library's own source files (found through
  `sysconfig`, present with every Python), split by file into train and held-out;
* task families of graded predictability: counting, arithmetic sequences, copying, reversing,
  sorting, recalling keys, and free text from a seeded Markov chain over words from the stdlib's comments.

Every family is one small function `(rng, resources) -> (prompt, response)`.
"""

from __future__ import annotations

import hashlib
import random
import re
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Subtrees of the stdlib that are tests or tools rather than library code.
_SKIPPED_PARTS = {"test", "tests", "idle_test", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The stdlib's .py files, sorted (their set depends on the Python version, nothing else)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in root.rglob("*.py") if not _SKIPPED_PARTS.intersection(path.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python standard library sources under {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def python_version_tag() -> str:
    return f"py{sys.version_info.major}{sys.version_info.minor}"


@dataclass
class Resources:
    """What the families draw from, built once per (seed, split)."""

    code_files: list[Path]
    words: list[str]
    markov: dict[str, tuple[list[str], list[float]]]
    _code_cache: dict[Path, list[str]] = field(default_factory=dict)

    def code_lines(self, path: Path) -> list[str]:
        if path not in self._code_cache:
            self._code_cache[path] = path.read_text(encoding="utf-8", errors="replace").splitlines()
        return self._code_cache[path]


def comment_words(files: list[Path], count: int) -> list[str]:
    """The `count` most common lowercase words of the stdlib's comments, sorted for determinism."""
    counter: Counter[str] = Counter()
    for path in files:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            stripped = line.strip()
            if stripped.startswith("#"):
                counter.update(re.findall(r"\b[a-z]{3,9}\b", stripped))
    ranked = sorted(counter.items(), key=lambda item: (-item[1], item[0]))
    return sorted(word for word, _ in ranked[:count])


def markov_chain(words: list[str], rng: random.Random, fan_out: int = 4) -> dict[str, tuple[list[str], list[float]]]:
    """Each word gets `fan_out` successors with skewed probabilities (a clear favourite, then a tail)."""
    chain = {}
    for word in words:
        successors = rng.sample(words, fan_out)
        weights = sorted((rng.random() ** 2 for _ in range(fan_out)), reverse=True)
        weights[0] += 1.0
        total = sum(weights)
        chain[word] = (successors, [w / total for w in weights])
    return chain


def split_files(files: list[Path], seed: int, heldout_share: float = 0.1) -> tuple[list[Path], list[Path]]:
    """Split by file, deterministically from the seed: (train files, held-out files)."""

    def rank(path: Path) -> str:
        return hashlib.sha256(f"{seed}:{path.name}:{path.parent.name}".encode()).hexdigest()

    ordered = sorted(files, key=rank)
    cut = max(1, int(len(ordered) * heldout_share))
    return sorted(ordered[cut:]), sorted(ordered[:cut])


# ----------------------------------------------------------------------------- task families


def family_code(rng: random.Random, res: Resources) -> tuple[str, str]:
    for _ in range(50):
        path = rng.choice(res.code_files)
        lines = res.code_lines(path)
        if len(lines) < 30:
            continue
        start = rng.randrange(0, len(lines) - 24)
        head = "\n".join(lines[start : start + rng.randint(6, 12)])[:500]
        cut = start + len(head.splitlines())
        tail = "\n".join(lines[cut : cut + rng.randint(4, 8)])[:300]
        if head.strip() and tail.strip():
            return f"Continue this Python code:\n{head}", tail
    raise RuntimeError("could not draw a code chunk: stdlib files too short")


def family_count(rng: random.Random, res: Resources) -> tuple[str, str]:
    step = rng.choice([1, 1, 1, 2, 5, 10])
    start = rng.randrange(0, 200) * step
    length = rng.randint(8, 24)
    stop = start + step * (length - 1)
    prompt = f"Count from {start} to {stop}" + (f" in steps of {step}." if step > 1 else ".")
    return prompt, " ".join(str(start + step * i) for i in range(length))


def family_arithmetic(rng: random.Random, res: Resources) -> tuple[str, str]:
    start, step = rng.randint(-20, 60), rng.choice([2, 3, 4, 5, 7, 9, 11, -3, -4])
    terms = [start + step * i for i in range(14)]
    shown = rng.randint(3, 5)
    return "Continue the sequence: " + ", ".join(map(str, terms[:shown])), ", ".join(map(str, terms[shown:]))


def family_copy(rng: random.Random, res: Resources) -> tuple[str, str]:
    text = " ".join(rng.choices(res.words, k=rng.randint(6, 18)))
    return f"Repeat exactly: {text}", text


def family_reverse(rng: random.Random, res: Resources) -> tuple[str, str]:
    words = rng.choices(res.words, k=rng.randint(4, 10))
    return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))


def family_sort(rng: random.Random, res: Resources) -> tuple[str, str]:
    numbers = rng.sample(range(1, 100), rng.randint(5, 12))
    return f"Sort these numbers: {' '.join(map(str, numbers))}", " ".join(map(str, sorted(numbers)))


def family_recall(rng: random.Random, res: Resources) -> tuple[str, str]:
    keys = rng.sample(res.words, rng.randint(4, 8))
    values = {key: rng.randint(0, 99) for key in keys}
    asked = rng.sample(keys, rng.randint(2, len(keys)))
    table = ", ".join(f"{key}={value}" for key, value in values.items())
    return f"Remember {table}. Values of {', '.join(asked)}?", " ".join(str(values[key]) for key in asked)


def family_markov(rng: random.Random, res: Resources) -> tuple[str, str]:
    word = rng.choice(res.words)
    out = [word]
    for _ in range(rng.randint(20, 45)):
        successors, weights = res.markov[out[-1]]
        out.append(rng.choices(successors, weights)[0])
    return f"Tell a story about {word}.", " ".join(out[1:]) + "."


FAMILIES: dict[str, Callable[[random.Random, Resources], tuple[str, str]]] = {
    "code": family_code,
    "count": family_count,
    "arithmetic": family_arithmetic,
    "copy": family_copy,
    "reverse": family_reverse,
    "sort": family_sort,
    "recall": family_recall,
    "markov": family_markov,
}


@dataclass(frozen=True)
class CorpusSpec:
    """How much of each family; weights need not sum to 1."""

    mix: dict[str, float]
    vocab_words: int = 240

    def __post_init__(self) -> None:
        unknown = set(self.mix) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown task families {sorted(unknown)}; expected some of {sorted(FAMILIES)}")


@dataclass(frozen=True)
class Example:
    id: str
    source: str
    prompt: str
    response: str


class Corpus:
    """Draws examples of the train and held-out splits; held-out prompts never appear in train."""

    def __init__(self, spec: CorpusSpec, seed: int) -> None:
        self.spec = spec
        self.seed = seed
        files = stdlib_sources()
        train_files, heldout_files = split_files(files, seed)
        words = comment_words(files, spec.vocab_words)
        chain = markov_chain(words, random.Random(f"markov:{seed}"))
        self.resources = {
            "train": Resources(train_files, words, chain),
            "heldout": Resources(heldout_files, words, chain),
        }
        self._heldout_prompts: set[str] = set()
        self._heldout_drawn = False

    def draw(self, split: str, count: int, stream: str) -> list[Example]:
        """`count` examples of `split`, families drawn by the mix; `stream` names an independent random stream."""
        if split not in self.resources:
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        if split == "train" and not self._heldout_drawn:
            raise RuntimeError("draw the held-out split first, so that train can exclude its prompts")
        rng = random.Random(f"{self.seed}:{split}:{stream}")
        names, weights = zip(*self.spec.mix.items(), strict=True)
        examples, seen = [], set()
        for source in self._family_stream(rng, names, weights):
            if len(examples) == count:
                break
            prompt, response = FAMILIES[source](rng, self.resources[split])
            if prompt in seen or (split == "train" and prompt in self._heldout_prompts):
                continue
            seen.add(prompt)
            examples.append(Example(f"{split}-{stream}-{len(examples):05d}", source, prompt, response))
        if split == "heldout":
            self._heldout_prompts |= seen
            self._heldout_drawn = True
        return examples

    @staticmethod
    def _family_stream(rng: random.Random, names, weights) -> Iterator[str]:
        while True:
            yield rng.choices(names, weights)[0]
