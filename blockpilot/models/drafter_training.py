"""The DFlash drafter's training recipe: anchor sampling, the objective and its loss weights.

On the target's own responses, sample anchor positions in the response. An anchor opens a block
`[token at anchor, MASK x (B-1)]` at positions anchor .. anchor + B - 1; the block sees the target's context
features strictly before the anchor, attends bidirectionally inside itself and never sees another block
(the drafting primitive, `DFlashDrafter._draft`, enforces all three). Cross-entropy at block positions
k = 1 .. B - 1 (the tokens at anchor + k), weighted by exp(-(k - 1) / gamma). The target is frozen; its
embeddings and head are shared.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockpilot.models.drafter import Blocks
from blockpilot.models.features import FeatureTap

IGNORE_INDEX = -100


@dataclass(frozen=True)
class DrafterRecipe:
    block_size: int
    anchors_per_sequence: int
    gamma: float  # loss-weight decay over block positions


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for block positions k = 1..B-1: early positions matter most, as acceptance stops at the
    first miss."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class DrafterBatch:
    features: torch.Tensor  # (S, L, F) target context features of S sequences, padded
    first_tokens: torch.Tensor  # (N,) the token at each anchor
    anchors: torch.Tensor  # (N,)
    labels: torch.Tensor  # (N, B - 1) tokens at anchor + 1 .. anchor + B - 1, IGNORE_INDEX past the end
    sequence_index: torch.Tensor  # (N,) which row of `features` each block reads

    @property
    def block_size(self) -> int:
        return self.labels.shape[1] + 1


def sample_drafter_batch(
    token_ids: Sequence[torch.Tensor],  # per sequence (L_i,)
    features: Sequence[torch.Tensor],  # per sequence (L_i, F)
    response_starts: Sequence[int],
    rows: Sequence[int],
    anchors_per_sequence: int,
    block_size: int,
    rng: random.Random,
) -> DrafterBatch:
    """Blocks anchored at random response positions of the chosen sequences."""
    length = max(len(token_ids[r]) for r in rows)
    width = features[rows[0]].shape[-1]
    padded = torch.zeros(len(rows), length, width, dtype=features[rows[0]].dtype)
    first_tokens, labels, owners, anchors = [], [], [], []
    for row, index in enumerate(rows):
        ids, n = token_ids[index], len(token_ids[index])
        padded[row, :n] = features[index]
        # An anchor needs at least one label after it.
        candidates = range(response_starts[index], n - 1)
        if len(candidates) == 0:
            continue
        for anchor in rng.sample(candidates, min(anchors_per_sequence, len(candidates))):
            target = torch.full((block_size - 1,), IGNORE_INDEX, dtype=torch.long)
            available = ids[anchor + 1 : anchor + block_size]
            target[: len(available)] = available
            first_tokens.append(int(ids[anchor]))
            labels.append(target)
            owners.append(row)
            anchors.append(anchor)
    return DrafterBatch(
        features=padded,
        first_tokens=torch.tensor(first_tokens),
        anchors=torch.tensor(anchors),
        labels=torch.stack(labels),
        sequence_index=torch.tensor(owners),
    )


def drafter_hidden(drafter: nn.Module, embed: nn.Module, batch: DrafterBatch, mask_token_id: int) -> torch.Tensor:
    """The drafter's block hidden states (N, B, H): the blocks of `batch`, drafted in one primitive call."""
    device = next(drafter.parameters()).device
    features = batch.features.to(device)
    context_kv = drafter.encode_context(features, torch.arange(features.shape[1], device=device)[None])
    n, size = batch.anchors.shape[0], batch.block_size
    sizes = torch.full((n,), size, device=device)
    blocks = Blocks(batch.first_tokens.to(device), batch.anchors.to(device), sizes, size)
    return drafter.draft_over_contexts(embed, context_kv, blocks, mask_token_id, batch.sequence_index.to(device))


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
        hidden = drafter_hidden(self.drafter, self.embed, batch, self.drafter.mask_token_id)
        logits = self.head(hidden[:, 1:]).float()  # (N, B-1, V)
        labels = batch.labels.to(logits.device)
        losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        weights = loss_weights(batch.block_size, self.gamma).to(logits.device)[None, :]
        weights = weights * (labels != IGNORE_INDEX)
        return (losses * weights).sum() / weights.sum().clamp_min(1e-8)


@torch.no_grad()
def target_features(
    target: nn.Module, token_ids: Sequence[torch.Tensor], layer_ids: Sequence[int], batch_size: int = 32
) -> list[torch.Tensor]:
    """Context features (L_i, F) of every sequence, from one teacher-forced pass of the frozen target."""
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
        with FeatureTap(target, layer_ids) as tap:
            target.model(input_ids=ids.to(device), attention_mask=mask.to(device))
        feats = tap.features().cpu()
        for row, index in enumerate(chunk):
            out[index] = feats[row, : len(token_ids[index])].clone()
    return out  # type: ignore[return-value]
