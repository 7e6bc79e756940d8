"""Build the local model zoo, its training steps in this process or on Ray Train.

    ray job submit --runtime-env ray_job.yaml -- python -m pipelines.build_zoo --size small --trainer ray --workers 2
    blockpilot zoo build --size small [--trainer ray]          # the same, from the command line
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from blockpilot.options import add_options, from_args, option, positive_int_arg
from blockpilot.zoo.build import RECIPES


@dataclass(frozen=True)
class ZooBuildJob:
    size: str = option("tiny", choices=tuple(RECIPES), help="which recipe")
    out: Path | None = option(None, type=Path, help="copy the zoo here (it is cached under the home folder)")
    device: str = option("cpu", choices=("cpu", "cuda"), help="where the training steps run")
    seed: int = option(0, type=int, help="seed of the corpus and the weights")
    trainer: str = option("local", choices=("local", "ray"), help="train in this process, or on Ray Train workers")
    workers: int = option(1, type=positive_int_arg, help="Ray Train workers (with --trainer ray)")
    use_gpu: bool = option(False, help="Ray Train workers take a GPU each")
    track: bool = option(True, flag="--no-track", help="do not log the build to MLflow")


def run_zoo_build(job: ZooBuildJob) -> Path:
    from blockpilot.zoo.build import build_zoo

    trainer = None
    if job.trainer == "ray":
        from pipelines.zoo_trainer import RayTrainer

        trainer = RayTrainer(num_workers=job.workers, use_gpu=job.use_gpu)
    return build_zoo(job.size, job.out, seed=job.seed, device=job.device, trainer=trainer, track=job.track)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.build_zoo", description=__doc__)
    add_options(parser, ZooBuildJob)
    try:
        print(f"zoo: {run_zoo_build(from_args(ZooBuildJob, parser.parse_args(argv)))}")
    except (ValueError, FileNotFoundError) as error:
        print(f"build_zoo: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
