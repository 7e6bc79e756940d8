"""The per-step block-size model: before every cycle, one of the candidate block sizes, from what the last
verify pass already computed.

Features of the cycle at cursor i (the block's first token is g_{i-1}; nothing extra is computed for them):
- at the anchor (`ANCHOR_FEATURES`, kept in the labels for every cursor): the target's distribution that
  produced g_{i-1} (its entropy and top-`ANCHOR_TOP_K` probabilities; at the first cycle that is the prefill's
  distribution), the sampling temperature, and log(1 + i);
- the last cycle (`HISTORY_FEATURES`): log(1 + a) and a / b of its acceptance length a and block size b (both
  0 before the first cycle);
- with a per-request prior, log(b0), b0 the per-request predictor's choice for the request (which also drafts
  the first cycle: `PriorStepPolicy`), and its probability of every candidate (computed once per request);
- with token features (`TOKEN_FEATURES`), the block's first token g_{i-1} and the one before it (none at the first
  cycle), each through a learned embedding: where the generation is (a separator, the middle of a number, a
  copied span) says how far the drafter will be right, and the anchor's distribution does not say it;
- for a load-aware model (`StepModelConfig.loads`), log of the rows in the batch the cycle runs in: what a wider
  block costs depends on the load (`CycleCost`), so the model learns its choice at every measured batch size and
  follows the live batch as it fills and thins.

Labels: Q(i, b) of `AcceptanceTable.cost_to_go` under a cycle cost (committed tokens per unit cost is what
is maximized); for a load-aware model, under the cost at each of its batch sizes, every cycle once per load.
The last cycle depends on the path to cursor i, so the training examples are the cycles of every candidate's
fixed-b walk over each table, each with the last cycle that walk ran. The model learns each candidate's regret there,
Q(i, b) - min_b Q(i, b), the cost the choice adds over the per-step oracle's (`regret_dataset`: along any walk the
regrets add up to its excess cost; `regret_loss`); the policy takes the candidate with the least predicted
regret. Evaluation walks each held-out table cycle by cycle with the model's choices (`walk_step_model`) beside
fixed B, the best fixed b, the static oracle and the per-step oracle, and checks what of the static oracle's margin
is hindsight (`_put_split_half`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from blockpilot.checks import distinct_block_sizes, positive_int
from blockpilot.cost import CycleCost, nearest_batch_size
from blockpilot.data.labels import ANCHOR_TOP_K
from blockpilot.decoding.policies import (
    BlockSizePolicy,
    CycleState,
    PrefillState,
    distribution_summary,
    initial_block_sizes,
)
from blockpilot.files import load_weights_folder, save_weights_folder
from blockpilot.scoring import format_table
from blockpilot.table import AcceptanceTable, tables_from_row
from blockpilot.trim import TrimCalibration, walk_trim

ANCHOR_FEATURES = ("entropy", *(f"top{k + 1}" for k in range(ANCHOR_TOP_K)), "temperature", "log_cursor")
HISTORY_FEATURES = ("log1p_last_accepted", "last_accepted_share")
STEP_FEATURES = (*ANCHOR_FEATURES, *HISTORY_FEATURES)
PRIOR_FEATURE = "log_prior_b"  # log of the per-request predictor's block size for the request
LOAD_FEATURE = "log_batch_rows"  # log of the rows in the batch the cycle runs in (load-aware models)
# Token ids (exact in float32 up to 2^24), read through the model's embedding, not standardized.
TOKEN_FEATURES = ("anchor_token", "previous_token")
NO_TOKEN = -1  # the token before the first block's first one: there is none in the generation


def prior_probability_features(candidates: tuple[int, ...]) -> tuple[str, ...]:
    """The per-request predictor's probability of each candidate, as step features. The predictor's choice alone
    says which b it prefers, not how firmly; under load, where a wrong b costs more, the step model drafts
    better with both (small zoo, batch-32 cost: +2 to 3% modeled throughput)."""
    return tuple(f"prior_p_b{b}" for b in candidates)
STEP_COLUMNS = ["prompt_id", "temperature", "candidates", "train_block_size", "max_new_tokens"]
STEP_COLUMNS += ["table_commits", "table_anchors", "anchor_entropy", "anchor_top_probs"]
TOKEN_COLUMNS = ["table_tokens", "vocab_size"]  # what token features need besides; labels before them lack these
TRIM_COLUMNS = ["table_confidences"]  # what walking draft-then-trim needs besides; labels before them lack it


def anchor_tokens(generated: np.ndarray, cursors: np.ndarray) -> np.ndarray:
    """(N, 2) token features of the cycles at `cursors` (N,): the block's first token g_{i-1} and the one before it
    g_{i-2} (`NO_TOKEN` at cursor 1), from the generated sequence g_0.. (at least up to g_{i-1})."""
    generated, cursors = np.asarray(generated, dtype=np.int64), np.asarray(cursors, dtype=np.int64)
    before = np.where(cursors >= 2, generated[np.maximum(cursors - 2, 0)], NO_TOKEN)
    return np.stack([generated[cursors - 1], before], axis=1)


def tail_tokens(tails: Sequence[Sequence[int]]) -> np.ndarray:
    """(N, 2) `anchor_tokens` of N live rows from the tails of their generations (each ending at the block's first
    token): a tail of one token is the generation's first (cursor 1), with no token before it."""
    if not all(tails):
        raise ValueError("every row's generation tail needs its block's first token")
    padded = np.asarray([(NO_TOKEN, tail[0]) if len(tail) == 1 else tuple(tail[-2:]) for tail in tails], dtype=np.int64)
    return padded[:, ::-1]


def anchor_features(
    entropy: np.ndarray, top_probs: np.ndarray, temperature: float | np.ndarray, cursor: np.ndarray
) -> np.ndarray:
    """(N, len(ANCHOR_FEATURES)) of N cycles: entropy (N,), top probabilities (N, >= ANCHOR_TOP_K), cursor (N,)."""
    # Filled in place, not stacked: the engine calls this once per row and cycle, where numpy's stacking
    # helpers cost more than the arithmetic.
    entropy = np.asarray(entropy, dtype=np.float32)
    out = np.empty((entropy.shape[0], len(ANCHOR_FEATURES)), dtype=np.float32)
    out[:, 0] = entropy
    out[:, 1 : 1 + ANCHOR_TOP_K] = np.asarray(top_probs)[:, :ANCHOR_TOP_K]
    out[:, 1 + ANCHOR_TOP_K] = temperature
    out[:, 2 + ANCHOR_TOP_K] = np.log1p(np.asarray(cursor, dtype=np.float32))
    return out


def step_features(
    anchors: np.ndarray,  # (N, len(ANCHOR_FEATURES))
    last_accepted: np.ndarray | int,  # (N,) the last cycle's acceptance length; 0 before the first cycle
    last_block_size: np.ndarray | int,  # (N,) the last cycle's b; 0 before the first cycle
    prior_block_size: np.ndarray | int | None = None,  # (N,) or one b0 for every cycle
    prior_probabilities: np.ndarray | None = None,  # (K,) or (N, K) the per-request predictor's, with its b0
    batch_rows: np.ndarray | int | None = None,  # (N,) or one load: the rows in each cycle's batch
    tokens: np.ndarray | None = None,  # (N, 2) `anchor_tokens` of each cycle
) -> np.ndarray:
    """(N, F) features of N cycles: the anchor's, the last cycle's, and with a per-request prior b0, log(b0)
    (then the prior's probability of every candidate, when given); then the token features when given; last,
    log(batch rows) when given."""
    if prior_probabilities is not None and prior_block_size is None:
        raise ValueError("prior probabilities come with the prior's block size b0")
    n, width = anchors.shape
    prior_probabilities = None if prior_probabilities is None else np.asarray(prior_probabilities, dtype=np.float32)
    extra = (prior_block_size is not None) + (prior_probabilities.shape[-1] if prior_probabilities is not None else 0)
    extra += (batch_rows is not None) + (len(TOKEN_FEATURES) if tokens is not None else 0)
    out = np.empty((n, width + len(HISTORY_FEATURES) + extra), dtype=np.float32)
    accepted = np.asarray(last_accepted, dtype=np.float32)
    size = np.asarray(last_block_size, dtype=np.float32)
    out[:, :width] = anchors
    out[:, width] = np.log1p(accepted)
    out[:, width + 1] = np.where(size > 0, accepted / np.maximum(size, 1.0), 0.0)
    if prior_block_size is not None:
        out[:, width + 2] = np.log(np.asarray(prior_block_size, dtype=np.float32))
    if prior_probabilities is not None:
        out[:, width + 3 : width + 3 + prior_probabilities.shape[-1]] = prior_probabilities
    if tokens is not None:
        start = out.shape[1] - len(TOKEN_FEATURES) - (batch_rows is not None)
        out[:, start : start + len(TOKEN_FEATURES)] = np.asarray(tokens, dtype=np.float32).reshape(n, -1)
    if batch_rows is not None:
        out[:, -1] = np.log(np.asarray(batch_rows, dtype=np.float32))
    return out


@dataclass(frozen=True)
class StepModelConfig:
    candidates: tuple[int, ...]
    hidden_size: int = 64
    train_block_size: int | None = None
    target_id: str = ""
    drafter_id: str = ""
    features: tuple[str, ...] = STEP_FEATURES
    loads: tuple[int, ...] = ()  # a load-aware model: the batch sizes it was trained at (LOAD_FEATURE last)
    vocab_size: int = 0  # with TOKEN_FEATURES: the target's vocabulary (ids past it read as NO_TOKEN)
    token_dims: int = 8  # with TOKEN_FEATURES: the embedding's width per token
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", distinct_block_sizes(int(b) for b in self.candidates))
        object.__setattr__(self, "loads", distinct_block_sizes(self.loads, "loads") if self.loads else ())
        positive_int(self.hidden_size, "hidden_size")
        with_prior = (*STEP_FEATURES, PRIOR_FEATURE)
        load = (LOAD_FEATURE,) if self.loads else ()
        bases = (STEP_FEATURES, with_prior, (*with_prior, *self.prior_probability_features))
        allowed = [(*base, *tokens, *load) for base in bases for tokens in ((), TOKEN_FEATURES)]
        if tuple(self.features) not in allowed:
            raise ValueError(
                f"step model features {list(self.features)} are not this version's {list(STEP_FEATURES)} "
                f"(+ {PRIOR_FEATURE!r} with a per-request prior, and + {list(self.prior_probability_features)}; "
                f"+ {list(TOKEN_FEATURES)}; "
                f"+ {LOAD_FEATURE!r} last when, and only when, the model has loads: {list(self.loads)})"
            )
        if self.uses_tokens:
            positive_int(self.vocab_size, "vocab_size (a model with token features)")
            positive_int(self.token_dims, "token_dims")

    @property
    def prior_probability_features(self) -> tuple[str, ...]:
        return prior_probability_features(self.candidates)

    @property
    def uses_prior(self) -> bool:
        """Whether the model reads the per-request predictor's choice (and so needs one beside it)."""
        return PRIOR_FEATURE in self.features

    @property
    def uses_prior_probabilities(self) -> bool:
        """Whether it also reads the predictor's probability of every candidate."""
        return self.uses_prior and self.prior_probability_features[0] in self.features

    @property
    def uses_tokens(self) -> bool:
        """Whether it reads the block's first token and the one before it (`anchor_tokens`)."""
        return TOKEN_FEATURES[0] in self.features

    @property
    def uses_load(self) -> bool:
        """Whether it reads the rows in the cycle's batch (and was trained at every batch size of `loads`)."""
        return bool(self.loads)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "candidates": list(self.candidates),
            "features": list(self.features),
            "loads": list(self.loads),
            "kind": "step",
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StepModelConfig:
        raw = {k: v for k, v in raw.items() if k != "kind"}
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"step model config: unknown fields {sorted(unknown)}")
        return cls(
            **{
                **raw,
                "candidates": tuple(raw["candidates"]),
                "features": tuple(raw["features"]),
                "loads": tuple(raw.get("loads", ())),
            }
        )


class StepModel(nn.Module):
    """(N, F) features -> (N, K) scores of the candidates, minus the regret it predicts for each (`regret_loss`): the
    features standardized (`standardize`; the identity until then), then an MLP with one hidden layer.

    A load-aware model has one such MLP per load (`heads`, in `config.loads` order) instead of `net`: each row goes
    to the head of its batch size's nearest load (the rule that prices it, `nearest_batch_size`), which reads the
    other features. One MLP fed log(batch rows) as an input did not learn the loads apart: on the mini zoo's
    tables, priced at batch 32, it chose as at batch 8 (128.3 modeled against 135.4 for a model trained at 32)."""

    def __init__(self, config: StepModelConfig) -> None:
        super().__init__()
        self.config = config
        width = len(config.features)
        self.register_buffer("feature_mean", torch.zeros(width))
        self.register_buffer("feature_scale", torch.ones(width))
        tokens = [config.features.index(name) for name in TOKEN_FEATURES] if config.uses_tokens else []
        # The standardized columns the MLP reads: all but the token ids (embedded) and the load (it picks the head).
        self._numeric = [i for i in range(width - config.uses_load) if i not in tokens]
        self._tokens = tokens
        inputs = len(self._numeric)
        if config.uses_tokens:
            # One row past the vocabulary for NO_TOKEN (and any id outside it).
            self.token_embedding = nn.Embedding(config.vocab_size + 1, config.token_dims)
            inputs += len(tokens) * config.token_dims

        def mlp() -> nn.Sequential:
            return nn.Sequential(
                nn.Linear(inputs, config.hidden_size), nn.ReLU(), nn.Linear(config.hidden_size, len(config.candidates))
            )

        if config.uses_load:
            self.heads = nn.ModuleList(mlp() for _ in config.loads)
        else:
            self.net = mlp()

    def _head_of_row(self, features: np.ndarray) -> np.ndarray:
        """(N,) the head (index into `config.loads`) of each row, from its raw log(batch rows) feature."""
        loads = self.config.loads
        rows = np.rint(np.exp(np.asarray(features, dtype=np.float64)[:, -1])).astype(np.int64)
        # A training batch holds a few distinct loads: the rule runs once per distinct value, not per row.
        distinct, inverse = np.unique(rows, return_inverse=True)
        heads = np.asarray([loads.index(nearest_batch_size(loads, int(n))) for n in distinct], dtype=np.int64)
        return heads[inverse.reshape(-1)]

    @torch.no_grad()
    def standardize(self, features: np.ndarray) -> StepModel:
        """Center and scale every input feature by its mean and standard deviation over `features` (N, F), the
        training cycles (a feature constant over them keeps scale 1). The raw features span unlike ranges
        (probabilities, log cursor, log b0 within [log 4, log 8]); unscaled, a fit with a varying prior stalled on
        a worse policy than without one."""
        x = torch.as_tensor(np.asarray(features, dtype=np.float32))
        if x.ndim != 2 or x.shape[1] != len(self.config.features) or x.shape[0] == 0:
            raise ValueError(
                f"standardize needs (N >= 1, {len(self.config.features)}) features, got {tuple(x.shape)}"
            )
        spread = x.std(dim=0, unbiased=False)
        self.feature_mean.copy_(x.mean(dim=0))
        self.feature_scale.copy_(torch.where(spread > 1e-6, spread, torch.ones_like(spread)))
        self.feature_mean[self._tokens] = 0.0  # ids are looked up, not scaled
        self.feature_scale[self._tokens] = 1.0
        return self

    def _token_rows(self, features: np.ndarray) -> np.ndarray:
        """(N, len(TOKEN_FEATURES)) embedding rows of the raw token features: the id, or the last row for NO_TOKEN
        and ids outside the vocabulary."""
        ids = np.rint(np.asarray(features, dtype=np.float64)[:, self._tokens]).astype(np.int64)
        vocab = self.config.vocab_size
        return np.where((ids >= 0) & (ids < vocab), ids, vocab)

    def _inputs(self, features: torch.Tensor) -> torch.Tensor:
        """(N, inputs) what an MLP reads: the standardized features, then the token embeddings."""
        x = ((features - self.feature_mean) / self.feature_scale)[:, self._numeric]
        if not self.config.uses_tokens:
            return x
        rows = torch.as_tensor(self._token_rows(features.detach().cpu().numpy()), device=features.device)
        return torch.cat([x, self.token_embedding(rows).flatten(1)], dim=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self._inputs(features)
        if not self.config.uses_load:
            return self.net(x)
        heads = torch.as_tensor(self._head_of_row(features.detach().cpu().numpy()), device=features.device)
        out = x.new_zeros(x.shape[0], len(self.config.candidates))
        for index, head in enumerate(self.heads):
            rows = (heads == index).nonzero().flatten()
            if rows.numel():
                out = out.index_copy(0, rows, head(x[rows]))
        return out

    def choose(self, features: np.ndarray) -> np.ndarray:
        """(N,) chosen candidate index per row of `features`: the argmax of `forward`, in numpy over views of
        the current weights. The engine asks once per row and cycle, and torch's per-call overhead on a
        one-row MLP (about 0.1 ms) was a third of the decision."""
        mean, scale = (b.detach().cpu().numpy() for b in (self.feature_mean, self.feature_scale))
        features = np.asarray(features, dtype=np.float32)
        x = ((features - mean) / scale)[:, self._numeric]
        if self.config.uses_tokens:
            table = self.token_embedding.weight.detach().cpu().numpy()
            x = np.concatenate([x, table[self._token_rows(features)].reshape(len(x), -1)], axis=1)
        if not self.config.uses_load:
            return _mlp_outputs(self.net, x).argmax(axis=-1)
        heads = self._head_of_row(features)
        out = np.empty(x.shape[0], dtype=np.int64)
        for index in np.unique(heads):
            rows = heads == index
            out[rows] = _mlp_outputs(self.heads[int(index)], x[rows]).argmax(axis=-1)
        return out

    def save(self, directory: str | Path) -> Path:
        return save_weights_folder(directory, self.config.to_dict(), self.state_dict())

    @classmethod
    def load(cls, directory: str | Path) -> StepModel:
        config, state = load_weights_folder(directory, "step model")
        if config.get("kind") != "step":
            raise ValueError(f"{str(directory)!r} holds a {config.get('kind', 'per-request')!r} model, not a step model")
        model = cls(StepModelConfig.from_dict(config))
        # Folders saved before the standardization existed were fitted on raw features: the identity keeps them.
        state.setdefault("feature_mean", torch.zeros_like(model.feature_mean))
        state.setdefault("feature_scale", torch.ones_like(model.feature_scale))
        model.load_state_dict(state)
        return model.eval()


def _mlp_outputs(mlp: nn.Sequential, x: np.ndarray) -> np.ndarray:
    """The outputs of a one-hidden-layer MLP in numpy, over views of its weights."""
    first, _, second = mlp
    weights = [p.detach().cpu().numpy() for p in (first.weight, first.bias, second.weight, second.bias)]
    hidden = np.maximum(x @ weights[0].T + weights[1], 0.0)
    return hidden @ weights[2].T + weights[3]


def load_step_model(path_or_uri: str | Path) -> StepModel:
    """A step model from a folder or an MLflow model URI (`models:/blockpilot-step-policy@champion`)."""
    from blockpilot.predictor.store import resolve_predictor_dir

    return StepModel.load(resolve_predictor_dir(path_or_uri))


class StepPolicy:
    """b at every cycle from the step model; the first cycle from the prefill's distribution, or from the
    per-request policy `prior` when one is given."""

    name = "learned-step"

    def __init__(self, model: StepModel, prior: BlockSizePolicy | None = None) -> None:
        if model.config.uses_prior and prior is None:
            raise ValueError(
                "this step model was trained with a per-request prior: use it beside that predictor "
                "(learned+step:PREDICTOR,STEP_MODEL)"
            )
        if model.config.uses_prior_probabilities and not callable(getattr(prior, "probabilities", None)):
            raise ValueError(
                f"this step model reads the per-request predictor's probabilities; the prior {prior!r} has none "
                "(use a trained predictor: learned+step:PREDICTOR,STEP_MODEL)"
            )
        self.model = model
        self.candidates = model.config.candidates
        self.prior = prior

    def _choose(
        self,
        logits: torch.Tensor,  # (N, V) the anchor distributions
        temperature: np.ndarray | float,  # (N,)
        cursor: np.ndarray,  # (N,)
        last_accepted: np.ndarray | int = 0,  # (N,)
        last_block_size: np.ndarray | int = 0,  # (N,)
        prior_block_size: np.ndarray | int | None = None,  # (N,) each row's b0
        prefills: list[PrefillState | None] | None = None,
        batch_rows: np.ndarray | int = 1,  # (N,) the rows in each one's batch
        recent_tokens: Sequence[Sequence[int]] = (),  # N generation tails, each ending at the block's first token
    ) -> list[int]:
        """The candidate the model picks for each of N rows, from one summary of their distributions, one
        device-to-host read and one model call."""
        entropy, _, top_probs = distribution_summary(logits, ANCHOR_TOP_K)
        summary = torch.cat([entropy[:, None], top_probs], dim=1).cpu().numpy()
        anchor = anchor_features(summary[:, 0], summary[:, 1:], temperature, cursor)
        config = self.model.config
        prior = prior_block_size if config.uses_prior else None
        probabilities = None
        if config.uses_prior_probabilities:
            if prefills is None or any(prefill is None for prefill in prefills):
                raise ValueError("this step model reads the per-request predictor's probabilities: give the prefill")
            probabilities = np.stack([self.prior.probabilities(prefill) for prefill in prefills])
        load = batch_rows if config.uses_load else None
        tokens = None
        if config.uses_tokens:
            if len(recent_tokens) != len(summary):
                raise ValueError("this step model reads the block's first tokens: give every row's recent tokens")
            tokens = tail_tokens(recent_tokens)
        features = step_features(anchor, last_accepted, last_block_size, prior, probabilities, load, tokens)
        return [self.candidates[int(k)] for k in self.model.choose(features)]

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.initial_block_sizes([prefill])[0]

    def initial_block_sizes(self, prefills: Sequence[PrefillState]) -> list[int]:
        """The first b of every joining request, in one call of the prior or of the model."""
        if self.prior is not None:
            return initial_block_sizes(self.prior, prefills)
        logits = torch.stack([prefill.next_token_logits for prefill in prefills])
        temperatures = np.asarray([prefill.temperature for prefill in prefills], dtype=np.float32)
        rows = np.asarray([prefill.batch_rows for prefill in prefills])
        firsts = [() if prefill.first_token is None else (prefill.first_token,) for prefill in prefills]
        return self._choose(logits, temperatures, np.ones(len(prefills)), batch_rows=rows, recent_tokens=firsts)

    def next_block_size(self, cycle: CycleState) -> int:
        return self.next_block_sizes([cycle])[0]

    def next_block_sizes(self, cycles: Sequence[CycleState]) -> list[int]:
        """The next b of every row that shares this policy, in one model call (the engine's batched hook)."""
        out = [cycle.block_size for cycle in cycles]
        deciding = [i for i, cycle in enumerate(cycles) if cycle.anchor_logits is not None]
        if not deciding:
            return out
        chosen = [cycles[i] for i in deciding]

        def column(name: str) -> np.ndarray:
            return np.asarray([getattr(cycle, name) for cycle in chosen])

        # After a cycle the row holds `new_tokens` tokens: the next block's cursor.
        sizes = self._choose(
            torch.stack([cycle.anchor_logits for cycle in chosen]),
            column("temperature"),
            column("new_tokens"),
            column("acceptance_length"),
            column("block_size"),
            column("first_block_size") if self.model.config.uses_prior else None,
            [cycle.prefill for cycle in chosen],
            column("batch_rows"),
            [cycle.recent_tokens for cycle in chosen],
        )
        for i, size in zip(deciding, sizes, strict=True):
            out[i] = size
        return out


class PriorStepPolicy(StepPolicy):
    """The per-request predictor drafts the first cycle (its b0, from the prefill); the step model picks b
    before every later cycle, reading b0 as a feature when it was trained with one."""

    name = "learned+step"

    def __init__(self, model: StepModel, prior: BlockSizePolicy) -> None:
        super().__init__(model, prior)


# ----------------------------------------------------------------------------- data from label rows


@dataclass
class StepRow:
    """One label row's tables with the anchor features of every cursor (samples in table order)."""

    prompt_id: str
    temperature: float
    tables: list[AcceptanceTable]
    anchors: list[np.ndarray]  # per table, (n - 1, len(ANCHOR_FEATURES)): row i - 1 is cursor i
    prior_block_size: int | None = None  # the per-request predictor's b0 for the row, when there is one
    prior_probabilities: np.ndarray | None = None  # (K,) its probability of every candidate


def step_rows(table: pa.Table, prior: Any | None = None) -> list[StepRow]:
    """Label rows with acceptance tables and anchor features as `StepRow`s; rows without them are skipped.
    With a per-request predictor `prior` (a `BlockSizePredictor`), each row carries b0, its choice from the
    row's prefill distribution, and its probabilities over the candidates."""
    missing = [c for c in STEP_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"labels lack the columns a step model needs: {missing} (relabel with this version)")
    table = table.filter(pc.and_(pc.is_valid(table["table_commits"]), pc.is_valid(table["anchor_entropy"])))
    priors = _prior_choices(prior, table) if prior is not None else [(None, None)] * table.num_rows
    columns = STEP_COLUMNS + [c for c in TOKEN_COLUMNS + TRIM_COLUMNS if c in table.column_names]
    out = []
    for row, (b0, probabilities) in zip(table.select(columns).to_pylist(), priors, strict=True):
        tables = tables_from_row(row)
        if not tables:
            continue
        entropy = np.asarray(row["anchor_entropy"], dtype=np.float32)
        top = np.asarray(row["anchor_top_probs"], dtype=np.float32).reshape(len(entropy), -1)
        anchors, start = [], 0
        for t in tables:
            span = slice(start, start + t.n - 1)
            anchors.append(anchor_features(entropy[span], top[span], row["temperature"], np.arange(1, t.n)))
            start += t.n - 1
        if start != len(entropy):
            raise ValueError(f"row {row['prompt_id']!r}: {len(entropy)} anchor features for {start} table anchors")
        out.append(StepRow(row["prompt_id"], float(row["temperature"]), tables, anchors, b0, probabilities))
    if not out:
        raise ValueError("no label row carries an acceptance table with anchor features (label with --mode replay)")
    return out


def _prior_choices(predictor: Any, table: pa.Table) -> list[tuple[int, np.ndarray]]:
    """The per-request predictor's b0 and probabilities over the candidates (K,) for every row of `table`, from
    the rows' prefill columns."""
    from blockpilot.predictor.inputs import DENSE_COLUMN, INPUT_COLUMNS, PredictorInputs, input_arrays

    candidates = {tuple(c) for c in table["candidates"].to_pylist()}
    if candidates != {tuple(predictor.config.candidates)}:
        raise ValueError(
            f"the per-request predictor's candidates {list(predictor.config.candidates)} are not the labels' "
            f"{[list(c) for c in sorted(candidates)]}"
        )
    dense = predictor.config.kind == "dense"
    columns = table.select([*INPUT_COLUMNS, *([DENSE_COLUMN] if dense else [])]).to_pydict()
    inputs = PredictorInputs.from_arrays(input_arrays(columns, dense))
    return list(zip(*predictor.decide(inputs), strict=True))


def fixed_walk_cycles(table: AcceptanceTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every cycle of every candidate's fixed-b walk over `table`: (cursor, last acceptance length, last b)
    per cycle, each (M,), M = the cycles of all walks; (0, 0) before a walk's first cycle."""
    cursors, last_accepted, last_sizes = [], [], []
    for b in table.candidates:
        cursor, accepted, size = 1, 0, 0
        for step in table.walk(b):
            cursors.append(cursor)
            last_accepted.append(accepted)
            last_sizes.append(size)
            cursor, accepted, size = cursor + step, step, b
    return np.asarray(cursors, dtype=np.int64), np.asarray(last_accepted), np.asarray(last_sizes)


def regret_dataset(
    rows: list[StepRow], cost: CycleCost, loads: Sequence[int] = (), tokens: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(X (M, F), R (M, K)): the features of every cycle of every candidate's fixed-b walk
    (`fixed_walk_cycles`), and the regret of choosing each candidate there: Q(i, b) - min_b Q(i, b), what the choice
    adds to the cost of the rest of the generation, in cycles of the smallest candidate at the price used. With
    `loads` (a load-aware model), every cycle once per batch size n, priced with c(b, n) and with log(n) as its last
    feature. With `tokens`, the token features of each cycle (`anchor_tokens`; the tables must know their sequences).

    Since Q(i, b) = c(b) + min Q at the cursor the cycle lands on, the regrets of any walk's cycles add up to that
    walk's cost over the per-step oracle's: the mean regret is what a policy loses, cycle for cycle. A relative
    regret, Q / min Q - 1, divides by the cost left to the end, so the last cycles of a sequence outweighed the rest
    (docs/log.md, "The regret a step model learns")."""
    if tokens:
        require_sequences(rows)
    features, regrets = [], []
    for load in loads or (None,):
        priced = cost if load is None else cost.at_batch(load)
        for row in rows:
            for t, anchors in zip(row.tables, row.anchors, strict=True):
                if t.n < 2:
                    continue
                _, q = t.cost_to_go(priced)  # (K, n - 1)
                unit = priced(min(t.candidates))
                cursors, last_accepted, last_sizes = fixed_walk_cycles(t)
                features.append(
                    step_features(
                        anchors[cursors - 1],
                        last_accepted,
                        last_sizes,
                        row.prior_block_size,
                        row.prior_probabilities,
                        load,
                        anchor_tokens(t.tokens, cursors) if tokens else None,
                    )
                )
                regrets.append(((q - q.min(axis=0, keepdims=True)) / unit).T[cursors - 1])
    return np.concatenate(features).astype(np.float32), np.concatenate(regrets).astype(np.float32)


def know_sequences(rows: Sequence[StepRow]) -> bool:
    """Whether every table of `rows` knows its generated sequence (labels from before `table_tokens` do not)."""
    return all(t.tokens is not None for row in rows for t in row.tables)


def require_sequences(rows: list[StepRow]) -> None:
    """Refuse rows whose tables do not know their generated sequences (`know_sequences`)."""
    if not know_sequences(rows):
        raise ValueError("token features need the generated sequences (`table_tokens`): relabel with this version")


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


# ----------------------------------------------------------------------------- evaluation on tables


@dataclass
class _RowWalks:
    """One label row's walks summed over its tables: committed tokens, and cycles and cost of each walk."""

    tokens: float
    fixed_cycles: np.ndarray  # (K,) each candidate's fixed-b walk
    fixed_cost: np.ndarray  # (K,)
    oracle_cycles: float  # the per-step oracle: fewest cycles, and lowest cost
    oracle_cost: float
    # Fixed-b walks over each sequence's halves, each walk starting afresh (`_put_split_half`): (2, K) cost and
    # cycles on the first and the second half, and the second halves' tokens.
    half_cost: np.ndarray
    half_cycles: np.ndarray
    half_tokens: float = 0.0
    step_cycles: float = 0.0  # the step model's walk
    step_cost: float = 0.0
    trim_cycles: float = 0.0  # draft-then-trim's walk
    trim_cost: float = 0.0


def walk_step_model(
    model: StepModel,
    table: AcceptanceTable,
    anchors: np.ndarray,
    prior_block_size: int | None = None,
    prior_probabilities: np.ndarray | None = None,
    batch_rows: int = 1,
) -> tuple[list[int], list[int]]:
    """(block sizes, acceptance lengths) of the step model's walk over `table`, cycle by cycle, as the engine
    runs it: b0 drafts the first cycle when there is one, the model picks every other b from the anchor's
    features (`anchors`, (n - 1, len(ANCHOR_FEATURES))), the last cycle and the prior's features it reads (and
    `batch_rows`, the load, when it is load-aware)."""
    candidates = table.candidates
    if model.config.uses_prior and prior_block_size is None:
        raise ValueError("this step model reads a per-request prior: walk it with the prior's b0")
    if not model.config.uses_prior_probabilities:
        prior_probabilities = None
    elif prior_probabilities is None:
        raise ValueError("this step model reads the per-request predictor's probabilities: walk it with them")

    if model.config.uses_tokens and table.tokens is None:
        raise ValueError("this step model reads the block's first tokens: walk it on a table that knows its sequence")

    def choose(cursor: int, last_size: int | None, last_accepted: int | None) -> int:
        if last_size is None and prior_block_size is not None:
            return prior_block_size
        features = step_features(
            anchors[cursor - 1 : cursor],
            last_accepted or 0,
            last_size or 0,
            prior_block_size if model.config.uses_prior else None,
            prior_probabilities,
            batch_rows if model.config.uses_load else None,
            anchor_tokens(table.tokens, [cursor]) if model.config.uses_tokens else None,
        )
        return candidates[int(model.choose(features)[0])]

    return table.walk_policy(choose)


def _walk_row(
    row: StepRow,
    model: StepModel | None,
    cost: CycleCost,
    load: int,
    trim: TrimCalibration | None = None,
    trim_cost: CycleCost | None = None,  # trim's price; None: `cost`
) -> _RowWalks:
    candidates = row.tables[0].candidates
    count = len(candidates)
    walks = _RowWalks(0.0, np.zeros(count), np.zeros(count), 0.0, 0.0, np.zeros((2, count)), np.zeros((2, count)))
    for t, anchors in zip(row.tables, row.anchors, strict=True):
        walks.tokens += t.n - 1
        middle = (t.n + 1) // 2  # cursors 1..middle - 1 and middle..n - 1: halves of the n - 1 anchors
        if middle > 1:
            walks.half_tokens += t.n - middle
        for k, b in enumerate(candidates):
            cycles = len(t.walk(b))
            walks.fixed_cycles[k] += cycles
            walks.fixed_cost[k] += t.walk_cost([b] * cycles, cost=cost)
            if middle > 1:
                for half, (start, stop) in enumerate(((1, middle), (middle, t.n))):
                    steps = len(t.walk(b, start, stop))
                    walks.half_cycles[half, k] += steps
                    walks.half_cost[half, k] += t.walk_cost([b] * steps, start, cost)
        walks.oracle_cost += t.cost_to_go(cost)[0][1]
        walks.oracle_cycles += t.cost_to_go(CycleCost.uniform())[0][1]
        if model is not None:
            sizes, _ = walk_step_model(model, t, anchors, row.prior_block_size, row.prior_probabilities, load)
            walks.step_cycles += len(sizes)
            walks.step_cost += t.walk_cost(sizes, cost=cost)
        if trim is not None:
            sizes, _ = walk_trim(trim, t)
            walks.trim_cycles += len(sizes)
            walks.trim_cost += sum((trim_cost or cost)(size) for size in sizes)
    return walks


def evaluate_step_model(
    model: StepModel | None,
    rows: list[StepRow],
    cost: CycleCost,
    train_block_size: int | None = None,
    load: int | None = None,
    trim: TrimCalibration | None = None,
) -> dict[str, float]:
    """Per temperature (`T<t>/...`) and over all rows: tau (tokens per cycle) and modeled throughput (tokens
    per unit cost) of fixed B, the best fixed b, the per-request predictor (`request`, when the rows carry its
    b0), the static oracle, the step model (`step`, when given; after b0 when there is one), draft-then-trim
    (`trim`, with its calibration) and the per-step oracle, each walked on the same tables. Fixed B is the model's
    training block size, else `train_block_size`.

    Cycles are priced at `load` rows (`CycleCost.at_batch`), or at the smallest batch size of `cost` without one;
    a load-aware model reads that load. Trim's cycles are priced with its own curve when `trim.cost` is one of
    cycles that draft trim's block D and verify b (`calibrate(drafted=...)`), at the same load; otherwise with
    `cost`, as cycles that draft what they verify, a price that leaves out the drafts trimmed away. Two curves timed
    apart on a machine whose speed drifts may sit at different levels, so trim's curve is put on `cost`'s level
    through the point they share: a trimmed cycle that verifies all D of its drafts is a plain cycle at D."""
    candidates = rows[0].tables[0].candidates
    if model is not None and model.config.candidates != candidates:
        raise ValueError(f"the step model's candidates {list(model.config.candidates)} are not the labels' {list(candidates)}")
    # TrimCalibration refuses a curve of cycles that draft another D than its own.
    trim_cost = trim.cost if trim is not None and trim.cost.drafted is not None else None
    if load is None:
        load = nearest_batch_size(cost.seconds, 1)  # the curve `cost(b)` prices with by default
    else:
        cost = cost.at_batch(load)
        trim_cost = trim_cost.at_batch(load) if trim_cost is not None else None
    if trim_cost is not None:
        trim_cost = trim_cost.scaled(cost(trim.block_size) / trim_cost(trim.block_size))
    walked = [_walk_row(row, model, cost, load, trim, trim_cost) for row in rows]
    train = model.config.train_block_size if model is not None else train_block_size
    metrics: dict[str, float] = {}
    pairs = list(zip(walked, rows, strict=True))
    groups = {"": pairs} | {
        f"T{t:g}/": [(w, r) for w, r in pairs if r.temperature == t] for t in sorted({r.temperature for r in rows})
    }
    for prefix, group in groups.items():
        members = [w for w, _ in group]
        tokens = sum(w.tokens for w in members)

        def put(name: str, spent_cycles: float, spent_cost: float) -> None:
            metrics[f"{prefix}tau_{name}"] = tokens / spent_cycles if spent_cycles else math.nan
            metrics[f"{prefix}throughput_{name}"] = tokens / spent_cost if spent_cost else math.nan

        fixed_cycles, fixed_cost = sum(w.fixed_cycles for w in members), sum(w.fixed_cost for w in members)
        if train in candidates:
            put("B", fixed_cycles[candidates.index(train)], fixed_cost[candidates.index(train)])
        best_fixed = int(np.argmin(fixed_cost))
        put("best_fixed", fixed_cycles[best_fixed], fixed_cost[best_fixed])
        metrics[f"{prefix}best_fixed_b"] = float(candidates[best_fixed])
        static = [int(_cheapest(w.fixed_cost)) for w in members]  # the static oracle: each row's best single b
        put(
            "oracle",
            sum(w.fixed_cycles[k] for w, k in zip(members, static)),
            sum(w.fixed_cost[k] for w, k in zip(members, static)),
        )
        with_prior = [(w, r) for w, r in group if r.prior_block_size is not None]
        if with_prior:  # the per-request predictor's b0, kept for the whole generation
            chosen = [(w, candidates.index(r.prior_block_size)) for w, r in with_prior]
            put("request", sum(w.fixed_cycles[k] for w, k in chosen), sum(w.fixed_cost[k] for w, k in chosen))
        if model is not None:
            put("step", sum(w.step_cycles for w in members), sum(w.step_cost for w in members))
        if trim is not None:
            put("trim", sum(w.trim_cycles for w in members), sum(w.trim_cost for w in members))
        put("step_oracle", sum(w.oracle_cycles for w in members), sum(w.oracle_cost for w in members))
        _put_split_half(metrics, prefix, members)
    return metrics


def _cheapest(costs: np.ndarray) -> np.ndarray:
    """The cheapest candidate along the last axis of (..., K) costs, near-ties to the smaller b."""
    return np.argmin(costs + 1e-9 * np.arange(costs.shape[-1]), axis=-1)


def _put_split_half(metrics: dict[str, float], prefix: str, members: list[_RowWalks]) -> None:
    """The static oracle in and out of hindsight, on the second half of every sequence: the best fixed b there
    (`half_best_fixed`), each prompt's b chosen on the first half of its own sequences (`half_chosen`), and each
    prompt's best b on the second half itself (`half_oracle`, the static oracle's hindsight).

    The static oracle picks, per prompt, the cheapest of K walks over the very cycles it is scored on; part of its
    margin is which walks happened to land on easy anchors. What of that margin a per-prompt choice can keep is what
    the first half's choice keeps on the second half: a per-request policy (and the static oracle as a bar) is
    worth only that much."""
    tokens = sum(w.half_tokens for w in members)
    if not tokens:
        return
    first = np.stack([w.half_cost[0] for w in members])  # (rows, K)
    second, cycles = np.stack([w.half_cost[1] for w in members]), np.stack([w.half_cycles[1] for w in members])
    rows = np.arange(len(members))
    for name, chosen in (
        ("half_best_fixed", np.full(len(members), int(_cheapest(second.sum(axis=0))))),
        ("half_chosen", _cheapest(first)),
        ("half_oracle", _cheapest(second)),
    ):
        spent_cycles, spent_cost = cycles[rows, chosen].sum(), second[rows, chosen].sum()
        metrics[f"{prefix}tau_{name}"] = tokens / spent_cycles if spent_cycles else math.nan
        metrics[f"{prefix}throughput_{name}"] = tokens / spent_cost if spent_cost else math.nan


STEP_REPORT_COLUMNS = (
    ("fixed B", "B"),
    ("best b", "best_fixed"),
    ("request", "request"),
    ("static", "oracle"),
    ("step", "step"),
    ("trim", "trim"),
    ("oracle", "step_oracle"),
)


SPLIT_HALF_COLUMNS = (("best b", "half_best_fixed"), ("1st half", "half_chosen"), ("static", "half_oracle"))


def format_step_metrics(title: str, metrics: dict[str, float]) -> str:
    """The evaluation's table, a column only for the policies that were evaluated; then the split-half check of the
    static oracle (`_put_split_half`) when the sequences had halves."""
    present = [(header, key) for header, key in STEP_REPORT_COLUMNS if any(k.endswith(f"tau_{key}") for k in metrics)]
    out = format_table(title, metrics, present)
    if any(k.endswith("tau_half_chosen") for k in metrics):
        out += "\n" + format_table(
            "  second halves: best fixed b, each prompt's b chosen on its first half, the static oracle (hindsight)",
            metrics,
            SPLIT_HALF_COLUMNS,
        )
    return out
