"""What one draft/verify cycle costs against what it must cost, at a real model's shape (random weights).

    python benchmarks/bench_cycle.py [--shape qwen3-4b|llama-3.1-8b|qwen3-30b-a3b] [--drafter-config CONFIG.json] \\
        [--batches 1,8,32,64] [--widths 1,8,16] [--modes graph] [--compile-points 1x1,1x16] \\
        [--tree-nodes 16,17,32,33,64,65,128,129,256,257] [--tree-points 1x16,1x64,8x64] [--capacity 1024] \\
        [--out results.json] [--cost-out cost.json]

Builds the target and drafter of --shape (Qwen3-4B's with z-lab's b16 drafter by default: a 36-layer, 2560-wide
target; Llama-3.1-8B's and Qwen3-30B-A3B's with drafters of the same make), or those a drafter config names,
random weights, bf16 on a GPU (timing does not depend on weight values), and prints, in one run:

1. the floor: the bytes of the target's and the drafter's weights over a measured device-to-device copy bandwidth
   (bytes read + written per second), the least a batch-1 cycle can cost when it reads every weight once;
2. transformers' autoregressive step on the same weights: eager with a `DynamicCache`, and (with --hf-compile)
   a `StaticCache` step under `torch.compile(mode="reduce-overhead")`;
3. the engine's cycle (`Engine` through `seconds_per_cycle`, eager: the figure `calibrate --compile off` prices)
   at each width, batch 1;
4. the static cycle (`blockpilot.decoding.static`) at every batch x width, per --modes; --compile-points
   (BATCHxWIDTH) lists the points also run `compile+graph` (each shape compiles on its own, in step 7);
5. a tree verify: one target pass over N nodes a row (a random ancestor mask), batch 1 and 8, as a CUDA graph;
6. with --tree-points (BATCHxNODES), the static engine's whole tree cycle in one step: draft, best-first trees grown
   on the device, verify, walk and commit (`--tree-mode`, compile+graph on a GPU; --tree-compile-points too);
   with --tree-parts, also its two halves apart: the drafter's pass with the trees' growth, and the verify;
7. with --replica-start N, a serving replica's start: an `Engine` of N rows (b up to the drafter's B, compile+graph
   on a GPU) builds its declared shapes (`compile_shapes`: the 1-row and N-row steps, the first span) and the
   seconds are printed, then its frozen cycle at b = B for 1, 2 and N rows (2 rows run on the N-row step);
   with --cost-out, the static cycle's grid (the first of --modes) as a cost curve c(batch, b): rows x width tokens
   a pass, what `benchmarks/eval_packed_load.py` prices a load curve from, with any zoo's labels;
8. the points that compile, last: --compile-points, --sampled-points, --tree-compile-points, --hf-compile. A point
   that fails is printed and skipped; with --time-budget, so is every costly point left once that many seconds
   have passed.

Every figure is a median of CUDA-event (or synchronised wall) timings after warm-up. Random weights accept no
draft, so a cycle commits one token: these are costs, not speedups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from blockpilot.cost import CycleCost, nondecreasing_in_block_size
from blockpilot.decoding.calibration import random_prompts, seconds_per_cycle
from blockpilot.decoding.engine import Engine
from blockpilot.decoding.forwards import StaticTarget
from blockpilot.decoding.static import StaticDecoder
from blockpilot.models.drafter import DFlashConfig
from blockpilot.models.loading import cache_keyword
from blockpilot.options import block_size_list
from blockpilot.zoo.random_models import random_models_like

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
# A target's shape: (the drafter config whose sizes the target copies, the target's family, its RoPE, tied embeddings).
# Llama-3.1-8B's drafter is a stand-in of z-lab's Qwen3-4B drafter's make (5 layers at the target's width; the
# real config is not stored here); the target is Llama-3.1-8B's (32 layers of 4,096, 128,256 tokens, untied, llama3).
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {
    "qwen3-4b": (FIXTURES / "zlab_qwen3_4b_dflash_b16_config.json", "qwen3", None, True, {}),
    "llama-3.1-8b": (FIXTURES / "llama31_8b_dflash_b16_shape.json", "llama", LLAMA31_ROPE, False, {}),
    # Qwen3-30B-A3B: 48 sparse layers of 128 experts (768 wide), 8 a token; its drafter a stand-in as Llama's.
    "qwen3-30b-a3b": (
        FIXTURES / "qwen3_30b_a3b_dflash_b16_shape.json",
        "qwen3_moe",
        None,
        False,
        {"num_experts": 128, "experts_per_token": 8, "expert_intermediate_size": 768},
    ),
}
RESULTS: dict = {}


def say(text: str) -> None:
    print(text, flush=True)


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `repeats` runs (CUDA events on a GPU, a synchronised clock elsewhere)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    source = torch.empty(1 << 29, dtype=torch.float16, device=device).normal_()
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    seconds = timed(lambda: target.copy_(source), 20, device)
    return 2 * source.numel() * source.element_size() / seconds


def vocabulary(models) -> int:
    return models.target.get_input_embeddings().weight.shape[0]


def weight_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for parameter in module.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            total += parameter.numel() * parameter.element_size()
    return total


def routed_experts(target: torch.nn.Module) -> tuple[int, int, int] | None:
    """(experts a sparse layer, experts a token, bytes of every expert of every layer) of an MoE target, else None."""
    blocks = [m for m in target.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    if not blocks:
        return None
    expert_bytes = sum(weight_bytes(block.experts) for block in blocks)
    return blocks[0].gate.num_experts, blocks[0].gate.top_k, expert_bytes


def hf_eager_step(models, steps: int) -> float:
    """Seconds per token of transformers' eager greedy loop (DynamicCache, batch 1, one token a step)."""
    from transformers import DynamicCache

    target, device = models.target, models.device
    prompt = torch.randint(0, vocabulary(models), (1, 64), device=device)
    cache = {cache_keyword(target): DynamicCache()}
    out = target(input_ids=prompt, **cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)

    def step():
        nonlocal token
        for _ in range(steps):
            token = target(input_ids=token, **cache, use_cache=True).logits[:, -1:].argmax(-1)

    step()  # warm-up
    return timed(step, 3, device) / steps


def hf_compiled_step(models, steps: int) -> tuple[float, float]:
    """(seconds per token, compile seconds) of a StaticCache step under torch.compile(mode="reduce-overhead")."""
    from transformers import StaticCache

    target, device = models.target, models.device
    cache = {cache_keyword(target): StaticCache(config=target.config, max_cache_len=64 + 8 * steps)}
    forward = torch.compile(target.forward, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(0, vocabulary(models), (1, 64), device=device)
    out = target(input_ids=prompt, **cache, use_cache=True, cache_position=torch.arange(64, device=device))
    token = out.logits[:, -1:].argmax(-1)
    position = 64

    def step(count: int):
        nonlocal token, position
        for _ in range(count):
            cache_position = torch.tensor([position], device=device)
            logits = forward(input_ids=token, **cache, use_cache=True, cache_position=cache_position).logits
            token = logits[:, -1:].argmax(-1)
            position += 1

    started = time.perf_counter()
    step(3)  # compiles and records the graphs
    torch.cuda.synchronize() if device.type == "cuda" else None
    compile_seconds = time.perf_counter() - started
    return timed(lambda: step(steps), 3, device) / steps, compile_seconds


def release(device: torch.device) -> None:
    """The caches of the last decoder back to the device (each point allocates its own)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def static_cycle(
    models, batch: int, width: int, mode: str, capacity: int, cycles: int, sampling: bool = False
) -> tuple[float, float]:
    """(seconds per cycle, build seconds) of the static decoder at (batch, width) in `mode`; with `sampling`, every
    row at T = 1."""
    decoder = StaticDecoder(models, rows=batch, width=width, capacity=capacity, compile=mode, sampling=sampling)
    generator = torch.Generator().manual_seed(batch * 100 + width)
    decoder.prefill(0, random_prompts(models, batch, 64, generator))
    for row in range(batch):
        decoder.place(row, length=64, last_token=1, temperature=1.0 if sampling else 0.0, seed=row)
    decoder.set_block_sizes([width] * batch)
    decoder.cycle(batch, capacity)  # builds (compiles, captures) and runs one
    repeats = max(1, (capacity - 64 - 2 * width) // (cycles * width) - 1)
    seconds = timed(lambda: [decoder.cycle(batch, capacity) for _ in range(cycles)], min(5, repeats), models.device)
    seconds /= cycles
    return seconds, decoder.compile_seconds or 0.0


def tree_cycle(
    models, batch: int, nodes: int, mode: str, capacity: int, cycles: int, parts: bool = False
) -> tuple[float, float, tuple[float, float] | None]:
    """(seconds per cycle, build seconds, parts) of the static engine's whole tree cycle at (batch, nodes) in `mode`:
    the drafter's pass B deep, every row's best-first tree grown on the device, the verify over the N + 1 nodes, the
    walk and the commit in one step, and the host's read of the outcome. With `parts`, also (seconds, seconds) of its
    two halves run as steps of their own, each built in `mode` (two more builds): the drafter's pass with the trees'
    growth (`draft_tree`), then the verify with the walk and the commit (`verify_tree`)."""
    width = models.train_block_size
    decoder = StaticDecoder(models, rows=batch, width=width, capacity=capacity, compile=mode, tree_nodes=nodes)
    decoder.prefill(0, random_prompts(models, batch, 64, torch.Generator().manual_seed(batch * 1000 + nodes)))
    for row in range(batch):
        decoder.place(row, length=64, last_token=1, temperature=0.0, seed=row)
    decoder.set_block_sizes([width] * batch)
    decoder.set_tree_shapes([nodes] * batch, [decoder.top_k] * batch)

    def cycle() -> None:
        decoder.tree_cycle(batch, capacity, nodes + 1)
        decoder.report[:batch].tolist()

    cycle()  # builds (compiles, captures) the step
    repeats = max(1, (capacity - 64 - nodes - 2 * width) // cycles - 1)  # random weights: one token a cycle
    seconds = timed(lambda: [cycle() for _ in range(cycles)], min(5, repeats), models.device) / cycles
    if not parts:
        return seconds, decoder.compile_seconds or 0.0, None
    decoder.length[:batch] = 64  # a verify commits a token a call: each timed run starts where the first did
    decoder.draft_tree(batch, capacity)
    decoder.verify_tree(batch, capacity, nodes + 1)  # builds both halves

    def halves(half: Callable[[], object]) -> float:
        def run() -> None:
            decoder.length[:batch] = 64
            for _ in range(cycles):
                half()

        return timed(run, 5, models.device) / cycles

    grow = halves(lambda: decoder.draft_tree(batch, capacity))
    verify = halves(lambda: decoder.verify_tree(batch, capacity, nodes + 1))
    return seconds, decoder.compile_seconds or 0.0, (grow, verify)


def tree_verify(models, batch: int, nodes: int, capacity: int) -> float:
    """Seconds of one target pass over `nodes` tree nodes a row, as a CUDA graph (eager elsewhere)."""
    device = models.device
    target = StaticTarget(models.target, batch, capacity, models.drafter.target_layer_ids)
    parents = torch.randint(0, nodes, (nodes,)).clamp(max=torch.arange(nodes) - 1).clamp(min=-1)  # a random tree
    ancestor = torch.eye(nodes, dtype=torch.bool)
    for node in range(1, nodes):
        if parents[node] >= 0:
            ancestor[node] |= ancestor[parents[node]]
    depth = ancestor.sum(1) - 1
    start = 64
    ids = torch.randint(0, vocabulary(models), (batch, nodes), device=device)
    positions = (start + depth).to(device)[None].expand(batch, -1).contiguous()
    slots = (start + torch.arange(nodes)).to(device)[None].expand(batch, -1).contiguous()
    mask = torch.zeros(batch, 1, nodes, capacity, dtype=torch.bool, device=device)
    mask[..., :start] = True
    mask[:, 0, :, start : start + nodes] = ancestor.to(device)
    run = lambda: target(ids, positions, slots, mask)  # noqa: E731
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    run()
    return timed(run, 20, device)


def points(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b", help="the target's shape and family")
    parser.add_argument("--drafter-config", type=Path, default=None, help="sizes of another drafter (and target)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batches", type=block_size_list, default=(1, 8, 32, 64))
    parser.add_argument("--widths", type=block_size_list, default=(1, 8, 16))
    parser.add_argument("--modes", default="graph", help="static cycle modes for every point (off, compile, graph)")
    parser.add_argument("--compile-points", type=points, default=[], help="BATCHxWIDTH,... also run compile+graph")
    parser.add_argument("--sampled-points", type=points, default=[], help="BATCHxWIDTH,... compile+graph at T = 1")
    parser.add_argument(
        "--tree-nodes",
        type=block_size_list,
        default=(16, 17, 32, 33, 64, 65, 128, 129, 256, 257),
        help="slots a tree verify checks a row, the root included (one past a power of two shows a step, if any)",
    )
    parser.add_argument(
        "--tree-points", type=points, default=[], help="BATCHxNODES,... the static engine's whole tree cycle"
    )
    parser.add_argument("--tree-mode", default=None, help="its mode (default: compile+graph on a GPU, else off)")
    parser.add_argument(
        "--tree-compile-points", type=points, default=[], help="BATCHxNODES,... the tree cycle compile+graph too"
    )
    parser.add_argument(
        "--tree-parts",
        action="store_true",
        help="also time each tree point's two halves as steps of their own (two more builds a point)",
    )
    parser.add_argument(
        "--time-budget", type=float, default=0, help="seconds after which the costly points left are skipped (0: none)"
    )
    parser.add_argument("--replica-start", type=int, default=0, help="rows of a replica whose start is timed (0: none)")
    parser.add_argument("--capacity", type=int, default=1024, help="cache slots a row")
    parser.add_argument("--cycles", type=int, default=8, help="cycles per timed run")
    parser.add_argument("--hf-steps", type=int, default=32)
    parser.add_argument("--hf-compile", action="store_true", help="also time transformers' compiled static step")
    parser.add_argument("--engine-widths", type=block_size_list, default=(1, 8, 16))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cost-out", type=Path, default=None, help="the static cycle's grid as a cost curve (JSON)")
    args = parser.parse_args()

    config_path, family, rope, tied, target_shape = SHAPES[args.shape]
    config = DFlashConfig.from_dict(json.loads((args.drafter_config or config_path).read_text()))
    started = time.perf_counter()
    models = random_models_like(
        config,
        device=args.device,
        dtype=args.dtype,
        family=family,
        rope_parameters=rope,
        tie_word_embeddings=tied,
        **target_shape,
    )
    device = models.device
    models.target.eval()
    target_bytes, drafter_bytes = weight_bytes(models.target), weight_bytes(models.drafter)
    bandwidth = copy_bandwidth(device)
    floor = (target_bytes + drafter_bytes) / bandwidth
    experts = routed_experts(models.target)
    if experts is not None:  # an MoE cycle reads the experts its tokens route to, not all: the floor of a b = 16 pass
        count, per_token, expert_bytes = experts
        tokens = max(args.widths) + 1
        distinct = count * (1 - (1 - per_token / count) ** tokens)  # expected, routes drawn independently
        floor = (target_bytes - expert_bytes + expert_bytes * distinct / count + drafter_bytes) / bandwidth
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(
        f"{models.target_id} + {models.drafter_id}, {models.target.dtype} on {name}; torch {torch.__version__}; "
        f"built in {time.perf_counter() - started:.0f} s"
    )
    say(
        f"weights: target {target_bytes / 1e9:.2f} GB, drafter {drafter_bytes / 1e9:.2f} GB; copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s (read + written) -> floor {floor * 1000:.2f} ms a batch-1 cycle "
        f"(target alone {target_bytes / bandwidth * 1000:.2f} ms)"
        + (
            f"; MoE: the floor counts the {distinct:.0f} of {count} experts a layer that {tokens} tokens of "
            f"{per_token} routes each reach on average (all weights: "
            f"{(target_bytes + drafter_bytes) / bandwidth * 1000:.2f} ms)"
            if experts is not None
            else ""
        )
    )
    RESULTS.update(
        shape=args.shape,
        family=family,
        device=name,
        torch=torch.__version__,
        target_bytes=target_bytes,
        drafter_bytes=drafter_bytes,
        copy_bandwidth=bandwidth,
        floor_s=floor,
        capacity=args.capacity,
    )

    with torch.inference_mode():
        # transformers' own attention for its baselines (the engine's target runs the project's grouped SDPA).
        engine_attention = models.target.config._attn_implementation
        models.target.set_attn_implementation("sdpa")
        eager = hf_eager_step(models, args.hf_steps)
        models.target.set_attn_implementation(engine_attention)
        say(f"transformers eager autoregressive step (DynamicCache, batch 1): {eager * 1000:.2f} ms a token")
        RESULTS["hf_eager_step_s"] = eager
        for width in args.engine_widths:
            prompts = random_prompts(models, 1, 64, torch.Generator().manual_seed(width))
            seconds_per_cycle(models, prompts, [width], 2)
            engine = statistics.median(seconds_per_cycle(models, prompts, [width], args.cycles) for _ in range(3))
            say(f"engine cycle (eager), batch 1, b = {width}: {engine * 1000:.2f} ms")
            RESULTS.setdefault("engine_cycle_s", {})[width] = engine

        say(f"static cycle, ms (capacity {args.capacity} slots a row); columns: batch {list(args.batches)}")
        for mode in [m for m in args.modes.split(",") if m]:
            for width in args.widths:
                cells = []
                for batch in args.batches:
                    seconds, build = static_cycle(models, batch, width, mode, args.capacity, args.cycles)
                    release(device)
                    cells.append(f"{seconds * 1000:8.2f}")
                    RESULTS.setdefault("static_cycle_s", {}).setdefault(mode, {}).setdefault(width, {})[batch] = seconds
                    RESULTS.setdefault("build_s", {}).setdefault(mode, {}).setdefault(width, {})[batch] = build
                say(
                    f"  {mode:<14} b = {width:<3}" + "".join(cells) + f"   (x floor at batch 1: "
                    f"{RESULTS['static_cycle_s'][mode][width][args.batches[0]] / floor:.2f})"
                )
        if args.cost_out is not None and "static_cycle_s" in RESULTS:
            grid = next(iter(RESULTS["static_cycle_s"].values()))  # width -> batch -> seconds
            measured = {batch: {width: grid[width][batch] for width in grid} for batch in args.batches}
            CycleCost(
                {batch: nondecreasing_in_block_size(by_width) for batch, by_width in measured.items()},
                device=f"{device} ({args.shape}, random weights)",
                dtype=str(models.target.dtype).removeprefix("torch."),
                measured=measured,
            ).save(args.cost_out)
            say(f"cost curve c(batch, b) -> {args.cost_out}")
        say("tree verify (one target pass over N nodes a row, CUDA graph), ms")
        for batch in (1, 8) if args.tree_nodes else ():
            cells = []
            for nodes in args.tree_nodes:
                seconds = tree_verify(models, batch, nodes, args.capacity)
                release(device)
                cells.append(f"N={nodes}: {seconds * 1000:.2f}")
                RESULTS.setdefault("tree_verify_s", {}).setdefault(batch, {})[nodes] = seconds
            say(f"  batch {batch}: " + ", ".join(cells))

        def guarded(what: str, measure: Callable[[], None]) -> None:
            """One costly point, unless --time-budget is spent; a failure is printed and the run goes on (a lease's
            minutes are too few to lose every point after one that breaks)."""
            if args.time_budget and time.perf_counter() - started > args.time_budget:
                say(f"{what}: skipped (past --time-budget {args.time_budget:.0f} s)")
                return
            try:
                measure()
            except Exception as error:
                say(f"{what} failed: {type(error).__name__}: {error}"[:400])
            finally:
                release(device)

        def tree_point(mode: str, batch: int, nodes: int) -> None:
            seconds, build, parts = tree_cycle(models, batch, nodes, mode, args.capacity, args.cycles, args.tree_parts)
            say(
                f"tree cycle ({mode}, trees grown on the device), batch {batch}, {nodes} nodes "
                f"{models.train_block_size} deep: {seconds * 1000:.2f} ms (built in {build:.0f} s; x floor "
                f"{seconds / floor:.2f})"
            )
            RESULTS.setdefault("tree_cycle_s", {}).setdefault(mode, {})[f"{batch}x{nodes}"] = [seconds, build]
            if parts is not None:
                grow, verify = parts
                say(
                    f"  as two steps: the drafter's pass and the trees' growth {grow * 1000:.2f} ms, the verify, walk "
                    f"and commit {verify * 1000:.2f} ms"
                )
                RESULTS.setdefault("tree_parts_s", {}).setdefault(mode, {})[f"{batch}x{nodes}"] = [grow, verify]

        def compiled_point(batch: int, width: int, sampling: bool) -> None:
            seconds, build = static_cycle(models, batch, width, compiled, args.capacity, args.cycles, sampling)
            rows = ", every row at T = 1" if sampling else ""
            say(
                f"  {compiled:<14} batch {batch}, b = {width}{rows}: {seconds * 1000:.2f} ms (compiled in {build:.0f} "
                f"s; x floor {seconds / floor:.2f})"
            )
            key = "compiled_sampled_cycle_s" if sampling else "compiled_cycle_s"
            RESULTS.setdefault(key, {})[f"{batch}x{width}"] = [seconds, build]

        def hf_compiled_point() -> None:
            models.target.set_attn_implementation("sdpa")
            step, compile_seconds = hf_compiled_step(models, args.hf_steps)
            say(
                f"transformers StaticCache + torch.compile(reduce-overhead) step, batch 1: {step * 1000:.2f} ms "
                f"a token (compiled in {compile_seconds:.0f} s)"
            )
            RESULTS["hf_compiled_step_s"] = [step, compile_seconds]

        def replica_start() -> None:
            rows, width = args.replica_start, models.train_block_size
            engine = Engine(models, max_batch=rows, width=width, capacity=args.capacity, compile=compiled)
            shapes = engine.declared_shapes(spans=1)
            seconds = engine.compile_shapes(shapes)
            say(f"replica start, {rows} rows, b up to {width}: {len(shapes)} shapes built in {seconds:.0f} s")
            RESULTS["replica_start_s"] = [rows, len(shapes), seconds]
            for batch in sorted({1, 2, rows}):
                prompts = random_prompts(models, batch, 64, torch.Generator().manual_seed(batch))
                cycle = seconds_per_cycle(models, prompts, [width] * batch, args.cycles, engine=engine)
                say(f"  its frozen cycle, {batch} rows at b = {width}: {cycle * 1000:.2f} ms")
                RESULTS.setdefault("replica_cycle_s", {})[batch] = cycle

        compiled = "compile+graph" if device.type == "cuda" else "compile"
        if args.replica_start:
            guarded("replica start", replica_start)
        tree_mode = args.tree_mode or ("compile+graph" if device.type == "cuda" else "off")
        for batch, nodes in args.tree_points:
            guarded(f"tree cycle {batch}x{nodes}", partial(tree_point, tree_mode, batch, nodes))
        for batch, width in args.compile_points:
            guarded(f"compiled cycle {batch}x{width}", partial(compiled_point, batch, width, False))
        for batch, width in args.sampled_points:
            guarded(f"compiled sampled cycle {batch}x{width}", partial(compiled_point, batch, width, True))
        for batch, nodes in args.tree_compile_points:
            guarded(f"compiled tree cycle {batch}x{nodes}", partial(tree_point, compiled, batch, nodes))
        if args.hf_compile:
            guarded("transformers compiled static step", hf_compiled_point)

    if args.out is not None:
        args.out.write_text(json.dumps(RESULTS, indent=2) + "\n")
        say(f"-> {args.out}")


if __name__ == "__main__":
    try:
        main()
    finally:
        if RESULTS:
            print("RESULTS " + json.dumps(RESULTS), file=sys.stderr, flush=True)
