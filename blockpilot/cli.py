"""The `blockpilot` command (also `python -m blockpilot`).

The stages that run on Ray (label, train, serve, zoo build on Ray Train, demo) declare their options on
their job dataclasses in `pipelines/`; this module only mounts them as subcommands, imported when run.
Nothing imports this module back.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from blockpilot.options import (
    RANDOM_FAMILIES,
    block_size_list,
    from_args,
    model_ref,
    non_negative_float_arg,
    non_negative_int_arg,
    positive_int_arg,
    top_p_arg,
    tree_budget_list,
)


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


# ----------------------------------------------------------------------------- commands


def cmd_zoo_random(args: argparse.Namespace) -> int:
    from blockpilot.zoo.random_models import write_random_zoo

    _quiet_transformers()
    paths = write_random_zoo(args.out, seed=args.seed, family=args.family)
    print(f"target:  {paths['target']}\ndrafter: {paths['drafter']}")
    return 0


def cmd_zoo_build(args: argparse.Namespace) -> int:
    from pipelines.build_zoo import ZooBuildJob, run_zoo_build

    _quiet_transformers()
    print(f"zoo: {run_zoo_build(from_args(ZooBuildJob, args))}")
    return 0


def cmd_zoo_evaluate(args: argparse.Namespace) -> int:
    from blockpilot.files import write_text_atomic
    from blockpilot.zoo.build import reevaluate_zoo

    _quiet_transformers()
    evaluation = reevaluate_zoo(args.zoo, device=args.device)
    for label, summary in (("T = 0", evaluation), ("T = 1", evaluation["T1"])):
        sizes = list(summary["tau_by_block_size"])
        print(f"held-out tau(b) at {label}, b = {sizes[0]}..{sizes[-1]}")
        groups = {"all": summary, **summary["by_source"], **{f"ends: {k}": v for k, v in summary["by_ending"].items()}}
        print(f"  {'':<14} {'prompts':>7} {'to budget':>9} {'peak b':>6}  tau(b)")
        for name, group in groups.items():
            curve = " ".join(f"{tau:.2f}" for tau in group["tau_by_block_size"].values())
            budget = f"{group['budget_share']:.2f}" if "budget_share" in group else ""
            print(f"  {name:<14} {group['prompts']:>7} {budget:>9} {str(group['peak_block_size']):>6}  {curve}")
    if args.out is not None:
        write_text_atomic(args.out, json.dumps(evaluation, indent=2) + "\n")
        print(f"evaluation -> {args.out}")
    return 0


def _policy_spec(args: argparse.Namespace) -> str:
    """--block-size N and --predictor P are shorthands of --policy fixed:N and --policy learned:P."""
    given = [flag for flag, value in (("--block-size", args.block_size), ("--predictor", args.predictor)) if value]
    if len(given) > 1 or (given and args.policy is not None):
        raise ValueError(
            f"give one of --policy, --block-size, --predictor (got {', '.join(given + ['--policy'] * (args.policy is not None))})"
        )
    if args.block_size is not None:
        return f"fixed:{args.block_size}"
    if args.predictor is not None:
        return f"learned:{args.predictor}"
    return args.policy or "fixed"


def cmd_generate(args: argparse.Namespace) -> int:
    from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
    from blockpilot.decoding.engine import engine_for, keep_compiled_kernels
    from blockpilot.models.loading import load_models
    from blockpilot.policies.resolve import resolve_policy

    _quiet_transformers()
    spec = _policy_spec(args)
    models = load_models(args.target, args.drafter, device=args.device, dtype=args.dtype)
    policy = resolve_policy(spec, models)
    prompt_ids = models.encode_prompt(args.prompt, chat=not args.raw)
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    sampling = {"temperature": 0.0} | models.sampling_defaults() | {k: v for k, v in given.items() if v is not None}
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        verify=args.verify,
        stop_token_ids=tuple(models.stop_token_ids()),
        seed=args.seed,
        **sampling,
    )
    keep_compiled_kernels()
    request = GenerationRequest(prompt_ids, config, policy)
    engine = engine_for(models, [request], compile=args.compile)
    started = time.perf_counter()
    (result,) = generate_many(models, [request], engine=engine)
    seconds = time.perf_counter() - started
    text = models.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        extra = {"compile": engine.decoder.mode, "compile_seconds": engine.compile_seconds, "sampling": sampling}
        print(json.dumps({"text": text, **result.to_dict(), **extra}))
    else:
        print(text)
        print("---")
        print(result.format_stats())
        compiled = f", {engine.compile_seconds:.1f} s of it compiling" if engine.compile_seconds else ""
        print(f"engine ({engine.decoder.mode}): {seconds:.3f} s{compiled}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from blockpilot.cost import REQUEST_PRICES
    from blockpilot.decoding.calibration import calibrate
    from blockpilot.decoding.engine import keep_compiled_kernels
    from blockpilot.models.loading import load_models

    _quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models(args.target, args.drafter, device=args.device, dtype=args.dtype)
    if models.drafter is None:
        raise ValueError("--drafter is required: a cycle drafts a block")
    block_sizes = args.block_sizes or tuple(range(1, 2 * models.train_block_size + 1))
    keep_compiled_kernels()
    cost = calibrate(
        models,
        block_sizes,
        args.batch_sizes,
        repeats=args.repeats,
        cycles=args.cycles,
        compile=args.compile,
        tree_nodes=args.tree_nodes,
        step_decision=args.step_decision,
    )
    cost.save(args.out)
    print(f"cost curve -> {args.out}")
    print("ms per cycle, fitted non-decreasing in b (the measured median in brackets where it differs)")
    for batch, by_b in cost.seconds.items():
        measured = cost.measured.get(batch, {})
        raw = {b: f" [{value * 1000:.2f}]" for b, value in measured.items() if value != by_b.get(b)}
        points = [f"b={b} {seconds * 1000:.2f}{raw.get(b, '')}" for b, seconds in by_b.items()]
        print(f"batch {batch}: " + ", ".join(points))
    for batch, by_nodes in cost.trees.items():
        print(
            f"batch {batch}, trees {cost.tree_depth} deep: "
            + ", ".join(f"{n} nodes {s * 1000:.2f}" for n, s in by_nodes.items())
        )
    if cost.decided:
        print(
            "batch 1, computing a per-step model's choice: "
            + ", ".join(f"b={b} {s * 1000:.2f} (+{(s / cost(b) - 1) * 100:.1f}%)" for b, s in cost.decided.items())
        )
    if any(getattr(cost, name) for name in REQUEST_PRICES):
        print(f"batch 1, beyond a request's cycles: {cost.describe_request()}")
    return 0


def cmd_label(args: argparse.Namespace) -> int:
    from pipelines.label import LabelJob, run_label_job

    _quiet_transformers()
    run_label_job(from_args(LabelJob, args))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from pipelines.train_predictor import TrainJob, run_train_job

    _quiet_transformers()
    run_train_job(from_args(TrainJob, args))
    return 0


def cmd_train_step(args: argparse.Namespace) -> int:
    from pipelines.train_step_policy import StepTrainJob, run_step_train_job

    run_step_train_job(from_args(StepTrainJob, args))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pipelines.serve import ServeJob, run_serve_job

    _quiet_transformers()
    return run_serve_job(from_args(ServeJob, args))


def cmd_serve_unavailable(missing: ImportError, args: argparse.Namespace) -> int:
    raise RuntimeError(
        f"serving needs Ray Serve, which is not installed here ({missing}): pip install 'blockpilot[ray]'"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from pipelines.demo import DemoJob, run_demo

    _quiet_transformers()
    return run_demo(from_args(DemoJob, args))


# ----------------------------------------------------------------------------- parser


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser; with `command`, the others' options may be left out (the serve module's imports,
    Ray Serve and FastAPI, cost about 0.9 s that no other command needs)."""
    from blockpilot.decoding.acceptance import VERIFY_RULES
    from blockpilot.decoding.compiled import COMPILE_MODES
    from blockpilot.decoding.engine import COMPILE_HELP
    from blockpilot.options import add_options
    from pipelines.build_zoo import ZooBuildJob
    from pipelines.demo import DemoJob
    from pipelines.label import LabelJob
    from pipelines.train_predictor import TrainJob
    from pipelines.train_step_policy import StepTrainJob

    parser = argparse.ArgumentParser(prog="blockpilot", description="Adaptive-block speculative decoding on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)

    zoo = commands.add_parser("zoo", help="make local models (no hub needed)")
    zoo_commands = zoo.add_subparsers(dest="zoo_command", required=True)
    random = zoo_commands.add_parser("random", help="random-initialised tiny target, tokenizer and drafter")
    random.add_argument("--out", type=Path, required=True, help="folder to write target/ and drafter/ into")
    random.add_argument("--seed", type=int, default=0)
    random.add_argument(
        "--family", choices=RANDOM_FAMILIES, default="qwen3", help="the target's family (transformers' own class)"
    )
    random.set_defaults(handler=cmd_zoo_random)
    build = zoo_commands.add_parser("build", help="train a target and its DFlash drafter from local text")
    add_options(build, ZooBuildJob)
    build.set_defaults(handler=cmd_zoo_build)
    evaluate = zoo_commands.add_parser("evaluate", help="a built zoo's held-out tau(b) again, per source and ending")
    evaluate.add_argument("--zoo", type=Path, required=True, help="a folder written by `blockpilot zoo build`")
    evaluate.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    evaluate.add_argument("--out", type=Path, default=None, help="also write the evaluation here, as JSON")
    evaluate.set_defaults(handler=cmd_zoo_evaluate)

    gen = commands.add_parser("generate", help="generate with the target, speculatively when a drafter is given")
    gen.add_argument("--target", type=model_ref, required=True, help="target model folder or hub id")
    gen.add_argument("--drafter", type=model_ref, default=None, help="DFlash drafter folder or hub id")
    gen.add_argument("--prompt", required=True, help="user message (chat template applied unless --raw)")
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    gen.add_argument(
        "--policy",
        default=None,
        help="fixed (the training block size), fixed:N, entropy, learned:PREDICTOR, learned-step:STEP_MODEL, "
        "learned+step:PREDICTOR,STEP_MODEL, confidence:RULE, tree:NODES[:DEPTH], autoregressive "
        "(default fixed)",
    )
    gen.add_argument("--block-size", type=positive_int_arg, default=None, help="shorthand for --policy fixed:N")
    gen.add_argument("--predictor", default=None, help="shorthand for --policy learned:PREDICTOR (folder or models:/)")
    gen.add_argument(
        "--temperature",
        type=non_negative_float_arg,
        default=None,
        help="0: greedy (default: the target's generation_config, else 0)",
    )
    gen.add_argument(
        "--top-k", type=non_negative_int_arg, default=None, help="0: every token (default: generation_config, else 0)"
    )
    gen.add_argument(
        "--top-p", type=top_p_arg, default=None, help="1: every token (default: generation_config, else 1)"
    )
    gen.add_argument("--max-new-tokens", type=positive_int_arg, default=128)
    gen.add_argument("--verify", choices=VERIFY_RULES, default="match", help="acceptance rule at temperature > 0")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    gen.add_argument("--dtype", default=None, help="float32, bfloat16 ... (default: bf16 on cuda, fp32 on cpu)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text and stats")
    gen.add_argument("--compile", choices=COMPILE_MODES, default="auto", help=COMPILE_HELP)
    gen.set_defaults(handler=cmd_generate)

    cal = commands.add_parser("calibrate", help="time a draft+verify cycle per block size (and batch size)")
    cal.add_argument("--target", type=model_ref, required=True)
    cal.add_argument("--drafter", type=model_ref, required=True)
    cal.add_argument("--block-sizes", type=block_size_list, default=None, help="default: 1 .. 2B")
    cal.add_argument("--batch-sizes", type=block_size_list, default=(1,), help="e.g. 1,8,32")
    cal.add_argument("--out", type=Path, required=True, help="the cost curve (JSON) to write")
    cal.add_argument("--repeats", type=positive_int_arg, default=5, help="timed runs per point (median)")
    cal.add_argument("--cycles", type=positive_int_arg, default=12, help="cycles per timed run")
    cal.add_argument(
        "--tree-nodes",
        type=tree_budget_list,
        default=(),
        help="also time draft trees of these budgets, as deep as the largest block size, e.g. 7,15,31,63",
    )
    cal.add_argument(
        "--step-decision",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the lone cycle of each b a per-step model may choose with that model's choice computed in "
        "it (batch 1): train-step prices such a model's cycles with it",
    )
    cal.add_argument("--compile", choices=COMPILE_MODES, default="auto", help=COMPILE_HELP)
    cal.add_argument("--threads", type=positive_int_arg, default=None, help="torch CPU threads")
    cal.add_argument("--device", default=None)
    cal.add_argument("--dtype", default=None)
    cal.set_defaults(handler=cmd_calibrate)

    label = commands.add_parser("label", help="the block-size sweep of every prompt, on Ray Data, to Parquet")
    add_options(label, LabelJob)
    label.set_defaults(handler=cmd_label)

    train = commands.add_parser("train", help="fit the block-size predictor on labels, on Ray Train, tracked in MLflow")
    add_options(train, TrainJob)
    train.set_defaults(handler=cmd_train)

    step = commands.add_parser("train-step", help="fit the per-step block-size model on labels' acceptance tables")
    add_options(step, StepTrainJob)
    step.set_defaults(handler=cmd_train_step)

    srv = commands.add_parser("serve", help="the adaptive decoder behind an OpenAI-style endpoint on Ray Serve")
    if command in (None, "serve"):
        try:
            from pipelines.serve import ServeJob
        except ImportError as missing:  # installed without the `ray` extra: every other command still runs
            srv.set_defaults(handler=partial(cmd_serve_unavailable, missing), takes_any_arguments=True)
        else:
            add_options(srv, ServeJob)
            srv.set_defaults(handler=cmd_serve)

    demo = commands.add_parser("demo", help="the main job on embedded defaults")
    add_options(demo, DemoJob)
    demo.set_defaults(handler=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(next((word for word in given if not word.startswith("-")), None))
    args, unknown = parser.parse_known_args(given)
    if unknown and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, RuntimeError) as error:
        print(f"blockpilot {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
