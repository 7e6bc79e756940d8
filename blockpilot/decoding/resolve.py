"""The one place that turns a policy spec into a block-size policy, and checks that it fits the models.

Specs, as the command line, the endpoint's configuration, the demo and the benchmarks write them:

    fixed             the drafter's training block size B (what DFlash does)
    fixed:8           b = 8 for every request
    entropy           the training-free heuristic over B-2 .. B+2
    learned:PATH      the trained per-request predictor (a folder, or an MLflow URI such as
                      models:/blockpilot-predictor@champion)
    learned-step:PATH the per-step model (`blockpilot.predictor.step`): b before every cycle (a folder, or
                      models:/blockpilot-step-policy@champion)
    autoregressive    one token per target pass (also what any spec becomes without a drafter)

The policy's `name` ("fixed", "entropy", "learned", "learned-step", "autoregressive") is what every surface
reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockpilot.blocks import candidates_around
from blockpilot.checks import positive_int
from blockpilot.decoding.policies import Autoregressive, BlockSizePolicy, EntropyHeuristic, FixedBlockSize

POLICY_KINDS: tuple[str, ...] = ("fixed", "entropy", "learned", "learned-step", "autoregressive")
LEARNED_KINDS = ("learned", "learned-step")


@dataclass(frozen=True)
class PolicySpec:
    kind: str = "fixed"
    block_size: int | None = None  # fixed: None means the drafter's training block size
    predictor: str | None = None  # learned, learned-step: a model folder or an MLflow model URI

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"policy must be one of {list(POLICY_KINDS)} (see blockpilot.decoding.resolve), got {self.kind!r}")
        if self.block_size is not None:
            positive_int(self.block_size, "the fixed policy's block size")
        if self.kind in LEARNED_KINDS and not self.predictor:
            raise ValueError(f"the {self.kind} policy needs a model: {self.kind}:FOLDER or {self.kind}:models:/NAME@ALIAS")

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        """`fixed`, `fixed:8`, `entropy`, `learned:PATH_OR_URI`, `autoregressive`."""
        kind, _, argument = text.strip().partition(":")
        if kind == "fixed" and argument:
            try:
                return cls("fixed", block_size=int(argument))
            except ValueError:
                raise ValueError(f"policy {text!r}: expected fixed:<integer block size>") from None
        if kind in LEARNED_KINDS:
            return cls(kind, predictor=argument or None)
        if argument:
            raise ValueError(f"policy {text!r}: {kind!r} takes no argument")
        return cls(kind)

    def __str__(self) -> str:
        if self.kind == "fixed" and self.block_size is not None:
            return f"fixed:{self.block_size}"
        if self.kind in LEARNED_KINDS:
            return f"{self.kind}:{self.predictor}"
        return self.kind


def resolve_policy(spec: PolicySpec | str, models: Any, *, predictor: Any | None = None) -> BlockSizePolicy:
    """The policy `spec` describes, checked against `models` (a `SpeculativeModels`). A learned policy loads its
    predictor unless one is passed in (already loaded)."""
    if isinstance(spec, str):
        spec = PolicySpec.parse(spec)
    if models.drafter is None or spec.kind == "autoregressive":
        return Autoregressive()
    train = models.train_block_size
    if spec.kind == "fixed":
        return FixedBlockSize(spec.block_size or train)
    if spec.kind == "entropy":
        window = candidates_around(train)
        return EntropyHeuristic(min(window), max(window))
    if spec.kind == "learned-step":
        from blockpilot.predictor.step import StepPolicy
        from blockpilot.predictor.store import load_step_model

        model = predictor or load_step_model(spec.predictor)
        check_predictor_fits(model.config, models)
        return StepPolicy(model)
    from blockpilot.predictor.policy import LearnedPolicy
    from blockpilot.predictor.store import load_predictor

    predictor = predictor or load_predictor(spec.predictor)
    check_predictor_fits(predictor.config, models)
    return LearnedPolicy(predictor)


def check_predictor_fits(config: Any, models: Any) -> None:
    """Fail early, naming the mismatch, when a predictor was made for another target or drafter."""
    vocab = models.target.get_output_embeddings().weight.shape[0]
    if getattr(config, "vocab_size", vocab) != vocab:  # a step model reads no token ids
        raise ValueError(f"predictor vocabulary mismatch: predictor vocab_size={config.vocab_size}, target has {vocab}")
    train = models.train_block_size
    if config.train_block_size is not None and train is not None and config.train_block_size != train:
        raise ValueError(
            f"the predictor was trained for a drafter with B={config.train_block_size}; this drafter has B={train}"
        )
    context = getattr(models.target.config, "max_position_embeddings", None)
    if context is not None and max(config.candidates) >= context:
        raise ValueError(f"predictor candidates {list(config.candidates)} exceed the target's context of {context}")
