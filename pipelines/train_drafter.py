"""The zoo's DFlash drafter training on Ray Train.

Each worker gets the frozen target and its shard of the target's own responses, computes that shard's
context features, and runs the library's DFlash training steps; rank 0 reports the drafter's weights.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipelines.ray_runtime import ensure_ray, ray_storage
from pipelines.train_target import read_final, report_final, worker_reporter


def _drafter_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from blockpilot.models.drafter import DFlashConfig, DFlashDrafter
    from blockpilot.zoo.training import train_drafter_steps

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    target = Qwen3ForCausalLM(Qwen3Config(**config["target_config"]))
    target.load_state_dict(config["target_state"])
    target = target.to(device).eval()
    drafter = DFlashDrafter(DFlashConfig.from_dict(config["drafter_config"]))
    drafter.load_state_dict(config["drafter_state"])
    drafter = drafter.to(device)
    schedule = replace(config["schedule"], batch_size=max(1, config["schedule"].batch_size // world))
    report = worker_reporter("drafter", schedule.steps, schedule.log_every)
    history = train_drafter_steps(
        drafter,
        target,
        config["rows"][rank::world],
        config["recipe"],
        schedule,
        config["seed"] + rank,
        report,
        wrap=ray.train.torch.prepare_model,
    )
    report_final(drafter, history)


def fit_drafter(
    drafter: Any,
    target: Any,
    rows: list[dict[str, Any]],
    recipe: Any,
    schedule: Any,
    seed: int,
    *,
    num_workers: int = 1,
    use_gpu: bool = False,
    name: str = "zoo-drafter",
) -> list[float]:
    """Train `drafter` in place on Ray Train workers; returns the loss history."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ensure_ray()
    config = {
        "target_config": target.config.to_dict(),
        "target_state": {k: v.detach().cpu() for k, v in target.state_dict().items()},
        "drafter_config": drafter.config.to_dict(),
        "drafter_state": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
        "rows": rows,
        "recipe": recipe,
        "schedule": schedule,
        "seed": seed,
    }
    trainer = TorchTrainer(
        _drafter_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(name=name, storage_path=str(ray_storage("zoo"))),
    )
    state, history = read_final(trainer.fit())
    drafter.load_state_dict(state)
    return history
