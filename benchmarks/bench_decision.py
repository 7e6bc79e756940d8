"""What the confidence rule's decision adds to a cycle at batch 1: the anchor's top-1 probability computed inside the
compiled cycle, and the rule's choice on the host, against the cycle without them.

    python benchmarks/bench_decision.py --zoo $ZOO [--rule $STEP_FOLDER] [--rounds 7]

Two decoders over the same models, one whose cycle skips the top-1 probability, compiled alike; in interleaved rounds
each runs --cycles cycles of one row at width 1 (autoregressive, the drafter's context kept for later) and at the
drafter's widest b; the median cycle of each, and the median time of one choice of the rule (`ConfidencePolicy`'s
hook for one row, an untrained rule over b in {1, B-2..B+2} unless --rule is given) against the hook of a policy
that keeps b. Prints the decision's share of each cycle.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from pathlib import Path

import numpy as np
import torch

from blockpilot.blocks import label_candidates
from blockpilot.decoding.static import StaticDecoder, span_bucket
from blockpilot.models import load_models
from blockpilot.policies.base import BlockSizePolicy, CycleState
from blockpilot.policies.confidence import ConfidencePolicy
from blockpilot.predictor.confidence import EDGES, OUTCOMES, ConfidenceRule


def without_confidence(decoder: StaticDecoder) -> StaticDecoder:
    """The decoder keeping its anchors' logits alone, without their top-1 probability (the cycle before the rule)."""

    def keep_anchor(self, n, anchor):
        self.anchor_logits[:n].copy_(anchor.float())

    decoder._keep_anchor = types.MethodType(keep_anchor, decoder)
    return decoder


def timed_cycles(decoder: StaticDecoder, width: int, context: str, cycles: int) -> float:
    """Median seconds of `cycles` cycles of row 0 at `width` (its length reset before each: the same span)."""
    times = []
    for _ in range(cycles):
        decoder.length[0] = 64
        started = time.perf_counter()
        decoder.cycle(1, span_bucket(64 + decoder.width, decoder.capacity), width, False, context)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, required=True, help="a zoo folder (target/ and drafter/)")
    parser.add_argument("--rule", default=None, help="a confidence rule (its JSON, or a step model's folder)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cycles", type=int, default=200)
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    models = load_models(args.zoo / "target", args.zoo / "drafter")
    candidates = label_candidates(models.train_block_size)
    widest = max(candidates)
    decoders = {}
    for name in ("without", "with"):
        decoder = StaticDecoder(models, rows=2, width=widest, capacity=512, compile="compile")
        decoders[name] = without_confidence(decoder) if name == "without" else decoder
        prompt = torch.randint(0, models.target.get_input_embeddings().weight.shape[0], (64,))
        decoder.prefill(0, [prompt])
        decoder.place(0, length=64, last_token=int(prompt[-1]), temperature=0.0, seed=0)
    if args.rule:
        rule = ConfidenceRule.load(args.rule)
    else:
        commits = np.random.default_rng(0).uniform(1, widest, (1, len(EDGES) + 1, OUTCOMES, len(candidates)))
        cost = {b: 1e-3 * b for b in candidates}
        rule = ConfidenceRule(candidates, (0.0,), commits, np.full(commits.shape[:-1], 100), cost)
    policy, keeper = ConfidencePolicy(rule), BlockSizePolicy()
    logits = decoders["with"].anchor_logits[0]
    state = CycleState(3, widest, 2, 10, 64, 0.0, logits, anchor_confidence=0.93, prices={1: 3e-4, widest: 1e-3})

    def hook_seconds(hooked: BlockSizePolicy) -> float:
        times = []
        for _ in range(args.cycles):
            started = time.perf_counter()
            hooked.next_block_sizes([state])
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    shapes = [(1, "defer"), (widest, "encode")]
    rounds: dict[tuple, list[float]] = {}
    for round_ in range(args.rounds + 1):  # the first round builds the steps
        for width, context in shapes:
            for name, decoder in decoders.items():
                seconds = timed_cycles(decoder, width, context, args.cycles)
                if round_:
                    rounds.setdefault((width, name), []).append(seconds)
        for name, hooked in (("rule", policy), ("keeps b", keeper)):
            seconds = hook_seconds(hooked)
            if round_:
                rounds.setdefault(("hook", name), []).append(seconds)
    median = {key: statistics.median(values) for key, values in rounds.items()}
    hook = median[("hook", "rule")] - median[("hook", "keeps b")]
    print(f"{models.target_id}: batch 1, {args.rounds} interleaved rounds of {args.cycles} cycles (medians)")
    print(f"  the rule's choice on the host: {median[('hook', 'rule')] * 1e6:.1f} us a row, "
          f"{hook * 1e6:.1f} us more than a policy that keeps b")
    for width, context in shapes:
        bare, full = median[(width, "without")], median[(width, "with")]
        added = full - bare + hook
        print(
            f"  width {width} ({context}): cycle {bare * 1e3:.3f} ms without the decision, {full * 1e3:.3f} ms with "
            f"the top-1 probability in the cycle; with the choice too: +{added * 1e6:.1f} us = {added / bare:+.1%}"
        )


if __name__ == "__main__":
    main()
