"""The per-step block-size model: before every cycle, a score for each candidate b from the cycle's features
(`step_features`); the policy takes the best. It learns each candidate's regret, Q(i, b) - min_b Q(i, b): what
choosing b at cursor i adds to the cost of the rest of the generation over the per-step oracle (`step_data`).

One forward: the features standardized on the training cycles (token ids excepted), the token ids through an
embedding, then an MLP with one hidden layer; a load-aware model (one whose cost curve was measured at several batch
sizes) has one such MLP per load and sends each row to the head of its batch's nearest load. One MLP fed log(batch
rows) as an input did not learn the loads apart (docs/log.md, "A step model for every load").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from blockpilot.checks import distinct_block_sizes, positive_int
from blockpilot.cost import nearest_batch_size
from blockpilot.files import load_weights_folder, save_weights_folder
from blockpilot.predictor.inputs import nearest_labeled
from blockpilot.predictor.step_features import StepFeatures


@dataclass(frozen=True)
class StepModelConfig:
    candidates: tuple[int, ...]
    vocab_size: int  # the target's vocabulary: token ids past it read as NO_TOKEN
    hidden_size: int = 64
    train_block_size: int | None = None
    target_id: str = ""
    drafter_id: str = ""
    prior: bool = False  # reads the per-request predictor's b0 and probabilities (`learned+step`)
    loads: tuple[int, ...] = ()  # a load-aware model: the batch sizes it was trained at, one head each
    token_dims: int = 8  # the token embedding's width
    # The temperatures of the labels it was trained on, and those of them at which a request keeps the per-request
    # predictor's b0 to its end, where on a validation split of the labels that prior's walks decoded faster than
    # the model's (`keeps_prior`; `blockpilot train-step`).
    temperatures: tuple[float, ...] = ()
    prior_temperatures: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", distinct_block_sizes(int(b) for b in self.candidates))
        object.__setattr__(self, "loads", distinct_block_sizes(self.loads, "loads") if self.loads else ())
        object.__setattr__(self, "temperatures", tuple(sorted({float(t) for t in self.temperatures})))
        object.__setattr__(self, "prior_temperatures", tuple(sorted({float(t) for t in self.prior_temperatures})))
        positive_int(self.vocab_size, "vocab_size")
        positive_int(self.hidden_size, "hidden_size")
        positive_int(self.token_dims, "token_dims")
        if not set(self.prior_temperatures) <= set(self.temperatures):
            raise ValueError(
                f"prior_temperatures {list(self.prior_temperatures)} must be among the labels' temperatures "
                f"{list(self.temperatures)}"
            )
        if self.prior_temperatures and not self.prior:
            raise ValueError("prior_temperatures keep a per-request predictor's b0: the model must read one (prior)")

    @cached_property
    def features(self) -> StepFeatures:
        """Built once per config: the live policy reads it before every cycle."""
        return StepFeatures(self.candidates, prior=self.prior, load=bool(self.loads))

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "candidates": list(self.candidates),
            "loads": list(self.loads),
            "temperatures": list(self.temperatures),
            "prior_temperatures": list(self.prior_temperatures),
            "features": list(self.features.names),  # for readers; derived, checked on load
            "kind": "step",
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StepModelConfig:
        raw = {k: v for k, v in raw.items() if k != "kind"}
        saved_features = raw.pop("features", None)
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"step model config: unknown fields {sorted(unknown)}")
        lists = ("candidates", "loads", "temperatures", "prior_temperatures")
        config = cls(**{**raw, **{name: tuple(raw.get(name, ())) for name in lists}})
        if saved_features is not None and tuple(saved_features) != config.features.names:
            raise ValueError(
                f"the step model reads {saved_features}, this version builds {list(config.features.names)}: "
                "train it again with `blockpilot train-step`"
            )
        return config

    def keeps_prior(self, temperature: torch.Tensor) -> torch.Tensor:
        """(N,) bool: whether a request at each `temperature` (N,) keeps the prior's b0, by the labels' temperature
        nearest to it (`nearest_labeled`)."""
        if not self.prior_temperatures:
            return torch.zeros_like(temperature, dtype=torch.bool)
        kept = torch.tensor([t in self.prior_temperatures for t in self.temperatures], device=temperature.device)
        return kept[nearest_labeled(temperature, self.temperatures)]

    def keeps_prior_at(self, temperature: float) -> bool:
        """`keeps_prior` of one request at `temperature`."""
        return bool(self.keeps_prior(torch.tensor([temperature], dtype=torch.float32))[0])


def embedding_rows(tokens: torch.Tensor | np.ndarray, vocab_size: int) -> torch.Tensor | np.ndarray:
    """Token ids (float feature columns, any shape) as rows of a step model's token embedding: an id outside the
    vocabulary (NO_TOKEN among them) reads the row past it."""
    if torch.is_tensor(tokens):
        ids = tokens.round().long()
        return torch.where((ids >= 0) & (ids < vocab_size), ids, torch.full_like(ids, vocab_size))
    ids = np.rint(tokens).astype(np.int64)
    return np.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)


@dataclass(frozen=True)
class FoldedHead:
    """One MLP of a `StepModel` with its input's standardization folded into the first layer's numeric weights and
    the token embedding into one table of first-layer rows per token column: the same scores, fewer operations."""

    numeric: np.ndarray  # (numeric features, H): the first layer's weights over standardized features, unscaled
    bias: np.ndarray  # (H,) the first layer's bias, the features' means folded in
    tables: tuple[np.ndarray, ...]  # per token column (V + 1, H): the first layer's rows for each embedded id
    second: np.ndarray  # (H, K)
    second_bias: np.ndarray  # (K,)

    def __call__(self, numeric: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """(N, K) scores from raw numeric features (N, numeric) and embedding rows (N, token columns)."""
        hidden = numeric @ self.numeric + self.bias
        for column, table in enumerate(self.tables):
            hidden += table[ids[:, column]]
        return np.maximum(hidden, 0.0) @ self.second + self.second_bias


class StepModel(nn.Module):
    """(N, F) features -> (N, K) scores of the candidates (minus the regret it predicts for each)."""

    def __init__(self, config: StepModelConfig) -> None:
        super().__init__()
        self.config = config
        spec = config.features
        width = len(spec.names)
        self.register_buffer("feature_mean", torch.zeros(width))
        self.register_buffer("feature_scale", torch.ones(width))
        self._tokens = spec.token_columns
        self._load = spec.load_column
        self._numeric = [i for i in range(width) if i not in self._tokens and i != self._load]
        # One embedding row past the vocabulary for NO_TOKEN (and any id outside it).
        self.token_embedding = nn.Embedding(config.vocab_size + 1, config.token_dims)
        inputs = len(self._numeric) + len(self._tokens) * config.token_dims

        def mlp() -> nn.Sequential:
            return nn.Sequential(
                nn.Linear(inputs, config.hidden_size), nn.ReLU(), nn.Linear(config.hidden_size, len(config.candidates))
            )

        if config.loads:
            self.heads = nn.ModuleList(mlp() for _ in config.loads)
        else:
            self.net = mlp()
        self._folded_heads: list[FoldedHead] = []
        self._folded_from: list[torch.Tensor] = []  # the weights `_folded_heads` was built from, at these versions
        self._folded_versions: tuple[int, ...] = ()

    @torch.no_grad()
    def standardize(self, features: np.ndarray) -> StepModel:
        """Center and scale every numeric feature by its mean and standard deviation over `features` (N, F), the
        training cycles (a feature constant over them keeps scale 1). The raw features span unlike ranges
        (probabilities, log cursor, log b0); unscaled, a fit with a varying prior stalled on a worse policy."""
        x = torch.as_tensor(np.asarray(features, dtype=np.float32))
        if x.ndim != 2 or x.shape[1] != len(self.feature_mean) or x.shape[0] == 0:
            raise ValueError(f"standardize needs (N >= 1, {len(self.feature_mean)}) features, got {tuple(x.shape)}")
        spread = x.std(dim=0, unbiased=False)
        self.feature_mean.copy_(x.mean(dim=0))
        self.feature_scale.copy_(torch.where(spread > 1e-6, spread, torch.ones_like(spread)))
        self.feature_mean[self._tokens] = 0.0
        self.feature_scale[self._tokens] = 1.0
        return self

    def _heads_of_rows(self, features: np.ndarray) -> np.ndarray:
        """(N,) the head (index into `config.loads`) of each row of `features` (N, F): its batch size's nearest
        load, the rule that prices a cycle at that batch (`nearest_batch_size`)."""
        loads = self.config.loads
        rows = np.rint(np.exp(features[:, self._load].astype(np.float64))).astype(np.int64)
        distinct, inverse = np.unique(rows, return_inverse=True)
        return np.asarray([loads.index(nearest_batch_size(loads, int(n))) for n in distinct])[inverse.reshape(-1)]

    def _token_ids(self, features: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """(N, 2) the token columns of `features` (N, F) as embedding rows (`embedding_rows`)."""
        return embedding_rows(features[:, self._tokens], self.config.vocab_size)

    def _inputs(self, features: torch.Tensor) -> torch.Tensor:
        """The MLP's input: the numeric features standardized, then the token columns' embeddings."""
        x = ((features - self.feature_mean) / self.feature_scale)[:, self._numeric]
        return torch.cat([x, self.token_embedding(self._token_ids(features)).flatten(1)], dim=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self._inputs(features)
        if not self.config.loads:
            return self.net(x)
        heads = torch.as_tensor(self._heads_of_rows(features.detach().cpu().numpy()), device=features.device)
        out = x.new_zeros(x.shape[0], len(self.config.candidates))
        for index, head in enumerate(self.heads):
            rows = (heads == index).nonzero().flatten()
            if rows.numel():
                out = out.index_copy(0, rows, head(x[rows]))
        return out

    def choose(self, features: np.ndarray) -> np.ndarray:
        """(N,) the index of the best-scored candidate for each row of `features` (N, F): `forward`'s argmax, by
        its folded form (`_folded`)."""
        features = np.asarray(features, dtype=np.float32)
        heads, numeric, ids = self._folded(), features[:, self._numeric], self._token_ids(features)
        if not self.config.loads:
            return heads[0](numeric, ids).argmax(axis=1)
        scores = np.empty((len(features), len(self.config.candidates)), dtype=np.float32)
        of_row = self._heads_of_rows(features)
        for index, head in enumerate(heads):
            rows = of_row == index
            if rows.any():
                scores[rows] = head(numeric[rows], ids[rows])
        return scores.argmax(axis=1)

    def folded_head(self, batch_rows: int) -> FoldedHead:
        """The `FoldedHead` of the MLP that chooses for rows in batches of `batch_rows` (a load-aware model's head of
        the nearest load)."""
        loads = self.config.loads
        return self._folded()[loads.index(nearest_batch_size(loads, batch_rows)) if loads else 0]

    @property
    def numeric_names(self) -> tuple[str, ...]:
        """The names of the columns a `FoldedHead` reads as numbers (its `numeric` rows), in order."""
        return tuple(self.config.features.names[i] for i in self._numeric)

    def _folded(self) -> list[FoldedHead]:
        """`forward` at eval time in numpy, one `FoldedHead` per head: a live decision (one row, before every cycle)
        costs a few numpy calls instead of a dozen torch ones (36 against 127 us a cycle inside the static engine's
        loop on the CPU, docs/log.md). Rebuilt when a weight changes in place (a tensor's version counts its
        in-place writes: an optimizer step, `load_state_dict`)."""
        if self._folded_heads and self._folded_versions == tuple(t._version for t in self._folded_from):
            return self._folded_heads

        def array(t: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(t.float().cpu().numpy())

        numeric, dims = self._numeric, self.config.token_dims
        mean, scale = (t.detach().double()[numeric] for t in (self.feature_mean, self.feature_scale))
        embedding = self.token_embedding.weight.detach().double()
        self._folded_heads = []
        for mlp in self.heads if self.config.loads else [self.net]:
            first, first_bias, second, second_bias = (t.detach().double() for t in mlp.parameters())
            weights = first[:, : len(numeric)] / scale  # (H, numeric features): (x - mean) / scale folded in
            tokens = first[:, len(numeric) :].reshape(len(first), len(self._tokens), dims)  # (H, columns, dims)
            tables = tuple(array(embedding @ tokens[:, j].T) for j in range(len(self._tokens)))
            folded = FoldedHead(
                array(weights.T), array(first_bias - weights @ mean), tables, array(second.T), array(second_bias)
            )
            self._folded_heads.append(folded)
        self._folded_from = [*self.parameters(), *self.buffers()]
        self._folded_versions = tuple(t._version for t in self._folded_from)
        return self._folded_heads

    def save(self, directory: str | Path) -> Path:
        return save_weights_folder(directory, self.config.to_dict(), self.state_dict())

    @classmethod
    def load(cls, directory: str | Path) -> StepModel:
        config, state = load_weights_folder(directory, "step model")
        if config.get("kind") != "step":
            raise ValueError(f"{str(directory)!r} holds a {config.get('kind', 'per-request')!r} model, not a step model")
        model = cls(StepModelConfig.from_dict(config))
        model.load_state_dict(state)
        return model.eval()


def load_step_model(path_or_uri: str | Path) -> StepModel:
    """A step model from a folder or an MLflow model URI (`models:/blockpilot-step-policy@champion`)."""
    from blockpilot.predictor.store import resolve_predictor_dir

    return StepModel.load(resolve_predictor_dir(path_or_uri))


def regret_loss(scores: torch.Tensor, regret: torch.Tensor) -> torch.Tensor:
    """The squared error of the model's scores (N, K) as minus the regret (N, K) of every candidate, plus the regret
    expected under softmax(scores), both averaged over rows.

    The expected regret alone is what a policy pays, but it has plateaus where the softmax is sure, and its fits
    landed on one of two policies by seed. The regression alone is stable, but where the candidates' regrets differ
    by less than its error (a flat price) it chose worse than one fixed b. Together: the regression ties the scores
    to the regrets' scale, the expected regret orders the close ones (docs/log.md, "The regret a step model learns")."""
    squared = ((scores + regret) ** 2).mean()
    return squared + (torch.softmax(scores, dim=-1) * regret).sum(dim=-1).mean()


def fit_step_model(
    model: StepModel,
    features: np.ndarray,
    regret: np.ndarray,
    *,
    epochs: int = 20,
    batch_size: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    first_epoch: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    on_epoch: Any = None,
) -> StepModel:
    """Minimize `regret_loss` with AdamW (or `optimizer`); `on_epoch(epoch, loss)` after each epoch. A NaN
    loss stops. A fit from epoch 0 first standardizes the model's inputs on `features`. An interrupted fit
    continues exactly from `first_epoch` with the model (standardization included) and optimizer state it had
    saved after the epoch before: the shuffles of the skipped epochs are drawn again, not used."""
    if not 0 <= first_epoch <= epochs:
        raise ValueError(f"first_epoch must be within [0, {epochs}], got {first_epoch}")
    if first_epoch == 0:
        model.standardize(features)
    generator = torch.Generator().manual_seed(seed)
    x, r = (torch.as_tensor(np.asarray(a, dtype=np.float32)) for a in (features, regret))
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for epoch in range(epochs):
        order, total = torch.randperm(len(x), generator=generator), 0.0
        if epoch < first_epoch:
            continue
        for start in range(0, len(x), batch_size):
            index = order[start : start + batch_size]
            loss = regret_loss(model(x[index]), r[index])
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step model loss is {loss.item()} at epoch {epoch}")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(index)
        if on_epoch is not None:
            on_epoch(epoch, total / len(x))
    return model.eval()
