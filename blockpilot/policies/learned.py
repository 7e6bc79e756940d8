"""The trained per-request predictor (BlockPilot) as a policy: b from the prefill distribution, kept for the request."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from blockpilot.policies.base import BlockSizePolicy, PrefillState
from blockpilot.predictor.inputs import PredictorInputs
from blockpilot.predictor.model import BlockSizePredictor

PRIOR_DECISION = "learned_decision"  # where `LearnedPolicy` keeps its (b0, probabilities) in `PrefillState.derived`


class LearnedPolicy(BlockSizePolicy):
    """b = the predictor's choice from the prefill distribution; kept for every cycle. A predictor over shapes
    (`PredictorConfig.tree_budgets`) chooses a draft tree or a chain per request: its trees run on the static
    engine."""

    name = "learned"

    def __init__(self, predictor: BlockSizePredictor) -> None:
        self.predictor = predictor
        budgets = predictor.config.tree_budgets
        self.tree_nodes = max(budgets) if budgets else None
        self.tree_depth = predictor.config.tree_depth
        self._fixed_at: dict[float, int] = {}  # `fixed_index` by temperature, asked once each (tensor ops at admission)

    @property
    def block_size_choices(self) -> tuple[int, ...]:
        depth = (self.tree_depth,) if self.tree_nodes is not None and self.tree_depth else ()
        return tuple(sorted({*self.predictor.config.candidates, *depth}))

    def initial_block_size(self, prefill: PrefillState) -> int:
        return self._decisions([prefill])[0][0][0]

    def initial_block_sizes(self, prefills: Sequence[PrefillState]) -> list[int]:
        """b0 of every joining request, from one predictor pass (the engine's batched first-cycle hook)."""
        return [b0 for (b0, _), _ in self._decisions(prefills)]

    def initial_tree_budgets(self, prefills: Sequence[PrefillState]) -> list[int | None]:
        """Each request's tree budget (None where the predictor chose a chain), from the same pass."""
        return [nodes for (_, nodes), _ in self._decisions(prefills)]

    def probabilities(self, prefill: PrefillState) -> np.ndarray:
        """(K,) the predictor's softmax over its candidates for this request: what a per-step model trained
        beside it reads at every cycle (a predictor pass now where the request's shape was fixed without one)."""
        shape, probabilities = self._decisions([prefill])[0]
        if probabilities is None:
            probabilities = self._predicted([prefill])[1][0]
            prefill.derived[(PRIOR_DECISION, id(self.predictor))] = (shape, probabilities)
        return probabilities

    def _fixed_index(self, temperature: float) -> int:
        """`PredictorConfig.fixed_index` of a request at `temperature`, computed once per temperature."""
        if temperature not in self._fixed_at:
            fixed = self.predictor.config.fixed_index(torch.tensor([temperature], dtype=torch.float32))
            self._fixed_at[temperature] = int(fixed[0])
        return self._fixed_at[temperature]

    def _predicted(self, prefills: Sequence[PrefillState]) -> tuple[list[tuple[int, int | None]], np.ndarray]:
        """The predictor's pass over these requests: its shapes and probabilities (`decide_shapes`)."""
        config = self.predictor.config
        inputs = PredictorInputs.from_prefills(prefills, config.top_k, dense=config.kind == "dense")
        return self.predictor.decide_shapes(inputs)

    def _decisions(self, prefills: Sequence[PrefillState]) -> list[tuple[tuple[int, int | None], np.ndarray | None]]:
        """((b0, tree nodes), probabilities) of each request, from one predictor pass over those not yet decided: a
        request is decided once per predictor (kept in `prefill.derived`), and a step policy reads it at every
        cycle. A request at a temperature where the predictor fixes its shape (`PredictorConfig.fixed_at`) gets it
        without a pass (its probabilities None until asked)."""
        key = (PRIOR_DECISION, id(self.predictor))
        undecided = [prefill for prefill in prefills if key not in prefill.derived]
        config = self.predictor.config
        if undecided and config.fixed_at:
            for prefill in undecided:
                index = self._fixed_index(prefill.temperature)
                if index >= 0:
                    prefill.derived[key] = (config.shapes[index], None)
            undecided = [prefill for prefill in undecided if key not in prefill.derived]
        if undecided:
            for prefill, shape, probabilities in zip(undecided, *self._predicted(undecided), strict=True):
                prefill.derived[key] = (shape, probabilities)
        return [prefill.derived[key] for prefill in prefills]
