"""Per-cycle overhead of the per-step policy: its features and model, against the time of one cycle.

    python benchmarks/bench_step_policy.py --target $ZOO/target --drafter $ZOO/drafter [--model STEP_FOLDER]
        [--predictor PREDICTOR]   # a model trained beside a per-request predictor reads its probabilities
    python benchmarks/bench_step_policy.py --target ... --drafter ... --vocab 151936   # features at Qwen3's vocabulary

Times `StepPolicy.next_block_size` (entropy and top-k of the anchor distribution, then the MLP; an untrained
model over B-2..B+2 unless --model is given) on the device's logits, median of --repeats calls, and the
median cycle of a fixed-B generation on the same models; prints both and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockpilot.blocks import candidates_around
from blockpilot.decoding import GenerationConfig, generate
from blockpilot.decoding.policies import CycleState, FixedBlockSize, PrefillState
from blockpilot.decoding.resolve import resolve_policy
from blockpilot.models import load_models
from blockpilot.predictor.policy import LearnedPolicy
from blockpilot.predictor.step import StepModel, StepModelConfig, StepPolicy
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
    args = parser.parse_args()

    from transformers.utils import logging

    logging.disable_progress_bar()
    models = load_models(args.target, args.drafter, device=args.device)
    train = models.train_block_size
    model = StepModel.load(args.model) if args.model else StepModel(StepModelConfig(candidates_around(train), train_block_size=train))
    # A model trained beside a per-request predictor reads its b0 from the cycle (first_block_size) and its
    # probabilities from the request's prefill, computed once per request (not timed here: once, not per cycle).
    prior = None
    if model.config.uses_prior_probabilities:
        if args.predictor is None:
            parser.error("this --model reads a per-request predictor's probabilities: give it with --predictor")
        prior = LearnedPolicy(load_predictor(args.predictor))
    elif model.config.uses_prior:
        prior = FixedBlockSize(train)
    policy = StepPolicy(model, prior)
    vocab = args.vocab or models.target.get_output_embeddings().weight.shape[0]
    generator = torch.Generator(device="cpu").manual_seed(0)
    logits = [(torch.randn(vocab, generator=generator) * 4).to(models.device) for _ in range(args.repeats + 10)]
    prefill = PrefillState(logits[0], torch.tensor([0]), 0.0, train)
    states = [
        CycleState(i, train, 2, 10, 128, 0.0, anchor_logits=x, first_block_size=train, prefill=prefill)
        for i, x in enumerate(logits)
    ]
    for state in states[:10]:
        policy.next_block_size(state)
    times = []
    for state in states[10:]:
        if models.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        policy.next_block_size(state)
        if models.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    decision = statistics.median(times)

    prompt = models.encode_prompt("Write the numbers from 1 to 40, separated by commas.")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    fixed = resolve_policy("fixed", models)
    generate(models, prompt, policy=fixed, config=config)  # warm-up
    per_cycle = []
    for _ in range(5):
        result = generate(models, prompt, policy=fixed, config=config)
        per_cycle.append(result.decode_time_s / max(1, result.cycles))
    cycle = statistics.median(per_cycle)
    print(
        f"device={models.device} threads={torch.get_num_threads()} vocab={vocab} candidates={list(model.config.candidates)}"
    )
    print(f"step policy decision: {decision * 1e3:.3f} ms (median of {args.repeats})")
    print(f"one cycle at b={train}: {cycle * 1e3:.3f} ms (median over 5 generations)")
    print(f"overhead: {100 * decision / cycle:.2f}% of a cycle")


if __name__ == "__main__":
    main()
