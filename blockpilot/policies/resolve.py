"""The one place that turns a policy spec into a block-size policy, and checks that it fits the models.

Specs, as the command line, the endpoint's configuration, the demo and the benchmarks write them:

    fixed             the drafter's training block size B (what DFlash does)
    fixed:8           b = 8 for every request
    entropy           the training-free heuristic over B-2 .. B+2
    learned:PATH      the trained per-request predictor (a folder, or an MLflow URI such as
                      models:/blockpilot-predictor@champion)
    learned-step:PATH the per-step model (`blockpilot.policies.step`): b before every cycle (a folder, or
                      models:/blockpilot-step-policy@champion)
    learned+step:PREDICTOR,STEP
                      both: the per-request predictor drafts the first cycle, the step model picks b before
                      every later one (reading the predictor's choice when it was trained with it)
    confidence:PATH   the confidence rule (`blockpilot.predictor.confidence`): autoregression or a chain before every
                      cycle, from the anchor's top-1 probability and the last cycle, priced by the engine's measured
                      cycles (PATH: its JSON, or a folder holding one: `blockpilot train-step` writes one beside its
                      step model)
    tree:N            a draft tree of N nodes, B deep, verified in one pass (`blockpilot.tree`)
    tree:N:D          the same, D deep (D - 1 levels below the root: a tree's block size; a drafter may draft
                      past its B, and trees gain more from depth than chains do)
    autoregressive    one token per target pass (also what any spec becomes without a drafter)

The policy's `name` ("fixed", "entropy", "learned", "learned-step", "learned+step", "confidence", "tree",
"autoregressive") is what
every surface reports. `adaptive_spec` is the server's default: the most the models at hand allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockpilot.blocks import candidates_around
from blockpilot.checks import positive_int
from blockpilot.policies.base import BlockSizePolicy
from blockpilot.policies.fixed import Autoregressive, EntropyHeuristic, FixedBlockSize, FixedTree

POLICY_KINDS: tuple[str, ...] = (
    "fixed",
    "entropy",
    "learned",
    "learned-step",
    "learned+step",
    "confidence",
    "tree",
    "autoregressive",
)
# Kinds that take files: the spec fields their argument fills (comma-separated when several), and what is missing
# when one is absent.
_ARGUMENTS: dict[str, tuple[tuple[str, ...], str]] = {
    "learned": (("predictor",), "a model: learned:FOLDER (a folder or models:/NAME@ALIAS)"),
    "learned-step": (("step_model",), "a model: learned-step:FOLDER (a folder or models:/NAME@ALIAS)"),
    "learned+step": (
        ("predictor", "step_model"),
        "a model: learned+step:PREDICTOR,STEP_MODEL (each a folder or models:/NAME@ALIAS)",
    ),
    "confidence": (("rule",), "a rule: confidence:PATH (its JSON, or a folder holding confidence.json)"),
}


@dataclass(frozen=True)
class PolicySpec:
    kind: str = "fixed"
    block_size: int | None = None  # fixed, tree (its depth): None means the drafter's training block size
    predictor: str | None = None  # learned, learned+step: the per-request predictor (folder or MLflow URI)
    step_model: str | None = None  # learned-step, learned+step: the per-step model (folder or MLflow URI)
    tree_nodes: int | None = None  # tree: the drafted nodes a tree holds
    rule: str | None = None  # confidence: the rule's file or folder (or a step model's MLflow URI)

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(
                f"policy must be one of {list(POLICY_KINDS)} (see blockpilot.policies.resolve), got {self.kind!r}"
            )
        if self.block_size is not None and self.kind != "tree":
            positive_int(self.block_size, "the fixed policy's block size")
        if self.kind == "tree":
            positive_int(self.tree_nodes, "the tree policy's node budget (tree:N)")
            if self.block_size is not None:  # tree:N:D, checked as the policy checks it
                FixedTree(self.tree_nodes, self.block_size)
        if self.kind in _ARGUMENTS:
            fields, needed = _ARGUMENTS[self.kind]
            if not all(getattr(self, name) for name in fields):
                raise ValueError(f"the {self.kind} policy needs {needed}")

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        """`fixed`, `fixed:8`, `entropy`, `learned:PATH_OR_URI`, `learned+step:P,S`, `tree:N`,
        `tree:N:D`, `autoregressive`."""
        kind, _, argument = text.strip().partition(":")
        if kind == "fixed" and argument:
            try:
                return cls("fixed", block_size=int(argument))
            except ValueError:
                raise ValueError(f"policy {text!r}: expected fixed:<integer block size>") from None
        if kind == "tree":
            nodes, _, depth = argument.partition(":")
            try:
                budget, deep = int(nodes), int(depth) if depth else None
            except ValueError:
                raise ValueError(
                    f"policy {text!r}: expected tree:<integer node budget> or tree:<node budget>:<integer depth>"
                ) from None
            return cls("tree", tree_nodes=budget, block_size=deep)
        if kind in _ARGUMENTS:
            fields, _ = _ARGUMENTS[kind]
            if len(fields) == 1:
                return cls(kind, **{fields[0]: argument or None})
            values = argument.split(",", len(fields) - 1)
            if argument and len(values) != len(fields):
                raise ValueError(f"policy {text!r}: expected {kind}:{','.join(name.upper() for name in fields)}")
            return cls(kind, **{name: value.strip() or None for name, value in zip(fields, values)})
        if argument:
            raise ValueError(f"policy {text!r}: {kind!r} takes no argument")
        return cls(kind)

    def __str__(self) -> str:
        if self.kind == "fixed" and self.block_size is not None:
            return f"fixed:{self.block_size}"
        if self.kind == "tree":
            return f"tree:{self.tree_nodes}" + (f":{self.block_size}" if self.block_size is not None else "")
        if self.kind in _ARGUMENTS:
            return f"{self.kind}:" + ",".join(str(getattr(self, name)) for name in _ARGUMENTS[self.kind][0])
        return self.kind


def adaptive_spec(predictor: str | None = None, step_model: str | None = None) -> PolicySpec:
    """The adaptive policy the models at hand allow: per-request + per-step, either alone, else fixed B."""
    if predictor and step_model:
        return PolicySpec("learned+step", predictor=predictor, step_model=step_model)
    if step_model:
        return PolicySpec("learned-step", step_model=step_model)
    if predictor:
        return PolicySpec("learned", predictor=predictor)
    return PolicySpec("fixed")


def resolve_policy(
    spec: PolicySpec | str, models: Any, *, predictor: Any | None = None, step_model: Any | None = None
) -> BlockSizePolicy:
    """The policy `spec` describes, checked against `models` (a `SpeculativeModels`). A learned policy loads its
    models unless they are passed in (already loaded)."""
    if isinstance(spec, str):
        spec = PolicySpec.parse(spec)
    if models.drafter is None or spec.kind == "autoregressive":
        return Autoregressive()
    train = models.train_block_size
    if spec.kind == "fixed":
        return FixedBlockSize(spec.block_size or train)
    if spec.kind == "tree":
        return FixedTree(spec.tree_nodes, spec.block_size or train)
    if spec.kind == "entropy":
        window = candidates_around(train)
        return EntropyHeuristic(min(window), max(window))
    if spec.kind == "confidence":
        from blockpilot.policies.confidence import ConfidencePolicy
        from blockpilot.predictor.confidence import ConfidenceRule
        from blockpilot.predictor.store import MODEL_URI_PREFIXES, resolve_predictor_dir

        where = resolve_predictor_dir(spec.rule) if spec.rule.startswith(MODEL_URI_PREFIXES) else spec.rule
        rule = ConfidenceRule.load(where)
        context = getattr(models.target.config, "max_position_embeddings", None)
        if context is not None and max(rule.candidates) >= context:
            raise ValueError(f"the rule's candidates {list(rule.candidates)} exceed the target's context of {context}")
        return ConfidencePolicy(rule)
    from blockpilot.policies.learned import LearnedPolicy
    from blockpilot.policies.step import PriorStepPolicy, StepPolicy
    from blockpilot.predictor.step_model import load_step_model
    from blockpilot.predictor.store import load_predictor

    if spec.kind in ("learned", "learned+step"):
        predictor = predictor or load_predictor(spec.predictor)
        check_predictor_fits(predictor.config, models)
        if spec.kind == "learned+step" and predictor.config.tree_budgets:
            raise ValueError(
                "this per-request predictor chooses among tree shapes too; a step model reads a predictor over block "
                f"sizes alone (its trees: {list(predictor.config.tree_budgets)} nodes): use learned:PREDICTOR"
            )
    if spec.kind in ("learned-step", "learned+step"):
        step_model = step_model or load_step_model(spec.step_model)
        check_predictor_fits(step_model.config, models)
    if spec.kind == "learned":
        return LearnedPolicy(predictor)
    if spec.kind == "learned-step":
        return StepPolicy(step_model)
    if tuple(predictor.config.candidates) != tuple(step_model.config.candidates):
        raise ValueError(
            f"the per-request predictor's candidates {list(predictor.config.candidates)} differ from the step "
            f"model's {list(step_model.config.candidates)}"
        )
    return PriorStepPolicy(step_model, LearnedPolicy(predictor))


def check_predictor_fits(config: Any, models: Any) -> None:
    """Fail early, naming the mismatch, when a predictor was made for another target or drafter."""
    vocab = models.target.get_output_embeddings().weight.shape[0]
    if config.vocab_size != vocab:
        raise ValueError(f"predictor vocabulary mismatch: predictor vocab_size={config.vocab_size}, target has {vocab}")
    train = models.train_block_size
    if config.train_block_size is not None and train is not None and config.train_block_size != train:
        raise ValueError(
            f"the predictor was trained for a drafter with B={config.train_block_size}; this drafter has B={train}"
        )
    context = getattr(models.target.config, "max_position_embeddings", None)
    if context is not None and max(config.candidates) >= context:
        raise ValueError(f"predictor candidates {list(config.candidates)} exceed the target's context of {context}")
