"""Build the zoo with its training steps on Ray Train.

ray job submit --runtime-env ray_job.yaml -- python -m pipelines.build_zoo --size small --workers 2
blockpilot zoo build --size small --trainer ray        # the same, from the command line
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass
class RayTrainer:
    """The zoo's `Trainer` on Ray Train: `TorchTrainer` with CPU workers by default, GPUs when asked."""

    num_workers: int = 1
    use_gpu: bool = False

    def train_target(self, target: Any, sequences, pad_id: int, schedule, seed: int, loss_from) -> list[float]:
        from pipelines.train_target import fit_target

        return fit_target(
            target, sequences, pad_id, schedule, seed, loss_from, num_workers=self.num_workers, use_gpu=self.use_gpu
        )

    def train_drafter(self, drafter: Any, target: Any, rows, recipe, schedule, seed: int) -> list[float]:
        from pipelines.train_drafter import fit_drafter

        return fit_drafter(
            drafter, target, rows, recipe, schedule, seed, num_workers=self.num_workers, use_gpu=self.use_gpu
        )


def main(argv: list[str] | None = None) -> int:
    from blockpilot.cli import main as cli_main

    parser = argparse.ArgumentParser(prog="python -m pipelines.build_zoo", description=__doc__)
    parser.add_argument("--size", default="small")
    parser.add_argument("--out", default=None)
    parser.add_argument("--seed", default="0")
    parser.add_argument("--workers", default="1")
    parser.add_argument("--use-gpu", action="store_true")
    args = parser.parse_args(argv)
    forwarded = [
        "zoo",
        "build",
        "--size",
        args.size,
        "--seed",
        args.seed,
        "--trainer",
        "ray",
        "--workers",
        args.workers,
    ]
    forwarded += ["--out", args.out] if args.out else []
    forwarded += ["--use-gpu"] if args.use_gpu else []
    return cli_main(forwarded)


if __name__ == "__main__":
    raise SystemExit(main())
