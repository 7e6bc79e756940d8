"""`blockpilot zoo build`: corpus -> tokenizer -> target (-> its self-distillation) -> target's own responses ->
drafter -> evaluation.

Every stage writes its output under a work folder in `$BLOCKPILOT_HOME/zoo/<key>`, keyed by size, seed, recipe
version, a digest of the recipe's numbers and Python version (the corpus reads the running Python's stdlib); a stage
whose output exists is not run again, so a second build is a copy and a failed one resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from blockpilot.blocks import best_block_size, candidates_around
from blockpilot.checks import differing_fields, mean_or_nan
from blockpilot.data.sources import ZOO_CORPUS_PART, PromptRecord, zoo_prompt_file, zoo_prompts
from blockpilot.files import atomic_folder, write_text_atomic
from blockpilot.home import blockpilot_home
from blockpilot.models.drafter_training import DrafterRecipe
from blockpilot.zoo.corpus import Corpus, CorpusSpec, Example, python_version_tag
from blockpilot.zoo.random_models import ModelShape
from blockpilot.zoo.training import (
    DrafterFit,
    ProgressPrinter,
    Schedule,
    TargetFit,
    train_drafter_steps,
    train_target_steps,
)

RECIPE_VERSION = 3

_TASKS = {"count": 1.0, "arithmetic": 1.0, "copy": 1.0, "reverse": 0.7, "sort": 0.7, "recall": 0.8, "markov": 1.2}


@dataclass(frozen=True)
class ZooRecipe:
    """Everything that determines a zoo, besides the seed."""

    name: str
    vocab_size: int
    shape: ModelShape  # target sizes; `drafter_layers`, `num_feature_layers`, `block_size` for the drafter
    corpus: CorpusSpec
    lm_examples: int  # chat pairs the target trains on
    drafter_prompts: int  # prompts whose target responses the drafter trains on
    train_prompts: int  # prompts/train.jsonl (labeling, predictor training)
    heldout_prompts: int  # prompts/heldout.jsonl (evaluation only)
    target_schedule: Schedule
    drafter_schedule: Schedule
    anchors_per_sequence: int = 8
    gamma: float | None = None  # loss-weight decay; None: B / 2
    response_tokens: int = 96  # max new tokens of the target's responses (drafter data and evaluation)
    eval_prompts: int | None = None  # held-out prompts used for zoo.json's tau table; None: all
    eval_samples: int = 2  # pooled runs per held-out prompt at T = 1
    # The target fine-tuned on its own greedy responses to the first `self_distill_prompts` lm prompts; None: not.
    self_distill_schedule: Schedule | None = None
    self_distill_prompts: int = 4000

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else self.block_size / 2

    def cache_key(self, seed: int) -> str:
        """The build folder's name: a recipe whose numbers change (a schedule, a mix) is a new build, not a reuse
        of the old one's models."""
        digest = hashlib.sha256(json.dumps(_recipe_dict(self), sort_keys=True).encode()).hexdigest()[:8]
        return f"{self.name}-seed{seed}-v{RECIPE_VERSION}-{digest}-{python_version_tag()}"


RECIPES: dict[str, ZooRecipe] = {
    "tiny": ZooRecipe(
        name="tiny",
        vocab_size=512,
        shape=ModelShape(
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            intermediate_size=384,
            drafter_layers=1,
            feature_layers=(1, 3),
            block_size=4,
            max_positions=1024,
        ),
        # No code: its files are 6% of the pairs but a fifth of the tokens (300 on average, up to 700, against 50-110
        # for the other families), and the test suite waits for this build. Without them the target trains in 26 s
        # instead of 42 (loss 3.37 against 3.46) and tau at B rises from 1.97 to 2.57.
        corpus=CorpusSpec(_TASKS),
        lm_examples=6000,
        drafter_prompts=600,
        train_prompts=64,
        heldout_prompts=24,
        # 140 steps: with code in the mix, 220 steps took 20 s longer for a target loss of 3.30 (against 3.46).
        target_schedule=Schedule(steps=140, batch_size=32, lr=3e-3, warmup_steps=20),
        drafter_schedule=Schedule(steps=200, batch_size=16, lr=3e-3, warmup_steps=20),
        response_tokens=48,
    ),
    # The demo's default: built in about 5 minutes on 2 cores, so that a first `make demo` ends in about 15.
    "mini": ZooRecipe(
        name="mini",
        vocab_size=768,
        shape=ModelShape(
            hidden_size=192,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=48,
            intermediate_size=576,
            drafter_layers=2,
            feature_layers=(1, 3),
            block_size=6,
            max_positions=1024,
        ),
        # Less of what a 2-minute target cannot learn: long code prompts, recall's lookups, markov's noise.
        corpus=CorpusSpec({**_TASKS, "recall": 0.4, "markov": 0.6, "code": 0.1}),
        lm_examples=12000,
        drafter_prompts=1000,
        train_prompts=200,
        heldout_prompts=48,
        # Many small steps: the target's loss was 2.4 after 1100 steps of 8, against 2.9 after 450 steps of 24 in
        # about the same minutes (that run's mix had more code, so the comparison is rough; with 450 x 24 the
        # target ignored its prompts). The drafter's steps lift tau at B over 3 (2.5 after 600 steps, 3.0 after
        # 1000, with the target at 1400 and 1100 steps of 8).
        target_schedule=Schedule(steps=1100, batch_size=8, lr=3e-3, warmup_steps=30),
        drafter_schedule=Schedule(steps=1000, batch_size=16, lr=3e-3, warmup_steps=30),
        response_tokens=64,
        # Self-distillation lifted tau at B from 3.28 to 3.85 at T = 0 and from 1.22 to 2.74 at T = 1 (0.37x -> 0.71x
        # of T = 0; Qwen3-4B with z-lab's drafter keeps 0.85x), for about 90 s of build.
        self_distill_schedule=Schedule(steps=600, batch_size=8, lr=1e-3, warmup_steps=20),
        self_distill_prompts=4000,
    ),
    "small": ZooRecipe(
        name="small",
        vocab_size=1024,
        shape=ModelShape(
            hidden_size=256,
            num_layers=6,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=768,
            drafter_layers=3,
            feature_layers=(1, 3, 5),
            block_size=6,
            max_positions=1024,
        ),
        corpus=CorpusSpec({**_TASKS, "code": 2.0}),
        lm_examples=40000,
        drafter_prompts=3000,
        train_prompts=600,
        heldout_prompts=120,
        target_schedule=Schedule(steps=1200, batch_size=24, lr=2e-3, warmup_steps=60),
        drafter_schedule=Schedule(steps=2400, batch_size=16, lr=2e-3, warmup_steps=60),
        # mini's stage: tau at B rose from 3.84 to 4.59 at T = 0 and from 1.25 to 3.41 at T = 1 (0.33x -> 0.74x),
        # for about 4 minutes of build.
        self_distill_schedule=Schedule(steps=600, batch_size=8, lr=1e-3, warmup_steps=20),
        self_distill_prompts=4000,
    ),
}


# ----------------------------------------------------------------------------- stages


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chat_ids(tokenizer: Any, prompt: str, response: str | None = None) -> list[int]:
    """Token ids of the chat-formatted prompt (with the assistant header), plus the response and its end."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    if response is not None:
        text += response + tokenizer.eos_token
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy_responses(
    target: Any, tokenizer: Any, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int = 64
) -> list[list[int]]:
    """The target's greedy responses (ending at eos when it comes), batched with left padding."""
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        length = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), length), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, index in enumerate(chunk):
            ids[row, length - len(prompts[index]) :] = torch.as_tensor(prompts[index])
            mask[row, length - len(prompts[index]) :] = 1
        generated = target.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        )[:, length:].cpu()
        for row, index in enumerate(chunk):
            tokens = generated[row].tolist()
            if tokenizer.eos_token_id in tokens:
                tokens = tokens[: tokens.index(tokenizer.eos_token_id) + 1]
            out[index] = tokens
    return out


@dataclass
class ZooBuild:
    """One build: the recipe, the seed, the work folder, and how training steps run."""

    recipe: ZooRecipe
    seed: int
    work: Path
    device: torch.device
    log: Callable[[str], None] = print
    losses: dict[str, list[float]] = field(default_factory=dict)

    # -- corpus and prompt files
    def corpus_stage(self) -> dict[str, list[Example]]:
        path = self.work / "corpus.json"
        if path.is_file():
            raw = json.loads(path.read_text())
            return {split: [Example(**row) for row in rows] for split, rows in raw.items()}
        self.log(f"[zoo] drawing the corpus (seed {self.seed})")
        corpus = Corpus(self.recipe.corpus, self.seed)
        parts = {"heldout": corpus.draw("heldout", self.recipe.heldout_prompts, "prompts")}
        parts["train_prompts"] = corpus.draw("train", self.recipe.train_prompts, "prompts")
        parts[ZOO_CORPUS_PART] = corpus.draw("train", self.recipe.lm_examples, "lm")
        parts["drafter"] = corpus.draw("train", self.recipe.drafter_prompts, "drafter")
        for name, split in (("train", "train_prompts"), ("heldout", "heldout")):
            rows = [{"id": e.id, "source": e.source, "prompt": e.prompt} for e in parts[split]]
            _write_jsonl(zoo_prompt_file(self.work, name), rows)
        # Written last: its presence says the stage is complete.
        write_text_atomic(path, json.dumps({k: [asdict(e) for e in v] for k, v in parts.items()}))
        return parts

    def tokenizer_stage(self, corpus: dict[str, list[Example]]) -> Any:
        from transformers import AutoTokenizer

        from blockpilot.zoo.tokenizer import train_byte_level_tokenizer

        directory = self.work / "tokenizer"
        if (directory / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(directory)
        self.log(f"[zoo] training a {self.recipe.vocab_size}-token byte-level BPE")
        texts = [text for e in corpus[ZOO_CORPUS_PART] for text in (e.prompt, e.response)]
        tokenizer = train_byte_level_tokenizer(texts, self.recipe.vocab_size)
        with atomic_folder(directory) as staging:
            tokenizer.save_pretrained(staging)
        return AutoTokenizer.from_pretrained(directory)

    def target_stage(self, tokenizer: Any, corpus: dict[str, list[Example]], trainer: Trainer) -> Any:
        from blockpilot.zoo.random_models import random_target

        # With self-distillation to follow, the pretrained target is kept apart: a build stopped during the
        # self-distillation resumes after the pretraining.
        directory = self.work / ("pretrained-target" if self.recipe.self_distill_schedule else "target")
        saved = self._saved_target(directory, "target", "losses.json")
        if saved is not None:
            return saved
        sequences = [chat_ids(tokenizer, e.prompt, e.response) for e in corpus[ZOO_CORPUS_PART]]
        # The prompts of most families are random (word lists, tables, numbers): learning the responses only
        # spends the small target's capacity where generation happens.
        loss_from = [len(chat_ids(tokenizer, e.prompt)) for e in corpus[ZOO_CORPUS_PART]]
        target = random_target(
            len(tokenizer),
            self.recipe.shape,
            seed=self.seed,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).to(self.device)
        tokens = sum(map(len, sequences))
        self.log(f"[zoo] training the target: {_millions(target)} params on {len(sequences)} pairs ({tokens} tokens)")
        fit = TargetFit(sequences, loss_from, tokenizer.pad_token_id, self.recipe.target_schedule, self.seed)
        self.losses["target"] = trainer.train_target(target, fit)
        return self._save_target(directory, target, tokenizer, "target", "losses.json")

    def self_distill_stage(
        self, target: Any, tokenizer: Any, corpus: dict[str, list[Example]], trainer: Trainer
    ) -> Any:
        """The pretrained target fine-tuned on its own greedy responses, when the recipe asks for it.

        A small target pretrained for minutes stays unsure of its answers (2.2 nats a token on the mini zoo): its
        greedy path is often right, but at T = 1 it samples away from it, where the drafter, trained on that greedy
        path, is rarely right (tau at T = 1 was 0.37x tau at T = 0, against 0.85x for Qwen3-4B with z-lab's drafter).
        Chat models are tuned on their own outputs and answer with confidence; this stage does that.
        """
        schedule = self.recipe.self_distill_schedule
        directory = self.work / "target"
        if schedule is None:
            return target
        saved = self._saved_target(directory, "self_distill", "self_distill_losses.json")
        if saved is not None:
            return saved
        examples = corpus[ZOO_CORPUS_PART][: self.recipe.self_distill_prompts]
        prompts = [chat_ids(tokenizer, e.prompt) for e in examples]
        self.log(f"[zoo] self-distilling the target on its own responses to {len(prompts)} prompts")
        responses = greedy_responses(target, tokenizer, prompts, self.recipe.response_tokens)
        kept = [
            (prompt, response)
            for prompt, response in zip(prompts, responses, strict=True)
            if response
        ]
        self.log(f"[zoo] self-distilling on {len(kept)} of {len(prompts)} responses")
        fit = TargetFit(
            [prompt + response for prompt, response in kept],
            [len(prompt) for prompt, _ in kept],
            tokenizer.pad_token_id,
            schedule,
            self.seed + 2,
        )
        self.losses["self_distill"] = trainer.train_target(target, fit)
        return self._save_target(directory, target, tokenizer, "self_distill", "self_distill_losses.json")

    def _saved_target(self, directory: Path, kind: str, losses_file: str) -> Any | None:
        """The target a finished stage left in `directory`, its `kind` losses read back; None if not finished."""
        from transformers import AutoModelForCausalLM

        if not (directory / "model.safetensors").is_file():
            return None
        self.losses[kind] = json.loads((directory / losses_file).read_text())
        return AutoModelForCausalLM.from_pretrained(directory).to(self.device).eval()

    def _save_target(self, directory: Path, target: Any, tokenizer: Any, kind: str, losses_file: str) -> Any:
        """A stage's trained target, its tokenizer and its `kind` losses, written atomically to `directory`."""
        with atomic_folder(directory) as staging:
            target.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            (staging / losses_file).write_text(json.dumps(self.losses[kind]))
        return target.eval()

    def responses_stage(self, target: Any, tokenizer: Any, corpus: dict[str, list[Example]]) -> list[dict[str, Any]]:
        path = self.work / "drafter_data.jsonl"
        if path.is_file():
            return _read_jsonl(path)
        prompts = [chat_ids(tokenizer, e.prompt) for e in corpus["drafter"]]
        self.log(f"[zoo] generating the target's own responses to {len(prompts)} prompts")
        started = time.perf_counter()
        responses = greedy_responses(target, tokenizer, prompts, self.recipe.response_tokens)
        rows = [
            {"source": e.source, "prompt_ids": p, "response_ids": r}
            for e, p, r in zip(corpus["drafter"], prompts, responses, strict=True)
            if r
        ]
        self.log(f"[zoo] responses done in {time.perf_counter() - started:.0f}s")
        _write_jsonl(path, rows)
        return rows

    def drafter_stage(self, target: Any, tokenizer: Any, data: list[dict[str, Any]], trainer: Trainer) -> Any:
        from blockpilot.models.drafter import DFlashDrafter
        from blockpilot.zoo.random_models import drafter_for

        directory = self.work / "drafter"
        if (directory / "model.safetensors").is_file():
            self.losses["drafter"] = json.loads((directory / "losses.json").read_text())
            return DFlashDrafter.from_pretrained(directory, device=self.device)
        drafter = drafter_for(target, self.recipe.shape, mask_token_id=tokenizer.mask_token_id, seed=self.seed + 1)
        drafter = drafter.to(self.device)
        self.log(
            f"[zoo] training the drafter: {_millions(drafter)} params, B={self.recipe.block_size}, "
            f"{len(data)} responses"
        )
        recipe = DrafterRecipe(self.recipe.block_size, self.recipe.anchors_per_sequence, self.recipe.loss_gamma)
        self.losses["drafter"] = trainer.train_drafter(
            drafter, target, DrafterFit(data, recipe, self.recipe.drafter_schedule, self.seed)
        )
        with atomic_folder(directory) as staging:
            drafter.save_pretrained(staging)
            (staging / "losses.json").write_text(json.dumps(self.losses["drafter"]))
        return drafter.eval()


def _millions(model: torch.nn.Module) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M"


# ----------------------------------------------------------------------------- trainers


class Trainer(Protocol):
    """Runs the library's training steps somewhere: in this process, or on Ray Train workers. Each job is one
    frozen dataclass, passed whole."""

    def train_target(self, target: Any, fit: TargetFit) -> list[float]: ...

    def train_drafter(self, drafter: Any, target: Any, fit: DrafterFit) -> list[float]: ...


class LocalTrainer:
    """In this process, with a progress line; what a machine without Ray uses."""

    def train_target(self, target: Any, fit: TargetFit) -> list[float]:
        return train_target_steps(target, fit, ProgressPrinter("target", fit.schedule.steps))

    def train_drafter(self, drafter: Any, target: Any, fit: DrafterFit) -> list[float]:
        return train_drafter_steps(drafter, target, fit, ProgressPrinter("drafter", fit.schedule.steps))


# ----------------------------------------------------------------------------- evaluation


def ends_in_loop(tokens: Sequence[int], max_period: int = 12, min_repeats: int = 3) -> bool:
    """Whether the output ends in >= `min_repeats` repetitions of one unit of <= `max_period` tokens."""
    tokens = list(tokens)
    for period in range(1, max_period + 1):
        span = period * min_repeats
        if len(tokens) >= span:
            tail = tokens[-span:]
            if all(tail[i] == tail[i % period] for i in range(span)):
                return True
    return False


def evaluate_zoo(
    models: Any, heldout: Sequence[PromptRecord], recipe: ZooRecipe, log: Callable[[str], None]
) -> dict[str, Any]:
    """Held-out tau for b = 1..2B at T = 0 (and at T = 1, `recipe.eval_samples` pooled runs), B* over
    B-2..B+2, the oracle's gain, the loop share, tau(b) per source and split by how the generation ended, and how
    often each draft slot is right per b.

    A replay sweep (`blockpilot.sweep`): acceptance tables give every b's tau for the cost of one generation.
    """
    import numpy as np

    from blockpilot.sweep import SweepConfig, sweep_prompts

    block = recipe.block_size
    sizes = list(range(1, 2 * block + 1))
    prompts = heldout[: recipe.eval_prompts] if recipe.eval_prompts else heldout
    ids = [models.encode_prompt(record.turns[0]) for record in prompts]
    seeds = list(range(len(prompts)))
    stop = tuple(models.stop_token_ids())
    out: dict[str, Any] = {}
    for temperature in (0.0, 1.0):
        samples = recipe.eval_samples if temperature > 0 else 1
        log(f"[zoo] evaluating tau for b = 1..{2 * block} at T = {temperature:g} on {len(prompts)} held-out prompts")
        config = SweepConfig(tuple(sizes), temperature, recipe.response_tokens, stop, samples=samples)
        hits = np.zeros((len(sizes), max(sizes) - 1, 2), dtype=np.int64)
        sweeps = sweep_prompts(models, ids, seeds, config, max_batch=16, slot_hits=hits)
        per_prompt = [
            {
                "id": record.id,
                "source": record.source,
                "tau": {b: (t if sweep.cycles[i] else 1.0) for i, (b, t) in enumerate(zip(sizes, sweep.tau, strict=True))},
                "loops": ends_in_loop(sweep.token_ids),
                "stopped": bool(sweep.token_ids) and sweep.token_ids[-1] in stop,  # at T = 1: the first sample
            }
            for record, sweep in zip(prompts, sweeps, strict=True)
        ]
        summary = summarize_tau(per_prompt, sizes, block)
        summary["slot_accuracy"] = {
            str(b): [round(float(r / d), 4) if d else None for r, d in hits[i, : b - 1]] for i, b in enumerate(sizes)
        }
        if temperature == 0:
            out.update(summary)
        else:
            out["T1"] = summary
    return out


def summarize_tau(per_prompt: list[dict[str, Any]], sizes: list[int], block: int) -> dict[str, Any]:
    """The evaluation's summary of per-prompt rows `{id, source, tau: {b: tau}, loops, stopped}`.

    `by_ending` splits the prompts by whether the generation stopped on a stop token (`stopped`) or ran to the
    token budget (`budget`): a generation that runs on (a loop, a count past its end) is the easiest text there is
    for every draft slot, however far past B.
    """
    window = list(candidates_around(block))
    histogram = Counter(best_block_size(window, [p["tau"][b] for b in window]) for p in per_prompt)
    oracle = mean_or_nan(max(p["tau"][b] for b in window) for p in per_prompt)
    tau_at_block = mean_or_nan(p["tau"][block] for p in per_prompt)
    sources: dict[str, list[dict[str, Any]]] = {}
    for p in per_prompt:
        sources.setdefault(p["source"], []).append(p)
    by_source = {
        source: {
            **_tau_curve(group, sizes),
            "tau_at_B": mean_or_nan(p["tau"][block] for p in group),
            "loop_share": mean_or_nan(float(p["loops"]) for p in group),
            "budget_share": mean_or_nan(float(not p["stopped"]) for p in group),
        }
        for source, group in sorted(sources.items())
    }
    by_ending = {
        "stopped": _tau_curve([p for p in per_prompt if p["stopped"]], sizes),
        "budget": _tau_curve([p for p in per_prompt if not p["stopped"]], sizes),
    }
    return {
        **_tau_curve(per_prompt, sizes),
        "tau_at_B": round(tau_at_block, 4),
        "candidates": window,
        "best_block_size_histogram": {str(b): histogram.get(b, 0) for b in window},
        "largest_best_share": max(histogram.values()) / len(per_prompt),
        "oracle_tau": round(oracle, 4),
        "oracle_over_fixed_B": round(oracle / tau_at_block, 4),
        "loop_share": mean_or_nan(float(p["loops"]) for p in per_prompt),
        "budget_share": mean_or_nan(float(not p["stopped"]) for p in per_prompt),
        "by_source": by_source,
        "by_ending": by_ending,
    }


def _tau_curve(per_prompt: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """How many prompts, their mean tau(b), and the b where it peaks (the smallest on a tie; None for no prompts)."""
    curve = {b: mean_or_nan(p["tau"][b] for p in per_prompt) for b in sizes}
    return {
        "prompts": len(per_prompt),
        "tau_by_block_size": {str(b): round(tau, 4) for b, tau in curve.items()},
        "peak_block_size": max(sizes, key=lambda b: (curve[b], -b)) if per_prompt else None,
    }


# ----------------------------------------------------------------------------- entry point


def zoo_cache_dir(recipe: ZooRecipe, seed: int, home: Path | None = None) -> Path:
    return (home or blockpilot_home()) / "zoo" / recipe.cache_key(seed)


def build_zoo(
    size: str,
    out: str | Path | None = None,
    *,
    seed: int = 0,
    device: str | None = None,
    trainer: Trainer | None = None,
    recipe: ZooRecipe | None = None,
    track: bool = True,
    log: Callable[[str], None] = print,
) -> Path:
    """Build (or reuse) the zoo of `size`; copy it to `out` when given. Returns the folder holding it."""
    if recipe is None:
        if size not in RECIPES:
            raise ValueError(f"unknown zoo size {size!r}; expected one of {sorted(RECIPES)}")
        recipe = RECIPES[size]
    work = zoo_cache_dir(recipe, seed)
    if not (work / "zoo.json").is_file():
        info = _build_into(work, recipe, seed, device, trainer or LocalTrainer(), log)
        _track_build(info, work, track)
    else:
        log(f"[zoo] reusing {work}")
    if out is None:
        return work
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("target", "drafter", "prompts"):
        shutil.copytree(work / name, out / name, dirs_exist_ok=True)
    shutil.copy2(work / "zoo.json", out / "zoo.json")
    return out


def _build_into(work: Path, recipe: ZooRecipe, seed: int, device: str | None, trainer: Trainer, log) -> dict[str, Any]:
    from blockpilot.models.loading import SpeculativeModels, resolve_device_dtype

    torch_device, _ = resolve_device_dtype(device or "cpu", None)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    build = ZooBuild(recipe, seed, work, torch_device, log)
    corpus = build.corpus_stage()
    tokenizer = build.tokenizer_stage(corpus)
    target = build.self_distill_stage(build.target_stage(tokenizer, corpus, trainer), tokenizer, corpus, trainer)
    data = build.responses_stage(target, tokenizer, corpus)
    drafter = build.drafter_stage(target, tokenizer, data, trainer)
    models = SpeculativeModels(target, tokenizer, drafter, tokenizer.mask_token_id)
    evaluation = evaluate_zoo(models, zoo_prompts(work, "heldout"), recipe, log)
    info = {
        "size": recipe.name,
        "seed": seed,
        "recipe_version": RECIPE_VERSION,
        "python": python_version_tag(),
        "block_size": recipe.block_size,
        "parameters": {
            "target": sum(p.numel() for p in target.parameters()),
            "drafter": sum(p.numel() for p in drafter.parameters()),
        },
        "final_loss": {k: v[-1] for k, v in build.losses.items()},
        "losses": build.losses,
        "evaluation": evaluation,
        "build_seconds": round(time.perf_counter() - started, 1),
        "recipe": _recipe_dict(recipe),
    }
    write_text_atomic(work / "zoo.json", json.dumps(info, indent=2) + "\n")
    log(f"[zoo] built in {info['build_seconds']:.0f}s: tau at B={recipe.block_size} is {evaluation['tau_at_B']:.2f}")
    return info


def reevaluate_zoo(
    zoo: str | Path, *, device: str | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """The held-out evaluation of a built zoo, run again on its saved models with this version's code (a new split
    or summary without a rebuild). Its `zoo.json` must hold the recipe `RECIPES` has for its size today: the
    evaluation's settings (prompts, samples, token budget, B) come from there."""
    from blockpilot.models.loading import load_models

    zoo = Path(zoo)
    info_path = zoo / "zoo.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"no zoo.json in {str(zoo)!r}: expected a folder written by `blockpilot zoo build`")
    info = json.loads(info_path.read_text())
    size = info.get("size")
    if size not in RECIPES:
        raise ValueError(f"{str(info_path)!r} names zoo size {size!r}; expected one of {sorted(RECIPES)}")
    recipe = RECIPES[size]
    saved, today = info.get("recipe", {}), json.loads(json.dumps(_recipe_dict(recipe)))
    if saved != today:
        changed = differing_fields(saved, today)
        raise ValueError(f"{str(zoo)!r} was built with another {size!r} recipe (differs in {changed}): rebuild it")
    models = load_models(zoo / "target", zoo / "drafter", device=device)
    return evaluate_zoo(models, zoo_prompts(zoo, "heldout"), recipe, log)


def _track_build(info: dict[str, Any], work: Path, enabled: bool) -> None:
    """Losses, the tau table and zoo.json to MLflow (experiment `blockpilot-zoo`)."""
    from blockpilot.tracking import start_run

    run_name = f"{info['size']}-seed{info['seed']}"
    with start_run("blockpilot-zoo", run_name, enabled=enabled, tags={"stage": "zoo"}) as tracker:
        tracker.log_params({"seed": info["seed"], "recipe_version": info["recipe_version"], **info["recipe"]})
        for kind, history in info["losses"].items():
            every = info["recipe"][f"{kind}_schedule"]["log_every"]
            for index, loss in enumerate(history):
                tracker.log_metrics({f"{kind}_loss": loss}, step=(index + 1) * every)
        evaluation = info["evaluation"]
        tracker.log_metrics({f"tau_b{b}": tau for b, tau in evaluation["tau_by_block_size"].items()})
        keys = ("tau_at_B", "oracle_tau", "oracle_over_fixed_B", "largest_best_share", "loop_share", "budget_share")
        tracker.log_metrics({key: evaluation[key] for key in keys})
        tracker.log_metrics({"build_seconds": info["build_seconds"]})
        tracker.log_artifact(work / "zoo.json")


def _recipe_dict(recipe: ZooRecipe) -> dict[str, Any]:
    out = asdict(recipe)
    out["corpus"] = {"mix": recipe.corpus.mix, "vocab_words": recipe.corpus.vocab_words}
    return out
