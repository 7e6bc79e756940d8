"""The trained predictor as a per-request block-size policy."""

from __future__ import annotations

import numpy as np

from blockpilot.decoding.policies import PerRequestPolicy, PrefillState
from blockpilot.predictor.inputs import PredictorInputs
from blockpilot.predictor.model import BlockSizePredictor


PRIOR_PROBABILITIES = "learned_probabilities"  # the key of `LearnedPolicy.probabilities` in `PrefillState.derived`


class LearnedPolicy(PerRequestPolicy):
    """b = the predictor's choice from the prefill distribution; kept for every cycle."""

    name = "learned"

    def __init__(self, predictor: BlockSizePredictor) -> None:
        self.predictor = predictor

    def initial_block_size(self, prefill: PrefillState) -> int:
        config = self.predictor.config
        inputs = PredictorInputs.from_prefill(prefill, config.top_k, dense=config.kind == "dense")
        return self.predictor.predict(inputs)[0]

    def probabilities(self, prefill: PrefillState) -> np.ndarray:
        """(K,) the predictor's softmax over its candidates for this request, computed once per request (kept
        in `prefill.derived`): what a per-step model trained beside it reads at every cycle."""
        probs = prefill.derived.get(PRIOR_PROBABILITIES)
        if probs is None:
            config = self.predictor.config
            inputs = PredictorInputs.from_prefill(prefill, config.top_k, dense=config.kind == "dense")
            probs = prefill.derived[PRIOR_PROBABILITIES] = self.predictor.probabilities(inputs)[0]
        return probs
