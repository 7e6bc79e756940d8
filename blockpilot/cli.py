"""The `blockpilot` command (also `python -m blockpilot`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# blockpilot.decoding.VERIFY_RULES, repeated so that `--help` does not import torch (a test keeps them equal).
VERIFY_RULES = ("match", "rejection")

# ----------------------------------------------------------------------------- argument types


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def model_ref(text: str) -> str:
    """A local model folder, or a hub id `org/name` (fetched when a hub is reachable)."""
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; expected a model folder")
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise argparse.ArgumentTypeError(f"model folder {text!r} does not exist")
    return text


# ----------------------------------------------------------------------------- commands


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def cmd_zoo_random(args: argparse.Namespace) -> int:
    from blockpilot.zoo.random_models import write_random_zoo

    _quiet_transformers()
    paths = write_random_zoo(args.out, seed=args.seed)
    print(f"target:  {paths['target']}\ndrafter: {paths['drafter']}")
    return 0


def cmd_zoo_build(args: argparse.Namespace) -> int:
    from blockpilot.zoo.build import build_zoo

    _quiet_transformers()
    trainer = None
    if args.trainer == "ray":
        from pipelines.build_zoo import RayTrainer

        trainer = RayTrainer(num_workers=args.workers, use_gpu=args.use_gpu)
    out = build_zoo(args.size, args.out, seed=args.seed, device=args.device, trainer=trainer, track=not args.no_track)
    print(f"zoo: {out}")
    return 0


def _policy(args: argparse.Namespace, train_block_size: int | None) -> Any:
    from blockpilot.decoding.policies import EntropyHeuristic, FixedBlockSize

    if args.block_size is not None:
        return FixedBlockSize(args.block_size)
    if train_block_size is None:
        return None
    if args.predictor is not None:
        from blockpilot.predictor import LearnedPolicy, load_predictor

        return LearnedPolicy(load_predictor(args.predictor))
    if args.policy == "entropy":
        return EntropyHeuristic.around(train_block_size)
    return FixedBlockSize(train_block_size)


def format_stats(result: Any) -> str:
    tau = "n/a" if math.isnan(result.tau) else f"{result.tau:.2f}"
    lines = [
        f"block size:          {result.block_size}",
        f"new tokens:          {len(result.token_ids)} ({result.stop_reason})",
        f"cycles:              {result.cycles}",
        f"mean tau:            {tau}",
        f"acceptance lengths:  {result.acceptance_lengths}",
        f"target passes:       {result.target_forward_passes}",
        f"prefill:             {result.prefill_time_s * 1000:.1f} ms",
        f"decode:              {result.decode_time_s * 1000:.1f} ms ({result.decode_tokens_per_s:.1f} tokens/s)",
    ]
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    from blockpilot.decoding.speculative import GenerationConfig, generate
    from blockpilot.models.loading import load_models

    _quiet_transformers()
    models = load_models(args.target, args.drafter, device=args.device, dtype=args.dtype)
    prompt_ids = models.encode_prompt(args.prompt, chat=not args.raw)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        verify=args.verify,
        stop_token_ids=tuple(models.stop_token_ids()),
        seed=args.seed,
    )
    policy = _policy(args, models.train_block_size)
    if hasattr(policy, "check_fits"):
        policy.check_fits(models.target.get_output_embeddings().weight.shape[0], models.train_block_size)
    result = generate(models, prompt_ids, policy=policy, config=config)
    text = models.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        payload = {"text": text, "policy": getattr(policy, "name", "autoregressive"), **result.to_dict()}
        print(json.dumps(payload))
    else:
        print(text)
        print("---")
        print(format_stats(result))
    return 0


def cmd_label(args: argparse.Namespace) -> int:
    from pipelines.label import job_from_args, run_label_job

    _quiet_transformers()
    run_label_job(job_from_args(args))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from pipelines.train_predictor import job_from_args, run_train_job

    _quiet_transformers()
    run_train_job(job_from_args(args))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import time

    from blockpilot.serving import ServeLimits
    from pipelines.serve import ModelLoader, serve_locally

    _quiet_transformers()
    loader = ModelLoader(
        target=args.target,
        drafter=args.drafter,
        predictor=args.predictor,
        model_name=args.model_name,
        device=args.device,
        dtype=args.dtype,
        limits=ServeLimits(max_tokens_cap=args.max_tokens_cap),
    )
    server = serve_locally(loader, port=args.port, host=args.host, num_replicas=args.replicas, num_gpus=args.num_gpus)
    server.wait_healthy()
    print(f"serving {args.model_name} at {server.url}/v1 (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pipelines.demo import run_demo

    _quiet_transformers()
    return run_demo(args.home, size=args.size, port=args.port)


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockpilot", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    zoo = commands.add_parser("zoo", help="make local models (no hub needed)")
    zoo_commands = zoo.add_subparsers(dest="zoo_command", required=True)
    random = zoo_commands.add_parser("random", help="random-initialised tiny target, tokenizer and drafter")
    random.add_argument("--out", type=Path, required=True, help="folder to write target/ and drafter/ into")
    random.add_argument("--seed", type=int, default=0)
    random.set_defaults(handler=cmd_zoo_random)
    build = zoo_commands.add_parser("build", help="train a target and its DFlash drafter from local text")
    build.add_argument("--size", choices=("tiny", "small"), default="tiny")
    build.add_argument("--out", type=Path, default=None, help="copy the zoo here (it is cached under the home folder)")
    build.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument(
        "--trainer",
        choices=("local", "ray"),
        default="local",
        help="run the training steps in this process, or on Ray Train workers",
    )
    build.add_argument("--workers", type=positive_int, default=1, help="Ray Train workers (with --trainer ray)")
    build.add_argument("--use-gpu", action="store_true", help="Ray Train workers take a GPU each")
    build.add_argument("--no-track", action="store_true", help="do not log the build to MLflow")
    build.set_defaults(handler=cmd_zoo_build)

    gen = commands.add_parser("generate", help="generate with the target, speculatively when a drafter is given")
    gen.add_argument("--target", type=model_ref, required=True, help="target model folder or hub id")
    gen.add_argument("--drafter", type=model_ref, default=None, help="DFlash drafter folder or hub id")
    gen.add_argument("--prompt", required=True, help="user message (chat template applied unless --raw)")
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    gen.add_argument("--block-size", type=positive_int, default=None, help="fixed block size b (default: policy)")
    gen.add_argument(
        "--policy",
        choices=("fixed", "entropy"),
        default="fixed",
        help="without --block-size: 'fixed' drafts the training block size, 'entropy' adapts it",
    )
    gen.add_argument(
        "--predictor",
        default=None,
        help="a trained predictor picks b per request: a predictor folder or models:/blockpilot-predictor/N",
    )
    gen.add_argument("--temperature", type=non_negative_float, default=0.0)
    gen.add_argument("--max-new-tokens", type=positive_int, default=128)
    gen.add_argument("--verify", choices=VERIFY_RULES, default="match", help="acceptance rule at temperature > 0")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    gen.add_argument("--dtype", default=None, help="float32, bfloat16 ... (default: bf16 on cuda, fp32 on cpu)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text and stats")
    gen.set_defaults(handler=cmd_generate)

    label = commands.add_parser("label", help="the block-size sweep of every prompt, on Ray Data, to Parquet")
    from pipelines.label import add_label_arguments

    add_label_arguments(label)
    label.set_defaults(handler=cmd_label)

    train = commands.add_parser("train", help="fit the block-size predictor on labels, on Ray Train, tracked in MLflow")
    from pipelines.train_predictor import add_train_arguments

    add_train_arguments(train)
    train.set_defaults(handler=cmd_train)

    srv = commands.add_parser("serve", help="the adaptive decoder behind an OpenAI-style endpoint on Ray Serve")
    srv.add_argument("--target", type=model_ref, required=True)
    srv.add_argument("--drafter", type=model_ref, default=None)
    srv.add_argument("--predictor", default=None, help="predictor folder or models:/blockpilot-predictor/N")
    srv.add_argument("--host", default="127.0.0.1", help="interface to bind (loopback by default)")
    srv.add_argument("--port", type=positive_int, default=8000)
    srv.add_argument("--model-name", default="blockpilot")
    srv.add_argument("--replicas", type=positive_int, default=1)
    srv.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica")
    srv.add_argument("--max-tokens-cap", type=positive_int, default=512)
    srv.add_argument("--device", default=None)
    srv.add_argument("--dtype", default=None)
    srv.set_defaults(handler=cmd_serve)

    demo = commands.add_parser("demo", help="the main job on embedded defaults")
    demo.add_argument("--home", type=Path, default=None, help="artifact folder (default: $BLOCKPILOT_HOME)")
    demo.add_argument("--size", choices=("tiny", "small"), default="small", help="which zoo the flow runs on")
    demo.add_argument("--port", type=positive_int, default=8000, help="port of the endpoint on 127.0.0.1")
    demo.set_defaults(handler=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as error:
        print(f"blockpilot {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
