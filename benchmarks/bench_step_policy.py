"""Per-cycle overhead of the per-step policy: its features and model, against the time of one cycle.

    python benchmarks/bench_step_policy.py --target $ZOO/target --drafter $ZOO/drafter [--model STEP_FOLDER]
        [--predictor PREDICTOR]   # a model trained beside a per-request predictor reads its probabilities
    python benchmarks/bench_step_policy.py --target ... --drafter ... --vocab 151936   # features at Qwen3's vocabulary
    python benchmarks/bench_step_policy.py --target ... --drafter ... --batch 32   # a batch's rows, decided at once

Times the per-step policy's decision for --batch rows (`StepPolicy.next_block_sizes`, what the engine calls once
per cycle for the rows that share a policy: the top-1 probability of every row's anchor distribution, then the MLP;
an untrained model over B-2..B+2 unless --model is given) on the device's logits, median of --repeats calls, and
the median cycle of a fixed-B batch of as many rows on the same models; prints both and their ratio, and the
decision made row by row for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockpilot.blocks import candidates_around
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.models import load_models
from blockpilot.models.loading import synchronize
from blockpilot.policies.base import CycleState, PrefillState
from blockpilot.policies.learned import LearnedPolicy
from blockpilot.policies.resolve import resolve_policy
from blockpilot.policies.step import StepPolicy
from blockpilot.predictor.step_model import StepModel, StepModelConfig
from blockpilot.predictor.store import load_predictor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--model", default=None, help="a step model folder (default: untrained)")
    parser.add_argument("--predictor", default=None, help="the per-request predictor a --model was trained beside")
    parser.add_argument("--vocab", type=int, default=None, help="time the features at this vocabulary instead")
    parser.add_argument("--device", default=None)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=1, help="rows decided together and decoded together")
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    models = load_models(args.target, args.drafter, device=args.device)
    train = models.train_block_size
    vocab = args.vocab or models.target.get_output_embeddings().weight.shape[0]
    untrained = StepModelConfig(candidates_around(train), vocab_size=vocab, train_block_size=train)
    model = StepModel.load(args.model) if args.model else StepModel(untrained)
    # A model trained beside a per-request predictor reads its b0 from the cycle (first_block_size) and its
    # probabilities from the request's prefill, computed once per request (not timed here: once, not per cycle).
    prior = None
    if model.config.prior:
        if args.predictor is None:
            parser.error("this --model reads a per-request predictor's choice and probabilities: give it --predictor")
        prior = LearnedPolicy(load_predictor(args.predictor))
    policy = StepPolicy(model, prior)
    generator = torch.Generator(device="cpu").manual_seed(0)
    prefill = PrefillState(torch.randn(vocab, generator=generator).to(models.device), torch.tensor([0]), 0.0, train)

    def batch_of_states() -> list[CycleState]:
        logits = (torch.randn(args.batch, vocab, generator=generator) * 4).to(models.device)
        tokens = torch.randint(vocab, (args.batch, 2), generator=generator).tolist()  # read by a token model
        return [
            CycleState(
                i, train, 2, 10, 128, 0.0, anchor_logits=x, first_block_size=train, prefill=prefill,
                recent_tokens=tuple(tail),
            )
            for i, (x, tail) in enumerate(zip(logits, tokens, strict=True))
        ]

    def timed(decide, batches: list[list[CycleState]]) -> float:
        for states in batches[:10]:
            decide(states)
        times = []
        for states in batches[10:]:
            synchronize(models.device)
            started = time.perf_counter()
            decide(states)
            synchronize(models.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    batches = [batch_of_states() for _ in range(args.repeats + 10)]
    decision = timed(policy.next_block_sizes, batches)
    row_by_row = timed(lambda states: [policy.next_block_size(state) for state in states], batches)

    prompt = models.encode_prompt("Write the numbers from 1 to 40, separated by commas.")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    fixed = resolve_policy("fixed", models)
    requests = [GenerationRequest(prompt, config, fixed) for _ in range(args.batch)]
    generate_many(models, requests, max_batch=args.batch)  # warm-up
    per_cycle = []
    for _ in range(5):
        results = generate_many(models, requests, max_batch=args.batch)
        per_cycle.append(statistics.median(r.decode_time_s / max(1, r.cycles) for r in results))
    cycle = statistics.median(per_cycle)
    print(
        f"device={models.device} threads={torch.get_num_threads()} vocab={vocab} batch={args.batch} "
        f"candidates={list(model.config.candidates)}"
    )
    print(f"step policy decision for {args.batch} rows: {decision * 1e3:.3f} ms (median of {args.repeats})")
    print(f"  row by row: {row_by_row * 1e3:.3f} ms ({100 * row_by_row / cycle:.2f}% of a cycle)")
    print(f"one cycle of {args.batch} rows at b={train}: {cycle * 1e3:.3f} ms (median over 5 generations)")
    print(f"overhead: {100 * decision / cycle:.2f}% of a cycle")


if __name__ == "__main__":
    main()
