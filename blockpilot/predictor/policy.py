"""The trained predictor as a per-request block-size policy."""

from __future__ import annotations

from blockpilot.decoding.policies import PerRequestPolicy, PrefillState
from blockpilot.predictor.inputs import PredictorInputs
from blockpilot.predictor.model import BlockSizePredictor


class LearnedPolicy(PerRequestPolicy):
    """b = the predictor's choice from the prefill distribution; kept for every cycle."""

    name = "learned"

    def __init__(self, predictor: BlockSizePredictor) -> None:
        self.predictor = predictor

    def initial_block_size(self, prefill: PrefillState) -> int:
        config = self.predictor.config
        inputs = PredictorInputs.from_prefill(prefill, config.top_k, dense=config.kind == "dense")
        return self.predictor.predict(inputs)[0]
