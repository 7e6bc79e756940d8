"""The main job on embedded defaults: zoo -> cycle cost -> labels -> predictor + per-step model -> one traced
generation -> every policy on the held-out prompts -> endpoint.

    make demo                                  # = python -m blockpilot demo (the mini zoo, ~15 minutes)
    python -m blockpilot demo --size small     # the bigger zoo the benchmarks use (~40 minutes to build once)

Everything runs on this machine: an embedded Ray (Ray Data labels, Ray Train fits the predictor, Ray Serve
serves it on 127.0.0.1), MLflow in SQLite under $BLOCKPILOT_HOME, models from the local zoo. Each stage
reuses what an earlier run left: the zoo is cached, labeled prompts are skipped. `DemoPaths` says where each
artifact lands under the home folder (the notebooks read them from there).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blockpilot.blocks import LABEL_CANDIDATES_RULE
from blockpilot.data.labels import LABEL_SCHEMA_VERSION
from blockpilot.data.sources import PromptRecord, zoo_prompts
from blockpilot.decoding.compiled import COMPILE_MODES
from blockpilot.home import HOME_ENV, blockpilot_home
from blockpilot.options import option, positive_int_arg
from blockpilot.zoo.build import RECIPES, zoo_cache_dir

if TYPE_CHECKING:
    from blockpilot.decoding import GenerationConfig
    from blockpilot.decoding.engine import Engine
    from blockpilot.decoding.speed import PolicySpeed
    from blockpilot.models import SpeculativeModels
    from blockpilot.policies.base import BlockSizePolicy


DEFAULT_SIZE = "mini"
SIZE_ENV = "BLOCKPILOT_DEMO_SIZE"  # which run's artifacts the notebooks read


@dataclass(frozen=True)
class DemoPaths:
    """Where the main job leaves each artifact of a zoo size, under the home folder."""

    size: str = DEFAULT_SIZE
    home: Path = field(default_factory=blockpilot_home)

    @classmethod
    def from_environment(cls) -> DemoPaths:
        """The run named by $BLOCKPILOT_DEMO_SIZE (default: the demo's default size) under $BLOCKPILOT_HOME."""
        return cls(os.environ.get(SIZE_ENV, DEFAULT_SIZE))

    @property
    def zoo(self) -> Path:
        return zoo_cache_dir(RECIPES[self.size], 0, self.home)

    @property
    def run(self) -> Path:
        return self.home / "demo" / self.size

    @property
    def cost(self) -> Path:
        """The engine's curve (chains and trees), which the labels, the models and the live table share."""
        return self.run / "cost-static.json"

    @property
    def labels(self) -> Path:
        """Versioned: a run of a newer label schema, or of another default candidate set, labels afresh beside an
        older run's rows, which it cannot read or mix with."""
        rule = hashlib.sha256(LABEL_CANDIDATES_RULE.encode()).hexdigest()[:6]
        return self.run / f"labels-v{LABEL_SCHEMA_VERSION}-{rule}"

    @property
    def predictor(self) -> Path:
        return self.run / "predictor"

    @property
    def paper_predictor(self) -> Path:
        """BlockPilot's configuration as published, trained on the same labels (`PAPER_PREDICTOR`)."""
        return self.run / "paper-predictor"

    @property
    def step_model(self) -> Path:
        return self.run / "step-model"


@dataclass(frozen=True)
class DemoJob:
    home: Path | None = option(None, type=Path, help="artifact folder (default: $BLOCKPILOT_HOME)")
    size: str = option(
        DEFAULT_SIZE,
        choices=tuple(RECIPES),
        help="which zoo the flow runs on: mini (default) ends in about 15 minutes on 2 cores, small is the bigger "
        "zoo the benchmarks use (about 40 minutes to build once), tiny is the test suite's",
    )
    port: int = option(8000, type=positive_int_arg, help="port of the endpoint on 127.0.0.1")
    live_prompts: int = option(24, type=positive_int_arg, help="held-out prompts the policy table decodes live")
    compile: str = option(
        "auto",
        choices=COMPILE_MODES,
        help="how the engine runs the cycle the demo prices, labels, decodes and serves with (auto: compile on a CPU, "
        "compile+graph on a GPU; off: its eager cycle, no compile time)",
    )


# Families whose answers can be checked by eye; the example is taken from them first.
_CHECKABLE_SOURCES = ("count", "arithmetic", "sort", "copy", "reverse")
STAGES = 7
LIVE_ROUNDS = 5  # timed rounds of the live table, each decoding every prompt with every decoder
# The labels' temperatures: the endpoint's policy is held against the fixed shapes at each.
LIVE_TEMPERATURES = (0.0, 1.0)
# At T > 0 every decoder samples a prompt with this seed: a row's output for a seed does not depend on its policy, so
# the decoders decode the same tokens and differ only in speed.
LIVE_SEED = 0
# The live table's keys (`walks` policy names): the adaptive policies the endpoint may serve, and the fixed shapes
# they are held against.
ADAPTIVE_POLICIES = ("request", "paper", "step", "rule")
FIXED_SHAPES = ("autoregressive", "B", "best_fixed", "best_tree")


class StageClock:
    """Prints a banner per stage and keeps how long each one took."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []
        self._name: str | None = None
        self._started = 0.0

    def start(self, name: str, text: str) -> None:
        self._stop()
        self._name, self._started = name, time.perf_counter()
        print(f"\n=== {len(self.times) + 1}/{STAGES} {text}", flush=True)

    def _stop(self) -> None:
        if self._name is not None:
            self.times.append((self._name, time.perf_counter() - self._started))
            self._name = None

    def summary(self) -> str:
        self._stop()
        total = sum(seconds for _, seconds in self.times)
        return (
            "stage times: "
            + ", ".join(f"{name} {seconds:.0f}s" for name, seconds in self.times)
            + f" (total {total:.0f}s)"
        )


def reference_answers(zoo: Path) -> dict[str, str]:
    """The held-out prompts' reference responses, by prompt text, where the zoo's corpus is at hand."""
    corpus = zoo / "corpus.json"
    if not corpus.is_file():
        return {}
    return {row["prompt"]: row["response"] for row in json.loads(corpus.read_text())["heldout"]}


@dataclass(frozen=True)
class Example:
    """The prompt the demo traces, and how close its greedy answer came to the reference (None: no reference)."""

    record: PromptRecord
    reference: str | None = None
    similarity: float | None = None

    @property
    def right(self) -> bool:
        """Whether the target's greedy answer is its reference, exactly."""
        return self.similarity == 1.0


def pick_example(
    models: Any, heldout: list[PromptRecord], references: dict[str, str], tries: int = 32, max_new_tokens: int = 64
) -> Example:
    """The first held-out prompt, among the checkable families, that the target answers exactly right; else the one
    whose greedy answer comes closest to its reference (difflib's ratio; `Example.right` says which); the first
    held-out prompt when there are no references."""
    from blockpilot.decoding import GenerationConfig, generate

    checkable = [r for r in heldout if r.source in _CHECKABLE_SOURCES and r.turns[0] in references][:tries]
    if not checkable:
        return Example(heldout[0])
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=tuple(models.stop_token_ids()))
    scored = []
    for record in checkable:
        result = generate(models, models.encode_prompt(record.turns[0]), config=config)
        answer = models.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
        reference = references[record.turns[0]]
        scored.append(Example(record, reference, difflib.SequenceMatcher(None, answer, reference.strip()).ratio()))
        if scored[-1].right:
            return scored[-1]
    return max(scored, key=lambda example: example.similarity)


def policy_table(
    label_metrics: dict[str, float],
    live: dict[str, PolicySpeed],
    specs: dict[str, str],
    prompts: int,
    baseline: PolicySpeed | None = None,
    decoder: str = "",
    temperature: float = 0.0,
) -> str:
    """Held-out prompts at `temperature`: tau and modeled throughput from the acceptance tables, tau and tokens/s
    measured live (by `decoder`, named in the header), and each live speed over `baseline`'s (transformers' plain
    greedy loop, at T = 0), which closes the table; a dash where a figure was not measured."""
    lines = [
        f"policies on the held-out prompts at T = {temperature:g}: tau and modeled throughput (tokens per unit of "
        f"calibrated cost) walked on their acceptance tables; tau and tokens/s decoded live{decoder}, {prompts} "
        "prompts one at a time (the median of rounds over every decoder), and the speed over transformers' plain "
        "greedy loop",
        f"  {'policy':<31} {'tau':>6} {'modeled':>9} {'live tau':>9} {'tokens/s':>9} {'x loop':>7}",
    ]
    rows = [(key, name, live.get(key)) for key, name in specs.items()]
    if baseline is not None:
        rows.append((None, baseline.policy, baseline))

    def shown(value: float | None, width: int, digits: int) -> str:
        return f"{'-':>{width}}" if value is None or math.isnan(value) else f"{value:>{width}.{digits}f}"

    for key, name, speed in rows:
        prefix = f"T{temperature:g}/"
        tau, modeled = label_metrics.get(f"{prefix}tau_{key}"), label_metrics.get(f"{prefix}throughput_{key}")
        over = speed.tokens_per_s / baseline.tokens_per_s if speed and baseline else None
        lines.append(
            f"  {name:<31} {shown(tau, 6, 2)} {shown(modeled, 9, 1)} {shown(speed and speed.tau, 9, 2)} "
            f"{shown(speed and speed.tokens_per_s, 9, 1)} {shown(over, 7, 2)}"
        )
    return "\n".join(lines)


def shapes_chosen(live: dict[str, PolicySpeed], names: dict[str, str], temperature: float) -> str:
    """The shapes each adaptive policy chose live at `temperature`: its share of the cycles, and the prompts that ran
    it (`PolicySpeed.shape_shares`)."""
    lines = [f"shapes the adaptive policies chose live at T = {temperature:g} (the median round of each prompt)"]
    for key in ADAPTIVE_POLICIES:
        if key in live and live[key].shapes:
            lines.append(f"  {names[key]:<31} {live[key].shape_shares()}")
    return "\n".join(lines)


# The predictors the demo trains on the same labels, compared in MLflow under one parent run: the project's default,
# and the paper's configuration as published (dense over the whole prefill distribution, cross-entropy on B* = the
# best tau, b in B-2..B+2: no autoregression, no trees).
PROJECT_PREDICTOR = "project: sparse top-k, normalized gain on modeled throughput, b in {1, B-2..B+2}"
PAPER_PREDICTOR = "paper: dense, cross-entropy on B*, b in B-2..B+2"


def predictor_comparison(runs: dict[str, dict[str, float]], baselines: dict[str, float], champion: str | None) -> str:
    """The predictors' held-out figures (their `eval` metrics) side by side, then the fixed shapes and oracles."""
    from blockpilot.predictor.evaluation import COMPARED_BASELINES

    lines = [
        "predictors on the held-out labels (modeled: walked on the acceptance tables, priced by the cost curve)",
        f"  {'predictor':<72} {'tau':>6} {'modeled':>9} {'accuracy':>9}",
    ]
    for name, metrics in runs.items():
        mark = " (champion)" if name == champion else ""
        lines.append(
            f"  {name + mark:<72} {metrics.get('tau_pred', math.nan):>6.3f} "
            f"{metrics.get('throughput_pred', math.nan):>9.1f} {metrics.get('accuracy', math.nan):>9.3f}"
        )
    for key, label in COMPARED_BASELINES:
        if f"tau_{key}" in baselines:
            lines.append(
                f"  {label:<72} {baselines[f'tau_{key}']:>6.3f} {baselines.get(f'throughput_{key}', math.nan):>9.1f}"
            )
    return "\n".join(lines)


def fastest(live: dict[str, PolicySpeed], keys: tuple[str, ...]) -> str:
    """Which of `keys` (those measured live) decoded the most tokens per second."""
    measured = [key for key in keys if key in live]
    if not measured:
        raise ValueError(f"none of {list(keys)} was measured live (measured: {sorted(live)})")
    return max(measured, key=lambda key: live[key].tokens_per_s)


def fixed_specs(
    metrics: dict[str, float], temperature: float, block_size: int, depth: int
) -> dict[str, tuple[str | None, str]]:
    """The live table's rows at `temperature` other than the adaptive policies, key -> (policy spec, name): the fixed
    shapes (B, the best fixed b and the best fixed tree of the held-out walks at that temperature, autoregression),
    then the oracles (walked on the tables only: no spec)."""
    prefix = f"T{temperature:g}/"
    best = int(metrics[f"{prefix}best_fixed_b"])
    specs: dict[str, tuple[str | None, str]] = {
        "B": (f"fixed:{block_size}", f"fixed B = {block_size}"),
        "best_fixed": (f"fixed:{best}", f"best fixed b = {best}"),
        "autoregressive": ("autoregressive", "autoregressive (b = 1)"),
        "oracle": (None, "static oracle"),
        "step_oracle": (None, "per-step oracle"),
    }
    if f"{prefix}best_tree_nodes" in metrics:
        nodes = int(metrics[f"{prefix}best_tree_nodes"])
        specs |= {
            "best_tree": (f"tree:{nodes}:{depth}", f"best fixed tree ({nodes} nodes)"),
            "shape_oracle": (None, "shape oracle"),
        }
    return specs


class LiveDecoders:
    """The live tables' policies (by spec) and the engines they decode on, built once for every temperature, on
    engines that sample (a T = 0 row decodes greedily there, as on the endpoint's): one for the chains (every b up to
    `depth`), one for trees (of up to `tree_nodes`, or the tree's own budget where larger), and one for each policy
    whose lone cycles compute its choice (`decide_in_cycle`), as the endpoint's replica does for its adaptive policy
    (the other policies' cycles do not pay for it here). The chains' and the trees' engines are shaped as
    `calibrate`'s of one row at that depth and largest budget, so their cycles are the ones it built."""

    def __init__(self, models: SpeculativeModels, *, compile: str, depth: int, tree_nodes: int | None = None) -> None:
        self.models, self.compile, self.depth, self.tree_nodes = models, compile, depth, tree_nodes
        self.policies: dict[str, BlockSizePolicy] = {}
        self.engines: dict[tuple, Engine] = {}

    def _engine(self, key: tuple, **kwargs: Any) -> Engine:
        from blockpilot.decoding.engine import Engine

        if key not in self.engines:
            self.engines[key] = Engine(self.models, width=self.depth, compile=self.compile, **kwargs)
        return self.engines[key]

    def __call__(self, spec: str) -> tuple[BlockSizePolicy, Engine]:
        """`spec`'s policy and the engine it decodes on."""
        from blockpilot.policies.resolve import resolve_policy

        if spec not in self.policies:
            self.policies[spec] = resolve_policy(spec, self.models)
        policy = self.policies[spec]
        if policy.tree_nodes:
            nodes = max(policy.tree_nodes, self.tree_nodes or 0)
            return policy, self._engine(("tree", nodes), tree_nodes=nodes)
        deciding = ("deciding", spec)
        if deciding not in self.engines and self._engine(("spare",)).decide_in_cycle(policy):
            self.engines[deciding] = self.engines.pop(("spare",))  # an engine with no decision is the next spare
        return policy, self.engines.get(deciding) or self._engine(("chains",))


def decode_live(
    models: SpeculativeModels,
    specs: dict[str, tuple[str | None, str]],
    prompts_ids: list[list[int]],
    config: GenerationConfig,
    decoders: LiveDecoders,
) -> dict[str, PolicySpeed]:
    """Every policy of `specs` with a spec decoding the prompts one at a time at `config`'s temperature, on its
    engine of `decoders`, interleaved (`measure_speeds`); at T = 0 transformers' plain greedy loop too, keyed
    `loop`."""
    from blockpilot.decoding.speed import measure_speeds

    runs = {key: decoders(spec) for key, (spec, _) in specs.items() if spec is not None}
    plain_loop = "loop" if config.temperature == 0 else None  # the plain loop is greedy
    return measure_speeds(models, prompts_ids, runs, config, rounds=LIVE_ROUNDS, plain_loop_key=plain_loop)


def live_metrics(tables: dict[float, dict[str, PolicySpeed]], key: str) -> dict[str, float]:
    """A policy's live figures at each temperature measured, as MLflow holds them (`live/T<t>/tokens_per_s`, `tau`,
    and each shape's share of the cycles, `cycles_share/b1`, `cycles_share/tree15`)."""
    metrics = {}
    for t, live in tables.items():
        if key not in live:
            continue
        speed = live[key]
        metrics |= {f"live/T{t:g}/tokens_per_s": speed.tokens_per_s, f"live/T{t:g}/tau": speed.tau}
        cycles = sum(count for _, count, _ in speed.shapes)
        for shape, count, _ in speed.shapes:
            metrics[f"live/T{t:g}/cycles_share/{shape.replace('=', '').replace(':', '')}"] = count / cycles
    return metrics


def serving_policy(tables: dict[float, dict[str, PolicySpeed]]) -> tuple[str, dict[float, tuple[float, str]]]:
    """The adaptive policy the endpoint serves: of those measured at every temperature, the one whose speed over the
    fastest fixed shape of a temperature is highest at its worst temperature; and, per temperature, that speed
    over the fastest fixed shape and that shape's key."""
    measured = [key for key in ADAPTIVE_POLICIES if all(key in live for live in tables.values())]
    if not tables or not measured:
        raise ValueError(f"no adaptive policy of {list(ADAPTIVE_POLICIES)} was measured live at every temperature")

    fixed = {t: fastest(live, FIXED_SHAPES) for t, live in tables.items()}

    def margins(key: str) -> dict[float, tuple[float, str]]:
        return {t: (live[key].tokens_per_s / live[fixed[t]].tokens_per_s, fixed[t]) for t, live in tables.items()}

    chosen = max(measured, key=lambda key: min(margin for margin, _ in margins(key).values()))
    return chosen, margins(chosen)


def run_demo(job: DemoJob) -> int:
    import httpx
    import ray

    if job.home is not None:
        os.environ[HOME_ENV] = str(job.home)
    from blockpilot.blocks import candidates_around, label_candidates
    from blockpilot.cost import CycleCost
    from blockpilot.decoding import GenerationConfig, generate
    from blockpilot.decoding.calibration import calibrate
    from blockpilot.decoding.compiled import compile_mode
    from blockpilot.decoding.engine import keep_compiled_kernels
    from blockpilot.labeling import LabelSettings
    from blockpilot.models import load_models
    from blockpilot.policies.resolve import resolve_policy
    from blockpilot.predictor.evaluation import comparison_figure
    from blockpilot.serving import ServeLimits
    from blockpilot.tracking import PARENT_RUN_TAG, log_to_run, parent_run, tracking_uri
    from blockpilot.zoo.build import build_zoo
    from pipelines.label import LabelJob, run_label_job
    from pipelines.serve import ModelLoader, serve_locally
    from pipelines.train_predictor import TrainJob, run_train_job
    from pipelines.train_step_policy import StepTrainJob, run_step_train_job

    keep_compiled_kernels()  # compiled cycles under the home folder: a second run loads them
    size = job.size
    paths = DemoPaths(size)
    recipe = RECIPES[size]
    clock = StageClock()
    clock.start("zoo", f"the {size} zoo (target + DFlash drafter, trained here from local text)")
    zoo = build_zoo(size)
    info = json.loads((zoo / "zoo.json").read_text())["evaluation"]
    print(
        f"zoo: {zoo}\n  tau at B={recipe.block_size}: {info['tau_at_B']:.2f}; "
        f"per-prompt oracle over B-2..B+2: {info['oracle_tau']:.2f}"
    )
    models = load_models(zoo / "target", zoo / "drafter")

    # 4 pooled generations per T = 1 row: single-sample tau vectors at T = 1 are mostly noise.
    # The labels' reference generations run the same cycle uncompiled: a set of 96 rows does not repay two actors'
    # compiles on 2 cores (237 s compiled against under 180 s eager, docs/log.md).
    settings = LabelSettings(
        temperatures=(0.0, 1.0), max_new_tokens=recipe.response_tokens, dense=True, samples=4, compile="off"
    )
    depth = max(candidates_around(recipe.block_size))  # the widest candidate: the labels' trees are this deep
    clock.start(
        "cost", f"the cost of the engine's cycle ({job.compile}) at each block size and tree budget, here"
    )
    # A curve from before the cycle's per-step choice, what a request pays beyond its cycles and a switch were priced
    # (`CycleCost.decided`, `CycleCost.request`, `CycleCost.unpriced`) is measured again. It prices what the
    # demo's policies choose from (the labels' candidates, and trees): each width costs a compile, and the mini zoo's
    # b = 2 was 21 s of its 322 s here, priced for nothing (docs/log.md).
    cost = CycleCost.load(paths.cost) if paths.cost.is_file() else None
    priced = cost is not None and cost.decided and cost.flush and cost.start_pass and "switch" not in cost.unpriced
    if not priced:
        calibrate(
            models,
            label_candidates(recipe.block_size),
            compile=job.compile,
            tree_nodes=settings.tree_budgets,
            step_decision=True,
        ).save(paths.cost)
    print(f"cost curve: {paths.cost}")

    clock.start("labels", "labels: the acceptance table of every prompt on Ray Data")
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

    clock.start("training", "the per-request predictors and the per-step model on Ray Train, tracked in MLflow")
    # Two predictors on the same labels, nested under one parent run: MLflow's compare view puts them side by side.
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parent = parent_run("blockpilot-predictor", f"predictors-{size}-{stamp}", {"stage": "compare", "demo": size})
    nested = {PARENT_RUN_TAG: parent} if parent else {}
    common = dict(labels=paths.labels / "train", eval=paths.labels / "heldout", cost=paths.cost, epochs=30)
    # The validation share watches the run (the last epoch is kept) and says where one fixed shape serves instead
    # (`fixed_choices`): `train`'s default 0.2, 40 of the mini zoo's prompts per temperature. A share of 0.05 (10)
    # had the predictor adapt at T = 1, 12.9% faster there in 92% of resamples, where on the held-out prompts it
    # walked 0.89x autoregression and decoded 0.86x (docs/log.md).
    outcome = run_train_job(
        TrainJob(  # with a cost, B* maximizes modeled throughput (the default objective is normalized-gain)
            **common,
            out=paths.predictor,
            name=f"project-{size}-{stamp}",
            extra_tags={**nested, "configuration": PROJECT_PREDICTOR},
        )
    )
    paper = run_train_job(
        TrainJob(
            **common,
            kind="dense",
            objective="ce",
            score="tau",
            candidates=candidates_around(recipe.block_size),
            fixed_choices=False,  # as published: the predictor's choice at every temperature
            out=paths.paper_predictor,
            name=f"paper-{size}-{stamp}",
            extra_tags={**nested, "configuration": PAPER_PREDICTOR},
        )
    )
    runs = {PROJECT_PREDICTOR: outcome.eval_metrics or {}, PAPER_PREDICTOR: paper.eval_metrics or {}}
    champion = PAPER_PREDICTOR if paper.champion else PROJECT_PREDICTOR if outcome.champion else None
    print(predictor_comparison(runs, outcome.eval_metrics or {}, champion))
    if parent:
        log_to_run(parent, figures={"predictors.png": comparison_figure(runs)})
        print(f"MLflow: the parent run predictors-{size}-{stamp} ({parent}) nests both runs; its predictors.png "
              "compares them (docs/operations.md: the compare view)")
    predictor, paper_predictor = (
        f"models:/blockpilot-predictor/{run.model_version}" if run.model_version else str(run.predictor_dir)
        for run in (outcome, paper)
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

    clock.start("example", f"one held-out prompt under {adaptive}")
    heldout = zoo_prompts(zoo, "heldout")
    example = pick_example(models, heldout, reference_answers(zoo))
    result = generate(
        models,
        models.encode_prompt(example.record.turns[0]),
        policy=resolve_policy(adaptive, models),
        config=GenerationConfig(max_new_tokens=64, stop_token_ids=tuple(models.stop_token_ids())),
    )
    print(f"prompt ({example.record.source}): {example.record.turns[0]!r}")
    print(f"answer:    {models.tokenizer.decode(result.token_ids, skip_special_tokens=True)!r}")
    if example.right:
        print(f"reference: {example.reference!r} (answered exactly right)")
    elif example.reference is not None:
        print(
            f"reference: {example.reference!r}: no held-out prompt of the checkable families was answered exactly "
            f"right by this zoo's target (this is the closest, similarity {example.similarity:.2f}); the trace below "
            "shows the speculative decoding of a wrong answer, which is still the target's own greedy one"
        )
    print(result.format_stats())

    clock.start("policies", "every policy on the held-out prompts: tables and live, at T = 0 and T = 1")
    # The embedded Ray of the labels and the training, idle, slowed the live table 8-15% on 2 cores, the drafting
    # policies more than autoregression (docs/log.md): it is stopped while the table runs; the endpoint starts its own.
    ray.shutdown()
    models_of = {
        "request": (f"learned:{predictor}", "learned (per request)"),
        "paper": (f"learned:{paper_predictor}", "learned (the paper's predictor)"),
        "step": (adaptive, "learned+step (per step)"),
        "rule": (f"confidence:{step.model_dir}", "confidence rule (per step)"),
    }
    prompts_ids = [models.encode_prompt(record.turns[0]) for record in heldout[: job.live_prompts]]
    tree_nodes = max(settings.tree_budgets, default=None)  # the trees' engine as calibrate's: its cycles built there
    decoders = LiveDecoders(models, compile=job.compile, depth=depth, tree_nodes=tree_nodes)
    decoder = f" on the engine ({compile_mode(job.compile, models.device)})"
    tables: dict[float, dict[str, PolicySpeed]] = {}
    names: dict[float, dict[str, str]] = {}
    for temperature in LIVE_TEMPERATURES:
        fixed = fixed_specs(step.metrics, temperature, recipe.block_size, depth)
        specs = {key: fixed[key] for key in ("B", "best_fixed")} | models_of | fixed  # the table's order
        config = GenerationConfig(
            max_new_tokens=recipe.response_tokens,
            temperature=temperature,
            seed=LIVE_SEED,
            stop_token_ids=tuple(models.stop_token_ids()),
        )
        live = decode_live(models, specs, prompts_ids, config, decoders)
        loop = live.pop("loop", None)
        names[temperature] = {key: name for key, (_, name) in specs.items()}
        print(policy_table(step.metrics, live, names[temperature], len(prompts_ids), loop, decoder, temperature))
        print(shapes_chosen(live, names[temperature], temperature))
        tables[temperature] = live
    for run, key in ((outcome, "request"), (paper, "paper")):  # each predictor's run gets its live figures
        if run.run_id:
            log_to_run(run.run_id, live_metrics(tables, key))
    # The endpoint's adaptive policy is the one that decoded fastest here, on this device, against the fastest fixed
    # shape at each temperature measured: what wins depends on the device.
    serving, margins = serving_policy(tables)
    adaptive = models_of[serving][0]
    shown = ", ".join(f"T = {t:g}: {margin:.2f}x {names[t][fixed]}" for t, (margin, fixed) in margins.items())
    print(
        f"the endpoint's adaptive policy: {models_of[serving][1]}, the adaptive policy live here whose speed over the "
        f"fastest fixed shape was the highest at its worst temperature ({shown})"
    )

    clock.start("endpoint", f"the endpoint on Ray Serve (127.0.0.1:{job.port}), adaptive = {adaptive}")
    loader = ModelLoader(
        str(zoo / "target"),
        str(zoo / "drafter"),
        predictor,
        step_model=str(step.model_dir),
        policy=adaptive,
        model_name=f"zoo-{size}",
        compile=job.compile,
        # The demo sends one request: one row, not the default eight, keeps the shapes it builds up front few.
        limits=ServeLimits(max_batch=1),
    )
    server = serve_locally(loader, port=job.port, log_level="WARNING")
    try:
        server.wait_healthy()
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            timeout=120,
            json={
                "model": f"zoo-{size}",
                "messages": [{"role": "user", "content": example.record.turns[0]}],
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
        server.shutdown()  # Serve and the embedded Ray end with this process
    print(f"\n{clock.summary()}")
    print("\nnext: the MLflow UI, the runs of every stage side by side:")
    print(f"  mlflow ui --backend-store-uri {tracking_uri()} --host 127.0.0.1 --port 5000")
    print("  http://127.0.0.1:5000/#/experiments?workflowType=machine_learning (the runs tables, not the GenAI view)")
    print(f"the notebooks, on these artifacts: BLOCKPILOT_HOME={paths.home} {SIZE_ENV}={size} jupyter lab notebooks/")
    print("the bigger zoo: python -m blockpilot demo --size small")
    return 0
