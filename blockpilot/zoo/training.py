"""Training steps of the zoo: next-token training of the target, and the DFlash drafter recipe.

The loops here are plain PyTorch and run anywhere (`python -m blockpilot zoo build`). Ray Train runs the
same functions on its workers (`pipelines/train_target.py`, `pipelines/train_drafter.py`): a worker
passes its data shard, its (DDP-wrapped) model and a `report` callback.

DFlash drafter recipe (DESIGN.md): on the target's own responses, sample anchor positions in the
response. An anchor opens a block `[token at anchor, MASK x (B-1)]` at positions anchor..anchor+B-1; the
block sees the target's context features strictly before the anchor, attends bidirectionally inside
itself, and never sees another block. Cross-entropy at block positions k = 1..B-1 (the tokens at
anchor + k), weighted by exp(-(k-1)/gamma). The target is frozen; its embeddings and head are shared.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


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


# ----------------------------------------------------------------------------- drafter


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for block positions k = 1..B-1: early positions matter most, as acceptance stops at the
    first miss."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_attention_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """Training mask for blocks opened at `anchors` (N,): bool (N, 1, B, C + B), True = may attend.

    Context key j is visible to a block iff j < its anchor (strictly before: the anchor's own feature is not
    known when it is drafted); every key of the block itself is visible. Keys of other blocks are not in a
    block's key set at all, so blocks are blind to each other by construction.
    """
    context = torch.arange(context_length, device=anchors.device)[None, :] < anchors[:, None]  # (N, C)
    context = context[:, None, None, :].expand(-1, 1, block_size, -1)
    inside = torch.ones(anchors.shape[0], 1, block_size, block_size, dtype=torch.bool, device=anchors.device)
    return torch.cat([context, inside], dim=-1)


@dataclass
class DrafterBatch:
    features: torch.Tensor  # (S, L, F) target context features, padded
    block_ids: torch.Tensor  # (N, B) [token at anchor, MASK...]
    block_positions: torch.Tensor  # (N, B)
    labels: torch.Tensor  # (N, B - 1) tokens at anchor + 1..B-1, IGNORE_INDEX past the end
    sequence_index: torch.Tensor  # (N,) which row of `features` each block reads
    anchors: torch.Tensor  # (N,)


def sample_drafter_batch(
    token_ids: Sequence[torch.Tensor],  # per sequence (L_i,)
    features: Sequence[torch.Tensor],  # per sequence (L_i, F)
    response_starts: Sequence[int],
    rows: Sequence[int],
    anchors_per_sequence: int,
    block_size: int,
    mask_token_id: int,
    rng: random.Random,
) -> DrafterBatch:
    """Blocks anchored at random response positions of the chosen sequences."""
    length = max(len(token_ids[r]) for r in rows)
    width = features[rows[0]].shape[-1]
    padded = torch.zeros(len(rows), length, width, dtype=features[rows[0]].dtype)
    block_ids, positions, labels, owners, anchors = [], [], [], [], []
    offsets = torch.arange(block_size)
    for row, index in enumerate(rows):
        ids, n = token_ids[index], len(token_ids[index])
        padded[row, :n] = features[index]
        # An anchor needs at least one label after it.
        candidates = range(response_starts[index], n - 1)
        if len(candidates) == 0:
            continue
        for anchor in rng.sample(candidates, min(anchors_per_sequence, len(candidates))):
            block = torch.full((block_size,), mask_token_id, dtype=torch.long)
            block[0] = ids[anchor]
            target = torch.full((block_size - 1,), IGNORE_INDEX, dtype=torch.long)
            available = ids[anchor + 1 : anchor + block_size]
            target[: len(available)] = available
            block_ids.append(block)
            positions.append(anchor + offsets)
            labels.append(target)
            owners.append(row)
            anchors.append(anchor)
    return DrafterBatch(
        features=padded,
        block_ids=torch.stack(block_ids),
        block_positions=torch.stack(positions),
        labels=torch.stack(labels),
        sequence_index=torch.tensor(owners),
        anchors=torch.tensor(anchors),
    )


def drafter_hidden(drafter: nn.Module, embed: nn.Module, batch: DrafterBatch) -> torch.Tensor:
    """The drafter's block hidden states (N, B, H) under the training mask."""
    device = next(drafter.parameters()).device
    features = batch.features.to(device)
    context_positions = torch.arange(features.shape[1], device=device)[None]
    context_kv = drafter.encode_context(features, context_positions)
    owners = batch.sequence_index.to(device)
    context_kv = [(k.index_select(0, owners), v.index_select(0, owners)) for k, v in context_kv]
    mask = block_attention_mask(batch.anchors.to(device), features.shape[1], batch.block_ids.shape[1])
    embeds = embed(batch.block_ids.to(device))
    return drafter(embeds, batch.block_positions.to(device), context_kv, attention_mask=mask)


class DrafterObjective(nn.Module):
    """The drafter's training loss as one module, so that `forward` touches every trained parameter (what DDP
    needs). The target's embeddings and head are shared and frozen."""

    def __init__(self, drafter: nn.Module, embed: nn.Module, head: nn.Module, gamma: float) -> None:
        super().__init__()
        self.drafter = drafter
        self.embed, self.head = embed, head
        for parameter in [*embed.parameters(), *head.parameters()]:
            parameter.requires_grad_(False)
        self.gamma = gamma

    def forward(self, batch: DrafterBatch) -> torch.Tensor:
        """Position-weighted cross-entropy of the drafts at block positions 1..B-1."""
        hidden = drafter_hidden(self.drafter, self.embed, batch)
        logits = self.head(hidden[:, 1:]).float()  # (N, B-1, V)
        labels = batch.labels.to(logits.device)
        losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        weights = loss_weights(batch.block_ids.shape[1], self.gamma).to(logits.device)[None, :]
        weights = weights * (labels != IGNORE_INDEX)
        return (losses * weights).sum() / weights.sum().clamp_min(1e-8)


@torch.no_grad()
def target_features(
    target: nn.Module, token_ids: Sequence[torch.Tensor], layer_ids: Sequence[int], batch_size: int = 32
) -> list[torch.Tensor]:
    """Context features (L_i, F) of every sequence, from one teacher-forced pass of the frozen target."""
    from blockpilot.decoding.speculative import context_features

    device = next(target.parameters()).device
    order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
    out: list[torch.Tensor | None] = [None] * len(token_ids)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        length = max(len(token_ids[i]) for i in chunk)
        ids = torch.zeros(len(chunk), length, dtype=torch.long)
        mask = torch.zeros(len(chunk), length, dtype=torch.long)
        for row, index in enumerate(chunk):
            ids[row, : len(token_ids[index])] = token_ids[index]
            mask[row, : len(token_ids[index])] = 1
        hidden = target(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        feats = context_features(hidden.hidden_states, layer_ids).cpu()
        for row, index in enumerate(chunk):
            out[index] = feats[row, : len(token_ids[index])].clone()
    return out  # type: ignore[return-value]


# ----------------------------------------------------------------------------- one run on one data shard


def _identity(module: nn.Module) -> nn.Module:
    return module


def train_target_steps(
    target: nn.Module,
    sequences: Sequence[Sequence[int]],
    pad_id: int,
    schedule: Schedule,
    seed: int,
    report: Reporter,
    wrap: Callable[[nn.Module], nn.Module] = _identity,
    loss_from: Sequence[int] | None = None,
) -> list[float]:
    """Next-token training of `target` on `sequences` (token ids of chat-formatted pairs); with `loss_from`,
    only the tokens from there on (the responses) are learned."""
    model = wrap(target)
    device = next(target.parameters()).device
    batches = padded_batches(sequences, schedule.batch_size, pad_id, seed, device, loss_from)
    return run_training(model, batches, target_loss, schedule, report)


@dataclass(frozen=True)
class DrafterRecipe:
    block_size: int
    anchors_per_sequence: int
    gamma: float


def train_drafter_steps(
    drafter: nn.Module,
    target: nn.Module,
    rows: Sequence[dict[str, Any]],
    recipe: DrafterRecipe,
    schedule: Schedule,
    seed: int,
    report: Reporter,
    wrap: Callable[[nn.Module], nn.Module] = _identity,
) -> list[float]:
    """The DFlash recipe on `rows` ({prompt_ids, response_ids}: the target's own responses)."""
    token_ids = [torch.tensor(row["prompt_ids"] + row["response_ids"]) for row in rows]
    starts = [len(row["prompt_ids"]) for row in rows]
    features = target_features(target, token_ids, drafter.target_layer_ids)
    objective = wrap(
        DrafterObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), recipe.gamma)
    )
    rng = random.Random(seed)

    def batches() -> Iterator[DrafterBatch]:
        while True:
            chosen = rng.sample(range(len(token_ids)), min(schedule.batch_size, len(token_ids)))
            yield sample_drafter_batch(
                token_ids,
                features,
                starts,
                chosen,
                recipe.anchors_per_sequence,
                recipe.block_size,
                drafter.mask_token_id,
                rng,
            )

    return run_training(objective, batches(), lambda model, batch: model(batch), schedule, report)
