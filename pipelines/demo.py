"""The main job on embedded defaults: zoo -> cycle cost -> labels -> predictor + per-step model -> generate ->
endpoint.

    make demo                                  # = python -m blockpilot demo (the small zoo)
    python -m blockpilot demo --size tiny      # the same flow on the tiny zoo, in a few minutes

Everything runs on this machine: an embedded Ray (Ray Data labels, Ray Train fits the predictor, Ray Serve
serves it on 127.0.0.1), MLflow in SQLite under $BLOCKPILOT_HOME, models from the local zoo. Each stage
reuses what an earlier run left: the zoo is cached, labeled prompts are skipped. `DemoPaths` says where each
artifact lands under the home folder (the notebooks read them from there).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from blockpilot.home import HOME_ENV, blockpilot_home
from blockpilot.options import option, positive_int_arg


@dataclass(frozen=True)
class DemoPaths:
    """Where the main job leaves each artifact of a zoo size, under the home folder."""

    size: str = "small"
    home: Path = field(default_factory=blockpilot_home)

    @property
    def zoo(self) -> Path:
        from blockpilot.zoo.build import RECIPES, zoo_cache_dir

        return zoo_cache_dir(RECIPES[self.size], 0, self.home)

    @property
    def run(self) -> Path:
        return self.home / "demo" / self.size

    @property
    def cost(self) -> Path:
        return self.run / "cost.json"

    @property
    def labels(self) -> Path:
        return self.run / "labels"

    @property
    def predictor(self) -> Path:
        return self.run / "predictor"

    @property
    def step_model(self) -> Path:
        return self.run / "step-model"


@dataclass(frozen=True)
class DemoJob:
    home: Path | None = option(None, type=Path, help="artifact folder (default: $BLOCKPILOT_HOME)")
    size: str = option("small", choices=("tiny", "small"), help="which zoo the flow runs on")
    port: int = option(8000, type=positive_int_arg, help="port of the endpoint on 127.0.0.1")


def _banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def run_demo(job: DemoJob) -> int:
    import httpx

    if job.home is not None:
        os.environ[HOME_ENV] = str(job.home)
    from blockpilot.cost import calibrate
    from blockpilot.decoding import GenerationConfig, generate
    from blockpilot.decoding.resolve import resolve_policy
    from blockpilot.labeling import LabelSettings
    from blockpilot.models import load_models
    from blockpilot.tracking import tracking_uri
    from blockpilot.zoo.build import RECIPES, build_zoo
    from pipelines.label import LabelJob, run_label_job
    from pipelines.serve import ModelLoader, serve_locally
    from pipelines.train_predictor import TrainJob, run_train_job
    from pipelines.train_step_policy import StepTrainJob, run_step_train_job

    size = job.size
    paths = DemoPaths(size)
    recipe = RECIPES[size]
    _banner(f"1/6 the {size} zoo (target + DFlash drafter, trained here from local text)")
    zoo = build_zoo(size)
    info = json.loads((zoo / "zoo.json").read_text())["evaluation"]
    print(
        f"zoo: {zoo}\n  tau at B={recipe.block_size}: {info['tau_at_B']:.2f}; "
        f"per-prompt oracle over B-2..B+2: {info['oracle_tau']:.2f}"
    )
    models = load_models(zoo / "target", zoo / "drafter")

    _banner("2/6 the cost of a draft/verify cycle at each block size, on this machine")
    if not paths.cost.is_file():
        calibrate(models, range(1, 2 * recipe.block_size + 1)).save(paths.cost)
    print(f"cost curve: {paths.cost}")

    _banner("3/6 labels: the acceptance table of every prompt on Ray Data")
    # 4 pooled generations per T = 1 row: single-sample tau vectors at T = 1 are mostly noise.
    settings = LabelSettings(temperatures=(0.0, 1.0), max_new_tokens=recipe.response_tokens, dense=True, samples=4)
    for split in ("train", "heldout"):
        run_label_job(
            LabelJob(
                prompts=f"zoo:{zoo}:{split}",
                target=str(zoo / "target"),
                drafter=str(zoo / "drafter"),
                out=paths.labels / split,
                settings=settings,
                actors=2,
                num_cpus_per_actor=1.0,
                batch_size=8,
                cost=paths.cost,
            )
        )

    _banner("4/6 the per-request predictor and the per-step model on Ray Train, tracked in MLflow")
    outcome = run_train_job(
        TrainJob(
            labels=paths.labels / "train",
            eval=paths.labels / "heldout",
            kind="sparse",
            objective="normalized-gain",
            score="throughput",
            cost=paths.cost,
            val_share=0.05,  # validation only watches the run (the last epoch is kept): keep the rows for training
            epochs=30,
            out=paths.predictor,
        )
    )
    predictor = (
        f"models:/blockpilot-predictor/{outcome.model_version}" if outcome.model_version else str(outcome.predictor_dir)
    )
    step = run_step_train_job(
        StepTrainJob(
            labels=paths.labels / "train",
            eval=paths.labels / "heldout",
            cost=paths.cost,
            prior=predictor,
            epochs=20,
            out=paths.step_model,
        )
    )
    adaptive = f"learned+step:{predictor},{step.model_dir}"

    _banner(f"5/6 one held-out prompt under {adaptive}")
    prompt = json.loads((zoo / "prompts" / "heldout.jsonl").read_text().splitlines()[0])["prompt"]
    result = generate(
        models,
        models.encode_prompt(prompt),
        policy=resolve_policy(adaptive, models),
        config=GenerationConfig(max_new_tokens=64, stop_token_ids=tuple(models.stop_token_ids())),
    )
    print(f"prompt: {prompt!r}\nanswer: {models.tokenizer.decode(result.token_ids, skip_special_tokens=True)!r}")
    print(result.format_stats())

    _banner(f"6/6 the endpoint on Ray Serve (127.0.0.1:{job.port}), adaptive = {adaptive}")
    loader = ModelLoader(
        str(zoo / "target"), str(zoo / "drafter"), predictor, step_model=str(step.model_dir), model_name=f"zoo-{size}"
    )
    server = serve_locally(loader, port=job.port, log_level="WARNING")
    try:
        server.wait_healthy()
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            timeout=120,
            json={
                "model": f"zoo-{size}",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 64,
                "temperature": 0,
            },
        )
        response.raise_for_status()
        body = response.json()
        print(f"POST /v1/chat/completions -> {response.status_code}")
        print(f"answer: {body['choices'][0]['message']['content']!r}")
        print(f"usage: {body['usage']}\nblockpilot: {body['blockpilot']}")
    finally:
        server.shutdown()
        from ray import serve

        serve.shutdown()
    print(f"\nMLflow: mlflow ui --backend-store-uri {tracking_uri()} --host 127.0.0.1 --port 5000, then open")
    print("  http://127.0.0.1:5000/#/experiments?workflowType=machine_learning (the runs tables, not the GenAI view)")
    print(f"notebooks: BLOCKPILOT_HOME={paths.home} BLOCKPILOT_DEMO_SIZE={size} jupyter lab notebooks/")
    return 0
