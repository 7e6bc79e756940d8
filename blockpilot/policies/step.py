"""The per-step model (`blockpilot.predictor.step_model`) as a policy: b before every cycle, for every row that shares
the policy in one model call, from what the last verify pass already computed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState, top_probability
from blockpilot.predictor.step_features import TOKEN_FEATURES, CycleView, tail_tokens
from blockpilot.predictor.step_model import StepModel, embedding_rows


class StepPolicy(BlockSizePolicy):
    """b at every cycle from the step model; the first cycle from the prefill's distribution, or from the per-request
    policy `prior` when one is given."""

    name = "learned-step"

    def __init__(self, model: StepModel, prior: BlockSizePolicy | None = None) -> None:
        if model.config.prior and not callable(getattr(prior, "probabilities", None)):
            raise ValueError(
                "this step model was trained beside a per-request predictor and reads its choice and probabilities: "
                "use it with that predictor (learned+step:PREDICTOR,STEP_MODEL)"
            )
        self.model = model
        self.candidates = model.config.candidates
        self.prior = prior
        self._kept_at: dict[float, bool] = {}  # `keeps_prior` by temperature, asked once each

    @property
    def block_size_choices(self) -> tuple[int, ...] | None:
        prior = self.prior.block_size_choices if self.prior is not None else ()
        return None if prior is None else tuple(sorted({*self.candidates, *prior}))

    def _choose(
        self,
        logits: torch.Tensor,  # (N, V) the anchor distributions
        recent_tokens: Sequence[Sequence[int]],  # N generation tails, each ending at the block's first token
        prefills: Sequence[PrefillState],  # each row's, as its first choice saw it
        **known: np.ndarray,  # temperature, cursor, last_accepted, last_block_size, prior_block_size, batch_rows
    ) -> list[int]:
        """The candidate the model picks for each of N rows, from their distributions' top-1 probabilities, one
        device-to-host read and one model call."""
        confidence = top_probability(logits).cpu().numpy()
        probabilities = None
        if self.model.config.prior:
            probabilities = np.stack([self.prior.probabilities(prefill) for prefill in prefills])
        view = CycleView(
            confidence,
            tokens=tail_tokens(recent_tokens),
            prior_probabilities=probabilities,
            **known,
        )
        return [self.candidates[int(k)] for k in self.model.choose(self.model.config.features.build(view))]

    def cycle_decision(self, device: torch.device) -> CycleDecision | None:
        """This policy's choice as a module a compiled cycle runs on `device` (`Engine.decide_in_cycle`); None where a
        subclass answers the per-cycle hook its own way (the hook is then asked)."""
        if type(self).next_block_sizes is not StepPolicy.next_block_sizes:
            return None
        return CycleDecision(self).to(device)

    def keeps_prior(self, temperatures: Sequence[float]) -> list[bool]:
        """Whether requests at these temperatures keep the prior's b0 to their end (`StepModelConfig.keeps_prior`)."""
        if not self.model.config.prior_temperatures:  # none kept (every model without a prior): no tensor a cycle
            return [False] * len(temperatures)
        for t in set(temperatures) - set(self._kept_at):
            self._kept_at[t] = self.model.config.keeps_prior_at(t)
        return [self._kept_at[t] for t in temperatures]

    def keeps_block_size_of(self, prefill: PrefillState) -> bool:
        """A request at a temperature where the model keeps the prior's b0 (`keeps_prior`)."""
        return self.keeps_prior([prefill.temperature])[0]

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self.initial_block_sizes([prefill])[0]

    def initial_block_sizes(self, prefills: Sequence[PrefillState]) -> list[int]:
        """The first b of every joining request, in one call of the prior or of the model."""
        if self.prior is not None:
            return self.prior.initial_block_sizes(prefills)
        return self._choose(
            torch.stack([prefill.next_token_logits for prefill in prefills]),
            [(prefill.first_token,) for prefill in prefills],
            prefills,
            temperature=np.asarray([prefill.temperature for prefill in prefills], dtype=np.float32),
            cursor=np.ones(len(prefills)),
            batch_rows=np.asarray([prefill.batch_rows for prefill in prefills]),
        )

    def next_block_size(self, cycle: CycleState) -> int:
        return self.next_block_sizes([cycle])[0]

    def next_block_sizes(self, cycles: Sequence[CycleState]) -> list[int]:
        """The next b of every row that shares this policy, in one model call."""
        out = [cycle.block_size for cycle in cycles]
        keeps = self.keeps_prior([cycle.temperature for cycle in cycles])
        for i, cycle in enumerate(cycles):
            if keeps[i] and cycle.first_block_size is not None:
                out[i] = cycle.first_block_size
        deciding = [i for i, cycle in enumerate(cycles) if cycle.anchor_logits is not None and not keeps[i]]
        if not deciding:
            return out
        chosen = [cycles[i] for i in deciding]

        def column(name: str) -> np.ndarray:
            return np.asarray([getattr(cycle, name) for cycle in chosen])

        sizes = self._choose(
            torch.stack([cycle.anchor_logits for cycle in chosen]),
            [cycle.recent_tokens for cycle in chosen],
            [cycle.prefill for cycle in chosen],
            temperature=column("temperature"),
            cursor=column("new_tokens"),  # after a cycle the row holds `new_tokens` tokens: the next block's cursor
            last_accepted=column("acceptance_length"),
            last_block_size=column("block_size"),
            prior_block_size=column("first_block_size") if self.model.config.prior else None,
            batch_rows=column("batch_rows"),
        )
        for i, size in zip(deciding, sizes, strict=True):
            out[i] = size
        return out


class PriorStepPolicy(StepPolicy):
    """The per-request predictor drafts the first cycle (its b0, from the prefill); the step model picks b before
    every later cycle, reading b0 and the predictor's probabilities when it was trained with them."""

    name = "learned+step"

    def __init__(self, model: StepModel, prior: BlockSizePolicy) -> None:
        super().__init__(model, prior)


class CycleDecision(nn.Module):
    """A step policy's next b computed inside the compiled cycle of a lone row (`StaticDecoder.set_decision`), by the
    model's `FoldedHead` for one row: the columns a request fixes (its temperature, its prior's choice and
    probabilities) enter as one first-layer bias per request (`row_inputs`, on the host once), the columns that change
    every cycle (`StepFeatures.cycle_parts`: the anchor's top-1 probability, the last two tokens, the cursor, the last
    acceptance) from what the cycle holds, each times its weight row; then the best candidate. On the CPU this costs
    the mini zoo's width-1 cycle half what the model unfolded did (docs/log.md). No host round trip: the engine reads
    b with the cycle's tokens. A row at a temperature where the model keeps its prior (`keeps_block_size_of`) never
    runs it: alone, it runs the cycle without the choice (`_kept_cycle`)."""

    def __init__(self, policy: StepPolicy) -> None:
        super().__init__()
        model = policy.model
        self.prior = policy.prior if model.config.prior else None
        self.features = model.config.features
        self.vocab_size = model.config.vocab_size
        head = model.folded_head(batch_rows=1)
        numeric, per_cycle = model.numeric_names, self.features.cycle_names
        by_request = [i for i, name in enumerate(numeric) if name not in per_cycle]
        columns = [self.features.names.index(numeric[i]) for i in by_request]
        self._request = (columns, head.numeric[by_request], head.bias)  # host arrays: `row_inputs`'s
        rows = [numeric.index(name) for name in per_cycle if name not in TOKEN_FEATURES]  # in `cycle_parts`' order
        self.register_buffer("weights", torch.as_tensor(head.numeric[rows]))  # (per-cycle numeric columns, H)
        self.register_buffer("token_tables", torch.as_tensor(np.stack(head.tables)))  # (2, V + 1, H)
        self.register_buffer("second", torch.as_tensor(head.second.T.copy()))  # (K, H): a row per candidate
        self.register_buffer("second_bias", torch.as_tensor(head.second_bias))  # (K,)
        self.candidates = tuple(policy.candidates)
        self.inputs = len(head.bias)

    def row_inputs(self, prefill: PrefillState, first_block_size: int) -> list[float]:
        """The request's first-layer bias (H,): the folded bias plus the columns the request fixes (`build`'s, as the
        hook reads them: its temperature, b0 and the prior's probability of each candidate), times their weights."""
        columns, weights, bias = self._request
        view = CycleView(
            np.zeros(1),
            prefill.temperature,
            np.ones(1),
            np.zeros((1, 2)),
            prior_block_size=first_block_size if self.prior is not None else None,
            prior_probabilities=self.prior.probabilities(prefill) if self.prior is not None else None,
        )
        return (bias + self.features.build(view)[0, columns] @ weights).tolist()

    def forward(
        self,
        anchor_confidence: torch.Tensor,  # (N,) the target's top-1 probability at each row's new last token
        tokens: torch.Tensor,  # (N, 2) that token and the one before it
        temperature: torch.Tensor,  # (N,)
        cursor: torch.Tensor,  # (N,) tokens generated, the prefill's one included
        last_accepted: torch.Tensor,  # (N,) tokens the cycle committed
        last_block_size: torch.Tensor,  # (N,) its b
        inputs: torch.Tensor,  # (N, H) `row_inputs`
    ) -> torch.Tensor:
        """(N,) long: each row's next b."""
        view = CycleView(
            anchor_confidence,
            temperature=temperature,
            cursor=cursor,
            tokens=tokens,
            last_accepted=last_accepted,
            last_block_size=last_block_size,
        )
        # The first layer as a sum of each column times its weight row, with no feature vector built: pointwise work
        # inductor fuses (a vector and one product read 0.2-1.6 points more of the mini zoo's cycle, docs/log.md).
        hidden, row = inputs, 0
        for group, part in zip(self.features.cycle_groups, self.features.cycle_parts(view), strict=True):
            if group.names == TOKEN_FEATURES:
                ids = embedding_rows(part, self.vocab_size)  # (N, 2)
                hidden = hidden + self.token_tables[0][ids[:, 0]] + self.token_tables[1][ids[:, 1]]
                continue
            for column in range(part.shape[1]):
                hidden = hidden + part[:, column, None] * self.weights[row]
                row += 1
        # Every candidate's score in one reduction over the hidden units, then the best kept by comparisons (the
        # first on a tie, as an argmax): fused loops, with no matrix-library call, argmax or gather for one row. One
        # reduction, not one a candidate: each of those held its score in a tensor of its own, allocated at every
        # call of the compiled cycle (the mini zoo's width-1 choice +3.0-3.7% -> +1.8-2.2%, docs/log.md).
        active = hidden.clamp(min=0)
        scores = (active[:, None, :] * self.second).sum(dim=2) + self.second_bias  # (N, K)
        best_score = scores[:, 0]
        best = torch.full_like(best_score, self.candidates[0], dtype=torch.long)
        for index in range(1, len(self.candidates)):
            score = scores[:, index]
            better = score > best_score
            best = torch.where(better, self.candidates[index], best)
            best_score = torch.where(better, score, best_score)
        return best
