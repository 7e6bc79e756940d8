"""The zoo's training steps on Ray Train: `TorchTrainer` workers run the library's target and drafter steps.

Each worker trains on its shard of the job (`TargetFit.shard` / `DrafterFit.shard`: data parallel, DDP when
there are several) and rank 0 reports the trained weights as the run's final checkpoint.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.ray_runtime import ensure_ray, ray_storage, train_run_config


def _reporter(name: str, total_steps: int, every: int):
    """Progress on rank 0, metrics to Ray Train every `every` steps (all workers report together)."""
    import ray.train

    from blockpilot.zoo.training import ProgressPrinter

    rank = ray.train.get_context().get_world_rank()
    printer = ProgressPrinter(name, total_steps)

    def report(step: int, metrics: dict[str, float]) -> None:
        if rank == 0:
            printer(step, metrics)
        if (step + 1) % every == 0 and step + 1 < total_steps:
            ray.train.report({"step": step + 1, **metrics})

    return report


def _report_final(model: Any, history: list[float]) -> None:
    """Rank 0 writes the trained weights and the loss history as the run's checkpoint."""
    import ray.train
    import torch
    from safetensors.torch import save_file

    unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            # Cloned: tied weights (embeddings = lm_head) share memory, which safetensors refuses to save.
            state = {k: v.detach().cpu().clone() for k, v in unwrapped.state_dict().items()}
            save_file(state, Path(directory) / "model.safetensors")
            (Path(directory) / "history.json").write_text(json.dumps(history))
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report({"final_loss": history[-1] if history else float("nan")}, checkpoint=checkpoint)


def _read_final(result: Any) -> tuple[dict[str, Any], list[float]]:
    """(state dict, loss history) from a finished run's checkpoint."""
    from safetensors.torch import load_file

    with result.checkpoint.as_directory() as directory:
        return load_file(Path(directory) / "model.safetensors"), json.loads(
            (Path(directory) / "history.json").read_text()
        )


def _target_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from blockpilot.zoo.training import train_target_steps

    context = ray.train.get_context()
    fit = config["fit"].shard(context.get_world_rank(), context.get_world_size())
    model = Qwen3ForCausalLM(Qwen3Config(**config["model_config"]))
    model.load_state_dict(config["state"])
    model = model.to(ray.train.torch.get_device())
    report = _reporter("target", fit.schedule.steps, fit.schedule.log_every)
    history = train_target_steps(model, fit, report, wrap=ray.train.torch.prepare_model)
    _report_final(model, history)


def _drafter_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from blockpilot.models.drafter import DFlashConfig, DFlashDrafter
    from blockpilot.zoo.training import train_drafter_steps

    context = ray.train.get_context()
    fit = config["fit"].shard(context.get_world_rank(), context.get_world_size())
    device = ray.train.torch.get_device()
    target = Qwen3ForCausalLM(Qwen3Config(**config["target_config"]))
    target.load_state_dict(config["target_state"])
    target = target.to(device).eval()
    drafter = DFlashDrafter(DFlashConfig.from_dict(config["drafter_config"]))
    drafter.load_state_dict(config["drafter_state"])
    drafter = drafter.to(device)
    report = _reporter("drafter", fit.schedule.steps, fit.schedule.log_every)
    history = train_drafter_steps(drafter, target, fit, report, wrap=ray.train.torch.prepare_model)
    _report_final(drafter, history)


def _state(model: Any) -> dict[str, Any]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


@dataclass
class RayTrainer:
    """The zoo's `Trainer` on Ray Train: `TorchTrainer` with CPU workers by default, GPUs when asked."""

    num_workers: int = 1
    use_gpu: bool = False

    def _fit(self, worker: Any, config: dict[str, Any], name: str) -> tuple[dict[str, Any], list[float]]:
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        ensure_ray()
        trainer = TorchTrainer(
            worker,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=self.num_workers, use_gpu=self.use_gpu),
            run_config=train_run_config(name=name, storage_path=str(ray_storage("zoo"))),
        )
        return _read_final(trainer.fit())

    def train_target(self, target: Any, fit: Any) -> list[float]:
        config = {"model_config": target.config.to_dict(), "state": _state(target), "fit": fit}
        state, history = self._fit(_target_worker, config, "zoo-target")
        target.load_state_dict(state)
        return history

    def train_drafter(self, drafter: Any, target: Any, fit: Any) -> list[float]:
        config = {
            "target_config": target.config.to_dict(),
            "target_state": _state(target),
            "drafter_config": drafter.config.to_dict(),
            "drafter_state": _state(drafter),
            "fit": fit,
        }
        state, history = self._fit(_drafter_worker, config, "zoo-drafter")
        drafter.load_state_dict(state)
        return history
