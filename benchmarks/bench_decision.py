"""What a per-step decision adds to a cycle at batch 1: the confidence rule's (the anchor's top-1 probability computed
inside the compiled cycle, the rule's choice on the host) and, with --step-model, the step model's computed inside the
compiled cycle (`Engine.decide_in_cycle`) against its hook on the host; each against the cycle without them.

    python benchmarks/bench_decision.py --zoo $ZOO [--rule $STEP_FOLDER] [--step-model $STEP_MODEL
        [--predictor $PREDICTOR]] [--rounds 7] [--compiles 3]

Decoders over the same models, compiled alike: one whose cycle skips the top-1 probability, the cycle as it is, and
with --step-model one whose cycle also chooses the step model's next b; in interleaved rounds each runs --cycles
cycles of one row at width 1 (autoregressive, the drafter's context kept for later) and at the drafter's widest b;
the median cycle of each, and the median time of one choice on the host: the rule's (`ConfidencePolicy`'s hook for
one row, an untrained rule over b in {1, B-2..B+2} unless --rule is given) and the step model's hook, each against
the hook of a policy that keeps b. Prints each decision's share of each cycle. A step model trained beside a
per-request predictor (`learned+step`) needs it: --predictor.

On a CPU two compiles of one cycle can differ by more than a decision costs (their code's layout: docs/log.md),
so each decoder is compiled --compiles times, each time under another of inductor's kernel-naming styles (the same
computation in another shared object), and each figure compares the mean over its compiles; the spread between
the compiles of the cycle as it is, printed beside each figure, is that floor. The cycle compiled with inductor's
size asserts, which the engine turns off (`inductor_options`), is printed too: what they cost a cycle.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from blockpilot.blocks import label_candidates
from blockpilot.decoding import steps
from blockpilot.decoding.static import StaticDecoder, span_bucket
from blockpilot.models import load_models
from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState
from blockpilot.policies.confidence import ConfidencePolicy
from blockpilot.policies.learned import LearnedPolicy
from blockpilot.policies.step import PriorStepPolicy, StepPolicy
from blockpilot.predictor.confidence import EDGES, OUTCOMES, ConfidenceRule
from blockpilot.predictor.step_model import StepModel, load_step_model
from blockpilot.predictor.store import load_predictor


def without_confidence(decoder: StaticDecoder) -> StaticDecoder:
    """The decoder keeping its anchors' logits alone, without their top-1 probability (the cycle before the rule)."""

    def keep_anchor(self, n, anchor):
        self.anchor_logits[:n].copy_(anchor.float())
        return self.anchor_confidence[:n]  # what the buffer holds, not computed: the cycle reports it as it is

    decoder._keep_anchor = types.MethodType(keep_anchor, decoder)
    return decoder


@contextmanager
def compiled_with(**changed: object) -> Iterator[None]:
    """Steps built inside compile with inductor's options `changed` from the engine's (`inductor_options`)."""
    options = steps.inductor_options
    steps.inductor_options = lambda device: {**(options(device) or {}), **changed}
    try:
        yield
    finally:
        steps.inductor_options = options


# Inductor's kernel-naming styles (`cpp.descriptive_names`, the first its default): a decoder's compiles differ only
# in them, so each is another shared object of the same computation (what a compile's code layout alone moves).
NAMING = ("original_aten", "inductor_node", "torch")
ASSERTS = {"size_asserts": True}  # every input's sizes checked at every call (the engine's options before it)


def timed_cycles(decoder: StaticDecoder, width: int, context: str, cycles: int) -> float:
    """Median seconds of `cycles` cycles of row 0 at `width` (its length reset before each: the same span)."""
    times = []
    for _ in range(cycles):
        decoder.length[0] = 64
        started = time.perf_counter()
        decoder.cycle(1, span_bucket(64 + decoder.width, decoder.capacity), width, False, context)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_policy(model: StepModel, predictor: str | None) -> StepPolicy:
    return PriorStepPolicy(model, LearnedPolicy(load_predictor(predictor))) if model.config.prior else StepPolicy(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True, help="a zoo folder (target/ and drafter/)")
    parser.add_argument("--rule", default=None, help="a confidence rule (its JSON, or a step model's folder)")
    parser.add_argument("--step-model", default=None, help="a step model (folder or models:/ URI)")
    parser.add_argument("--predictor", default=None, help="the per-request predictor a --step-model reads")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument(
        "--compiles", type=int, default=2, choices=range(1, len(NAMING) + 1), help="compiles of each decoder"
    )
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    models = load_models(args.zoo / "target", args.zoo / "drafter")
    candidates = label_candidates(models.train_block_size)
    widest = max(candidates)
    step = None
    if args.step_model:
        model = load_step_model(args.step_model)
        if model.config.prior and not args.predictor:
            parser.error("this step model reads a per-request predictor's choice: give it with --predictor")
        step = step_policy(model, args.predictor)
        # Its hook on the host, timed choosing as the cycle's choice is forced to: a model that keeps its prior at a
        # temperature answers that row's hook with b0 at once (what it costs there is a policy that keeps b's).
        forced = copy.deepcopy(model)
        forced.config = replace(forced.config, prior_temperatures=())
        host_step = step_policy(forced, args.predictor)
    prompt = torch.randint(0, models.target.get_input_embeddings().weight.shape[0], (64,))
    shapes = [(1, "defer"), (widest, "encode")]
    decoders: dict[tuple[str, str], StaticDecoder] = {}
    for name in ("without", "with", "asserts", "step")[: 4 if step else 3]:
        for naming in NAMING[: 1 if name == "asserts" else args.compiles]:
            decoder = StaticDecoder(models, rows=2, width=widest, capacity=512, compile="compile")
            decoders[(name, naming)] = without_confidence(decoder) if name == "without" else decoder
            decoder.prefill(0, [prompt])
            decoder.place(0, length=64, last_token=int(prompt[-1]), temperature=0.0, seed=0)
            if name == "step":
                decision = step.cycle_decision(models.device)
                decoder.set_decision(decision, decision.inputs)
                # the request's bias: T = 0 and, beside a prior, its b0 and probabilities for a prompt-like
                # distribution
                noise = torch.Generator().manual_seed(0)
                logits = torch.randn(models.target.get_input_embeddings().weight.shape[0], generator=noise)
                first = PrefillState(logits, prompt, 0.0, models.train_block_size, first_token=int(prompt[-1]))
                decoder.set_decision_inputs(0, decision.row_inputs(first, widest))
            options = {"cpp.descriptive_names": naming} | (ASSERTS if name == "asserts" else {})
            with compiled_with(**options):
                for width, context in shapes:
                    timed_cycles(decoder, width, context, 1)  # builds its steps now, with those options
    if args.rule:
        rule = ConfidenceRule.load(args.rule)
    else:
        commits = np.random.default_rng(0).uniform(1, widest, (1, len(EDGES) + 1, OUTCOMES, len(candidates)))
        cost = {b: 1e-3 * b for b in candidates}
        rule = ConfidenceRule(candidates, (0.0,), commits, np.full(commits.shape[:-1], 100), cost)
    policy, keeper = ConfidencePolicy(rule), BlockSizePolicy()
    logits = decoders[("with", NAMING[0])].anchor_logits[0]
    prefill = PrefillState(logits, prompt, 0.0, models.train_block_size, first_token=int(prompt[-1]))
    state = CycleState(
        cycle=3,
        block_size=widest,
        acceptance_length=2,
        new_tokens=10,
        max_new_tokens=64,
        temperature=0.0,
        anchor_logits=logits,
        first_block_size=widest,
        recent_tokens=(5, 7),
        prefill=prefill,
        anchor_confidence=0.93,
        prices={1: 3e-4, widest: 1e-3},
    )
    hooks = {"rule": policy, "keeps b": keeper} | ({"step": host_step} if step else {})

    def hook_seconds(hooked: BlockSizePolicy) -> float:
        times = []
        for _ in range(args.cycles):
            started = time.perf_counter()
            hooked.next_block_sizes([state])
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    rounds: dict[tuple, list[float]] = {}
    for round_ in range(args.rounds + 1):  # the first round builds the steps
        for width, context in shapes:
            for (name, naming), decoder in decoders.items():
                seconds = timed_cycles(decoder, width, context, args.cycles)
                if round_:
                    rounds.setdefault((width, name, naming), []).append(seconds)
        for name, hooked in hooks.items():
            seconds = hook_seconds(hooked)
            if round_:
                rounds.setdefault(("hook", name), []).append(seconds)
    median = {key: statistics.median(values) for key, values in rounds.items()}

    def compiled(width: int, name: str) -> list[float]:
        """Each compile's median cycle of decoder `name` at `width`."""
        return [median[(width, name, naming)] for naming in NAMING[: args.compiles] if (width, name, naming) in median]

    names = {name for name, _ in decoders}
    mean = {(width, name): statistics.fmean(compiled(width, name)) for width, _ in shapes for name in names}
    hook = median[("hook", "rule")] - median[("hook", "keeps b")]
    print(
        f"{models.target_id}: batch 1, {args.rounds} interleaved rounds of {args.cycles} cycles (medians); each "
        f"decoder compiled {args.compiles} times, the mean of its compiles"
    )
    print(
        f"  the rule's choice on the host: {median[('hook', 'rule')] * 1e6:.1f} us a row, "
        f"{hook * 1e6:.1f} us more than a policy that keeps b"
    )
    for width, context in shapes:
        bare, full = mean[(width, "without")], mean[(width, "with")]
        spread = max(compiled(width, "with")) / min(compiled(width, "with")) - 1
        added = full - bare + hook
        print(
            f"  width {width} ({context}): cycle {bare * 1e3:.3f} ms without the decision, {full * 1e3:.3f} ms with "
            f"the top-1 probability in the cycle; with the choice too: {added * 1e6:+.1f} us = {added / bare:+.1%}; "
            f"the compiles of the cycle with it differ by {spread:.1%}; with inductor's size asserts: "
            f"{mean[(width, 'asserts')] / median[(width, 'with', NAMING[0])] - 1:+.1%}"
        )
    if step:
        host = median[("hook", "step")] - median[("hook", "keeps b")]
        print(f"  the step model's choice on the host: {host * 1e6:.1f} us a row more than a policy that keeps b")
        for width, context in shapes:
            full, inside = mean[(width, "with")], mean[(width, "step")]
            each = ", ".join(f"{value / full - 1:+.1%}" for value in compiled(width, "step"))
            print(
                f"  width {width} ({context}): cycle {full * 1e3:.3f} ms, {inside * 1e3:.3f} ms with the step model's "
                f"choice inside it: {inside / full - 1:+.1%} (its compiles: {each}; its hook on the host: "
                f"{host / full:+.1%})"
            )


if __name__ == "__main__":
    main()
