"""MLflow models-from-code script for the block-size predictor: MLflow executes this file when it loads the
registered model as a pyfunc; the project never imports it. Its artifact `predictor` is the predictor folder
(config.json + model.safetensors), so loading unpickles nothing."""

import mlflow
from mlflow.pyfunc import PythonModel


class BlockSizePredictorModel(PythonModel):
    """pyfunc input: a DataFrame with the predictor's input columns (`blockpilot.predictor.INPUT_COLUMNS`,
    and `probs_fp16` for the dense kind); output: the chosen block size per row."""

    def load_context(self, context):
        from blockpilot.predictor.model import BlockSizePredictor

        self.predictor = BlockSizePredictor.load(context.artifacts["predictor"])

    def predict(self, context, model_input, params=None):
        from blockpilot.predictor.inputs import PredictorInputs, input_arrays

        dense = self.predictor.config.kind == "dense"
        return self.predictor.predict(PredictorInputs.from_arrays(input_arrays(model_input, dense)))


mlflow.models.set_model(BlockSizePredictorModel())
