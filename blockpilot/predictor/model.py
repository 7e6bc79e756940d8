"""The block-size predictor: from the prefill distribution to one of the candidate block sizes.

Two kinds compute the same function class:

* `dense` (the paper's): the full softmax over the vocabulary at the last prompt position -> Linear(V, H)
  -> ReLU -> dropout -> Linear(H, C) logits over the C candidates.
* `sparse`: the first layer applied to the stored top-k probabilities only, as an embedding bag weighted
  by the probabilities (sum_i p_i W[id_i] equals W^T p restricted to the top k), so compute and storage
  scale with k, not V; the entropy of the distribution is an extra input.

Both also read the sampling temperature (labels at T = 0 and T = 1 may prefer different b for the same
prompt). A predictor is saved as a folder, `config.json` + `model.safetensors`, loaded without pickle.
It plugs into decoding as `LearnedPolicy` (`blockpilot.predictor.policy`), a per-request block-size policy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from blockpilot.checks import distinct_block_sizes, distinct_tree_budgets, positive_int
from blockpilot.files import load_weights_folder, save_weights_folder
from blockpilot.predictor.inputs import PredictorInputs, nearest_labeled

PredictorKind = Literal["dense", "sparse"]
PREDICTOR_KINDS: tuple[str, ...] = ("dense", "sparse")


@dataclass(frozen=True)
class PredictorConfig:
    kind: PredictorKind
    candidates: tuple[int, ...]
    vocab_size: int
    top_k: int = 32
    hidden_size: int = 2048
    dropout: float = 0.2
    train_block_size: int | None = None
    target_id: str = ""
    drafter_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. training metrics, label source
    # Draft-tree budgets it may choose too (`shapes`): a predictor over shapes, not block sizes alone.
    tree_budgets: tuple[int, ...] = ()
    # The temperatures of the labels it was trained on, and, at some of them, one shape (its index in `shapes`)
    # that every request there gets, where on the validation rows that fixed shape decoded faster than the
    # predictor's choices (`fixed_choices`; `blockpilot train`). A request reads the labeled temperature nearest
    # its own (`nearest_labeled`).
    temperatures: tuple[float, ...] = ()
    fixed_at: tuple[tuple[float, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in PREDICTOR_KINDS:
            raise ValueError(f"predictor kind must be one of {PREDICTOR_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "candidates", distinct_block_sizes(int(b) for b in self.candidates))
        object.__setattr__(self, "tree_budgets", distinct_tree_budgets(int(n) for n in self.tree_budgets))
        for name in ("vocab_size", "top_k", "hidden_size"):
            positive_int(getattr(self, name), name)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        object.__setattr__(self, "temperatures", tuple(sorted({float(t) for t in self.temperatures})))
        fixed = tuple(sorted((float(t), int(index)) for t, index in dict(self.fixed_at).items()))
        object.__setattr__(self, "fixed_at", fixed)
        for temperature, index in fixed:
            if temperature not in self.temperatures:
                labeled = list(self.temperatures)
                raise ValueError(f"fixed_at: temperature {temperature} is not among the labels' temperatures {labeled}")
            if not 0 <= index < len(self.shapes):
                last = len(self.shapes) - 1
                raise ValueError(f"fixed_at: shape index {index} at T = {temperature}: expected 0 .. {last}")

    @property
    def tree_depth(self) -> int | None:
        """How deep its trees are: as deep as the largest candidate, as the labels' trees (None without trees)."""
        return max(self.candidates) if self.tree_budgets else None

    @property
    def shapes(self) -> tuple[tuple[int, int | None], ...]:
        """What it chooses among, in the order of its outputs: (b, None) for each candidate, then (`tree_depth`, N)
        for each tree budget N."""
        chains = tuple((b, None) for b in self.candidates)
        return chains + tuple((self.tree_depth, nodes) for nodes in self.tree_budgets)

    def fixed_index(self, temperature: torch.Tensor) -> torch.Tensor:
        """(N,) long: the index in `shapes` of the fixed shape a request at each `temperature` (N,) gets (`fixed_at`,
        by the nearest labeled temperature), -1 where the predictor chooses."""
        if not self.fixed_at:
            return torch.full(temperature.shape, -1, dtype=torch.long, device=temperature.device)
        fixed = dict(self.fixed_at)
        table = torch.tensor([fixed.get(t, -1) for t in self.temperatures], device=temperature.device)
        return table[nearest_labeled(temperature, self.temperatures)]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidates"] = list(self.candidates)
        out["tree_budgets"] = list(self.tree_budgets)
        out["temperatures"] = list(self.temperatures)
        out["fixed_at"] = [list(pair) for pair in self.fixed_at]
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PredictorConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"predictor config: unknown fields {sorted(unknown)}")
        lists = {name: tuple(raw.get(name, ())) for name in ("tree_budgets", "temperatures")}
        fixed = tuple(tuple(pair) for pair in raw.get("fixed_at", ()))
        return cls(**{**raw, "candidates": tuple(raw["candidates"]), **lists, "fixed_at": fixed})


class BlockSizePredictor(nn.Module):
    """Logits over the candidate block sizes; see the module docstring for the two kinds."""

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        if config.kind == "dense":
            self.first = nn.Linear(config.vocab_size, hidden)
        else:
            self.first = nn.EmbeddingBag(config.vocab_size, hidden, mode="sum")
            self.first_bias = nn.Parameter(torch.zeros(hidden))
        # [entropy, temperature] enter the first layer's pre-activation.
        self.side = nn.Linear(2, hidden, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.out = nn.Linear(hidden, len(config.shapes))

    @property
    def candidates(self) -> tuple[int, ...]:
        return self.config.candidates

    def forward(self, inputs: PredictorInputs) -> torch.Tensor:
        """(N, C) logits over the shapes (C: the candidates, then the tree budgets)."""
        if self.config.kind == "dense":
            probs = inputs.probs if inputs.probs is not None else self.dense_from_topk(inputs)
            h = self.first(probs.to(self.first.weight.dtype))
        else:
            h = self.first(inputs.topk_ids, per_sample_weights=inputs.topk_probs.to(self.first.weight.dtype))
            h = h + self.first_bias
        side = torch.stack([inputs.entropy, inputs.temperature], dim=-1).to(h.dtype)
        h = F.relu(h + self.side(side))
        return self.out(self.dropout(h))

    def dense_from_topk(self, inputs: PredictorInputs) -> torch.Tensor:
        """The top-k probabilities scattered into a V-wide vector (what dense gets from top-k-only labels)."""
        dense = torch.zeros(inputs.topk_ids.shape[0], self.config.vocab_size, device=inputs.topk_ids.device)
        return dense.scatter_(1, inputs.topk_ids, inputs.topk_probs.float())

    def choose(self, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """(N,) long: the index in `shapes` each row gets from its logits (N, C) (`forward`'s) at its `temperature`
        (N,): the best-scored shape, or the fixed one where the config fixes one (`fixed_at`). Every reader of the
        predictor's choice (the live policy, the metrics, the MLflow model) asks here."""
        fixed = self.config.fixed_index(temperature.to(logits.device))
        return torch.where(fixed >= 0, fixed, logits.argmax(dim=-1))

    @torch.no_grad()
    def decide(self, inputs: PredictorInputs) -> tuple[list[int], np.ndarray]:
        """The chosen block size per row (a tree's depth where it chose a tree) and the (N, C) float32 softmax over
        the shapes, from one pass."""
        shapes, probabilities = self.decide_shapes(inputs)
        return [b for b, _ in shapes], probabilities

    @torch.no_grad()
    def decide_shapes(self, inputs: PredictorInputs) -> tuple[list[tuple[int, int | None]], np.ndarray]:
        """The chosen shape per row, (b, tree nodes or None), and the (N, C) float32 softmax over the shapes."""
        if self.training:  # `eval()` walks every module: a tenth of a live decision's time when already in eval
            self.eval()
        logits = self(inputs.to(next(self.parameters()).device)).float()
        chosen = [self.config.shapes[i] for i in self.choose(logits, inputs.temperature).tolist()]
        return chosen, torch.softmax(logits, dim=-1).cpu().numpy()

    def probabilities(self, inputs: PredictorInputs) -> np.ndarray:
        """(N, C) softmax over the candidates per row, float32."""
        return self.decide(inputs)[1]

    def predict(self, inputs: PredictorInputs) -> list[int]:
        """The chosen block size per row."""
        return self.decide(inputs)[0]

    # ---------------------------------------------------------------- folder format

    def save(self, directory: str | Path) -> Path:
        """Write the folder whole (staged, then renamed into place): readers never see half a predictor."""
        return save_weights_folder(directory, self.config.to_dict(), self.state_dict())

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu") -> BlockSizePredictor:
        config, state = load_weights_folder(directory, "predictor")
        model = cls(PredictorConfig.from_dict(config))
        model.load_state_dict(state)
        return model.to(device).eval()
