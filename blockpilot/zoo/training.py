"""Training steps of the zoo: next-token training of the target, and the DFlash drafter recipe run to a schedule.

The loops here are plain PyTorch and run anywhere (`python -m blockpilot zoo build`). Ray Train runs the
same functions on its workers (`pipelines/zoo_trainer.py`): a worker passes its shard of the job (`shard`),
its (DDP-wrapped) model and a `report` callback. The drafter's recipe itself lives beside the drafter
(`blockpilot.models.drafter_training`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blockpilot.models.drafter_training import (
    IGNORE_INDEX,
    DrafterBatch,
    DrafterObjective,
    DrafterRecipe,
    sample_drafter_batch,
    target_features,
)


@dataclass(frozen=True)
class Schedule:
    """Optimiser and length of one training run."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    log_every: int = 25

    def per_worker(self, world: int) -> Schedule:
        """The same run split over `world` data-parallel workers: each takes its share of the global batch."""
        return replace(self, batch_size=max(1, self.batch_size // world))

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of `lr`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# A progress/metrics sink: report(step, metrics). The default prints a progress line.
Reporter = Callable[[int, dict[str, float]], None]


class ProgressPrinter:
    """Prints `[name] step s/N loss x elapsed, ~left` lines: steps, loss and time left."""

    def __init__(self, name: str, total_steps: int, every_s: float = 10.0) -> None:
        self.name, self.total, self.every_s = name, total_steps, every_s
        self.start = self.last_print = time.perf_counter()

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        done = step + 1
        if now - self.last_print < self.every_s and done < self.total:
            return
        self.last_print = now
        elapsed = now - self.start
        left = elapsed / done * (self.total - done)
        shown = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        print(f"[{self.name}] step {done}/{self.total} {shown} | {elapsed:.0f}s elapsed, ~{left:.0f}s left", flush=True)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 mixed precision where the hardware runs it natively (CUDA, or CPUs with AVX512-BF16/AMX); else None."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return None


def run_training(
    model: nn.Module,
    batches: Iterator[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    schedule: Schedule,
    report: Reporter,
) -> list[float]:
    """AdamW with warm-up + cosine, bf16 autocast where native; returns the mean loss of every `log_every` steps.

    Weights and optimiser state stay fp32; only the forward pass runs in bf16.
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    device = parameters[0].device
    mixed = autocast_dtype(device)
    optimizer = torch.optim.AdamW(parameters, lr=schedule.lr, weight_decay=schedule.weight_decay, betas=(0.9, 0.95))
    model.train()
    window: list[float] = []
    history: list[float] = []
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        with torch.autocast(device.type, dtype=mixed or torch.float32, enabled=mixed is not None):
            loss = loss_fn(model, next(batches))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss became {loss.item()} at step {step}; lower the learning rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, schedule.grad_clip)
        optimizer.step()
        window.append(loss.item())
        if len(window) == schedule.log_every or step == schedule.steps - 1:
            history.append(sum(window) / len(window))
            window = []
        report(step, {"loss": history[-1] if history else loss.item(), "lr": schedule.lr_at(step)})
    model.eval()
    return history


# ----------------------------------------------------------------------------- target


def padded_batches(
    sequences: Sequence[Sequence[int]],
    batch_size: int,
    pad_id: int,
    seed: int,
    device: torch.device | str = "cpu",
    loss_from: Sequence[int] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, labels) batches, right-padded; similar lengths are batched together.

    Right padding needs no attention mask under a causal model (a real token never sees a later pad), and
    the mask-free attention path is markedly faster on the CPU; pads are ignored by the loss, and so are
    the tokens before `loss_from[i]` (the prompt, when only responses are learned).
    """
    rng = random.Random(seed)
    order = list(range(len(sequences)))
    while True:
        rng.shuffle(order)
        # Sort within windows of 32 batches: little padding, still well mixed.
        window = batch_size * 32
        batches = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start : start + window], key=lambda i: len(sequences[i]))
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        for batch in batches:
            # Lengths rounded up to a multiple of 32: few distinct shapes keep the CPU kernels' caches small.
            length = -(-max(len(sequences[i]) for i in batch) // 32) * 32
            ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), length), dtype=torch.long)
            for row, index in enumerate(batch):
                seq = sequences[index]
                ids[row, : len(seq)] = torch.as_tensor(seq)
                mask[row, loss_from[index] if loss_from is not None else 0 : len(seq)] = 1
            labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
            yield ids.to(device), labels.to(device)


def target_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    logits = model(input_ids=ids).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)


# ----------------------------------------------------------------------------- one run on one data shard


def _identity(module: nn.Module) -> nn.Module:
    return module


@dataclass(frozen=True)
class TargetFit:
    """One target training job: chat-formatted sequences, where each one's loss starts, and the schedule."""

    sequences: Sequence[Sequence[int]]
    loss_from: Sequence[int] | None  # per sequence, the first position learned (the response); None: all
    pad_id: int
    schedule: Schedule
    seed: int

    def shard(self, rank: int, world: int) -> TargetFit:
        """This worker's share: every world-th sequence, the global batch split, its own seed."""
        return replace(
            self,
            sequences=self.sequences[rank::world],
            loss_from=None if self.loss_from is None else self.loss_from[rank::world],
            schedule=self.schedule.per_worker(world),
            seed=self.seed + rank,
        )


@dataclass(frozen=True)
class DrafterFit:
    """One drafter training job: the target's own responses, the DFlash recipe and the schedule."""

    rows: Sequence[dict[str, Any]]  # {prompt_ids, response_ids}
    recipe: DrafterRecipe
    schedule: Schedule
    seed: int

    def shard(self, rank: int, world: int) -> DrafterFit:
        return replace(
            self,
            rows=self.rows[rank::world],
            schedule=self.schedule.per_worker(world),
            seed=self.seed + rank,
        )


def train_target_steps(
    target: nn.Module, fit: TargetFit, report: Reporter, wrap: Callable[[nn.Module], nn.Module] = _identity
) -> list[float]:
    """Next-token training of `target` on `fit.sequences`; with `fit.loss_from`, only the responses are learned."""
    model = wrap(target)
    device = next(target.parameters()).device
    batches = padded_batches(fit.sequences, fit.schedule.batch_size, fit.pad_id, fit.seed, device, fit.loss_from)
    return run_training(model, batches, target_loss, fit.schedule, report)


def train_drafter_steps(
    drafter: nn.Module,
    target: nn.Module,
    fit: DrafterFit,
    report: Reporter,
    wrap: Callable[[nn.Module], nn.Module] = _identity,
) -> list[float]:
    """The DFlash recipe on `fit.rows` (the target's own responses)."""
    token_ids = [torch.tensor(row["prompt_ids"] + row["response_ids"]) for row in fit.rows]
    starts = [len(row["prompt_ids"]) for row in fit.rows]
    features = target_features(target, token_ids, drafter.target_layer_ids)
    objective = wrap(
        DrafterObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), fit.recipe.gamma)
    )
    rng = random.Random(fit.seed)
    recipe, batch_size = fit.recipe, fit.schedule.batch_size

    def batches() -> Iterator[DrafterBatch]:
        while True:
            chosen = rng.sample(range(len(token_ids)), min(batch_size, len(token_ids)))
            yield sample_drafter_batch(
                token_ids, features, starts, chosen, recipe.anchors_per_sequence, recipe.block_size, rng
            )

    return run_training(objective, batches(), lambda model, batch: model(batch), fit.schedule, report)
