"""MLflow models-from-code script for the block-size models: MLflow executes this file when it loads a
registered model as a pyfunc; the project never imports it. Its artifact `predictor` is the model folder
(config.json + model.safetensors), so loading unpickles nothing. The folder's config says which model it is:
the per-request predictor (`blockpilot-predictor`) or the per-step model (`blockpilot-step-policy`)."""

import json
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel


class BlockSizeModel(PythonModel):
    """pyfunc input: a DataFrame with the model's input columns; output: the chosen block size per row (a predictor
    over shapes: the chosen policy per row, `fixed:B` or `tree:N`).
    Per-request: `blockpilot.predictor.INPUT_COLUMNS` (and `probs_fp16` for the dense kind). Per-step: the model's
    `config.features.names`."""

    def load_context(self, context):
        folder = Path(context.artifacts["predictor"])
        self.step = json.loads((folder / "config.json").read_text()).get("kind") == "step"
        if self.step:
            from blockpilot.predictor.step_model import StepModel

            self.model = StepModel.load(folder)
        else:
            from blockpilot.predictor.model import BlockSizePredictor

            self.model = BlockSizePredictor.load(folder)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[int]:
        if self.step:
            features = list(self.model.config.features.names)
            chosen = self.model.choose(model_input[features].to_numpy(dtype="float32"))
            return [int(self.model.config.candidates[k]) for k in chosen]
        from blockpilot.predictor.inputs import PredictorInputs, input_arrays

        dense = self.model.config.kind == "dense"
        inputs = PredictorInputs.from_arrays(input_arrays(model_input, dense))
        if self.model.config.tree_budgets:  # a predictor over shapes: each row's policy, fixed:B or tree:N
            shapes, _ = self.model.decide_shapes(inputs)
            return [f"tree:{nodes}" if nodes is not None else f"fixed:{b}" for b, nodes in shapes]
        return [int(b) for b in self.model.predict(inputs)]


mlflow.models.set_model(BlockSizeModel())
