"""The block-size predictor: model and folder format, its inputs, training, evaluation, and the learned policy."""

from blockpilot.predictor.inputs import INPUT_COLUMNS, PredictorInputs, input_arrays, prefill_columns
from blockpilot.predictor.model import PREDICTOR_KINDS, BlockSizePredictor, PredictorConfig
from blockpilot.predictor.policy import LearnedPolicy
from blockpilot.predictor.store import load_predictor, resolve_predictor_dir

__all__ = [
    "INPUT_COLUMNS",
    "PREDICTOR_KINDS",
    "BlockSizePredictor",
    "LearnedPolicy",
    "PredictorConfig",
    "PredictorInputs",
    "input_arrays",
    "load_predictor",
    "prefill_columns",
    "resolve_predictor_dir",
]
