"""MLflow models-from-code script for the block-size predictor: MLflow executes this file when it loads the
registered model as a pyfunc; the project never imports it. Its artifact `predictor` is the predictor folder
(config.json + model.safetensors), so loading unpickles nothing."""

import mlflow
from mlflow.pyfunc import PythonModel


class BlockSizePredictorModel(PythonModel):
    """pyfunc input: a DataFrame with `topk_ids`, `topk_probs`, `entropy`, `temperature` (and `probs` for the
    dense kind); output: the chosen block size per row."""

    def load_context(self, context):
        from blockpilot.predictor import BlockSizePredictor

        self.predictor = BlockSizePredictor.load(context.artifacts["predictor"])

    def predict(self, context, model_input, params=None):
        import torch

        from blockpilot.predictor import PredictorInputs

        dense = "probs" in model_input
        inputs = PredictorInputs(
            topk_ids=torch.tensor(list(model_input["topk_ids"]), dtype=torch.long),
            topk_probs=torch.tensor(list(model_input["topk_probs"]), dtype=torch.float32),
            entropy=torch.tensor(list(model_input["entropy"]), dtype=torch.float32),
            temperature=torch.tensor(list(model_input["temperature"]), dtype=torch.float32),
            probs=torch.tensor(list(model_input["probs"]), dtype=torch.float32) if dense else None,
        )
        return self.predictor.predict(inputs)


mlflow.models.set_model(BlockSizePredictorModel())
