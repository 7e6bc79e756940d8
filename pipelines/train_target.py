"""The zoo's target training on Ray Train: `TorchTrainer` workers run the library's training steps.

Each worker trains on its shard of the chat pairs (data parallel; DDP when there are several) with the
global batch split between workers; rank 0 reports the weights as the run's final checkpoint.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipelines.ray_runtime import ensure_ray, ray_storage


def worker_reporter(name: str, total_steps: int, every: int):
    """Progress on rank 0, metrics to Ray Train every `every` steps (all workers report together)."""
    import ray.train

    from blockpilot.zoo.training import ProgressPrinter

    rank = ray.train.get_context().get_world_rank()
    printer = ProgressPrinter(f"{name}/rank{rank}", total_steps)

    def report(step: int, metrics: dict[str, float]) -> None:
        if rank == 0:
            printer(step, metrics)
        if (step + 1) % every == 0 and step + 1 < total_steps:
            ray.train.report({"step": step + 1, **metrics})

    return report


def report_final(model: Any, history: list[float]) -> None:
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


def read_final(result: Any) -> tuple[dict[str, Any], list[float]]:
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
    rank, world = context.get_world_rank(), context.get_world_size()
    model = Qwen3ForCausalLM(Qwen3Config(**config["model_config"]))
    model.load_state_dict(config["state"])
    model = model.to(ray.train.torch.get_device())
    schedule = replace(config["schedule"], batch_size=max(1, config["schedule"].batch_size // world))
    report = worker_reporter("target", schedule.steps, schedule.log_every)
    loss_from = config["loss_from"]
    history = train_target_steps(
        model,
        config["sequences"][rank::world],
        config["pad_id"],
        schedule,
        config["seed"] + rank,
        report,
        wrap=ray.train.torch.prepare_model,
        loss_from=None if loss_from is None else loss_from[rank::world],
    )
    report_final(model, history)


def fit_target(
    target: Any,
    sequences: list[list[int]],
    pad_id: int,
    schedule: Any,
    seed: int,
    loss_from: list[int] | None = None,
    *,
    num_workers: int = 1,
    use_gpu: bool = False,
    name: str = "zoo-target",
) -> list[float]:
    """Train `target` in place on Ray Train workers; returns the loss history."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ensure_ray()
    config = {
        "model_config": target.config.to_dict(),
        "state": {k: v.detach().cpu() for k, v in target.state_dict().items()},
        "sequences": sequences,
        "loss_from": loss_from,
        "pad_id": pad_id,
        "schedule": schedule,
        "seed": seed,
    }
    trainer = TorchTrainer(
        _target_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(name=name, storage_path=str(ray_storage("zoo"))),
    )
    state, history = read_final(trainer.fit())
    target.load_state_dict(state)
    return history
