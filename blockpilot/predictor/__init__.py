"""The block-size models: the per-request predictor (inputs, model and folder format, training, evaluation, store)
and the per-step model (`step_features`, `step_model`, `step_data`). Their policies are `blockpilot.policies`."""

from blockpilot.predictor.inputs import INPUT_COLUMNS, PredictorInputs, input_arrays, prefill_columns
from blockpilot.predictor.model import PREDICTOR_KINDS, BlockSizePredictor, PredictorConfig
from blockpilot.predictor.store import load_predictor, resolve_predictor_dir

__all__ = [
    "INPUT_COLUMNS",
    "PREDICTOR_KINDS",
    "BlockSizePredictor",
    "PredictorConfig",
    "PredictorInputs",
    "input_arrays",
    "load_predictor",
    "prefill_columns",
    "resolve_predictor_dir",
]
