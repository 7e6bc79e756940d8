"""How the engine's steps run: the compile modes, what "auto" means on a device, inductor's options, the replay of
a compiled step on a CPU (what a CUDA graph replay is on a GPU), and one thread's OpenMP workers at a time."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

COMPILE_MODES = ("auto", "off", "compile", "graph", "compile+graph")


def compile_mode(mode: str, device: torch.device) -> str:
    """`mode` with "auto" resolved to what pays on `device`: the compiled cycle replayed as a CUDA graph on CUDA,
    the compiled cycle (replayed by `compiled_replay`) on a CPU."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    return "compile+graph" if device.type == "cuda" else "compile"


def serial_parts_on_one_thread() -> bool:
    """Inductor's C++ code runs a kernel's loops too small to share out inside its OpenMP region as `omp single`
    blocks, each ending in a barrier: a mini-zoo width-1 cycle holds about 47 of them, at 0.4 us each on a 2-core CPU
    (an empty `omp single` measured in C++). Patched here, once per process, to run them on the region's first thread
    (`omp master`, which has no barrier) with one barrier before the next loop all threads share; the region's end is
    one already. The same code in the same order on one thread, so the same values: the cycle at width 1 ran 1.7-5.7%
    faster beside the unpatched one in the same process; across processes the CPU's drift hid it (docs/log.md).
    Returns whether this torch's inductor has the class this patches (its internals: else it is left as it is)."""
    try:
        from torch._inductor.codegen.cpp import WorkSharing
    except ImportError:
        return False
    if getattr(WorkSharing, "serial_on_one_thread", False):
        return True
    if not all(hasattr(WorkSharing, name) for name in ("single", "parallel", "close")):
        return False
    parallel, close = WorkSharing.parallel, WorkSharing.close

    def single(self: Any) -> bool:
        if self.in_parallel:
            self.code.writeline("#pragma omp master")
            self.owes_barrier = True
        return self.in_parallel

    def shared(self: Any, threads: int) -> None:
        if self.in_parallel and threads == self.num_threads and getattr(self, "owes_barrier", False):
            self.code.writeline("#pragma omp barrier")  # what the serial parts wrote, seen by every thread
        self.owes_barrier = False
        parallel(self, threads)

    def closed(self: Any) -> None:
        self.owes_barrier = False  # the region's end is a barrier
        close(self)

    WorkSharing.single, WorkSharing.parallel, WorkSharing.close = single, shared, closed
    WorkSharing.serial_on_one_thread = True
    return True


def inductor_options(device: torch.device) -> dict[str, bool] | None:
    """What the engine compiles with. On a CPU, inductor's C++ wrapper: its default Python wrapper re-checked every
    input and view at each call, about 0.1 ms of a 1 ms mini-zoo cycle. Without its size asserts: the C++ wrapper
    checks every input's sizes and strides at each call, building a string stream each time (67 checks, about
    55-65 us of a 0.6-1.8 ms mini-zoo cycle, docs/log.md), where a step's inputs are the tensors it was built on
    (`compiled_replay`) or pass dynamo's guards on the same shapes. A GPU replays CUDA graphs, where the wrapper
    costs nothing. On a CPU it also patches how inductor runs a kernel's serial parts (`serial_parts_on_one_thread`)."""
    if device.type != "cpu":
        return None
    serial_parts_on_one_thread()
    return {"cpp_wrapper": True, "size_asserts": False}


OMP_PAUSE_SOFT = 1  # OpenMP 5's omp_pause_soft: the runtime keeps its state, its threads go


def release_openmp_threads() -> bool:
    """Let the calling thread's OpenMP worker threads go (`omp_pause_resource_all`), before another thread takes over
    the passes. libgomp, torch's OpenMP on Linux, keeps a team of workers per thread that ran a parallel region;
    with a second thread's team beside the first, it has more threads than cores and stops spinning between
    regions, and each of a compiled cycle's hundreds of kernels then waits for its workers to wake: on the 2-core
    CPU, an autoregressive cycle of the mini zoo at one row took 1.5-2 ms in a serving thread against 0.25 ms in
    the thread that built it. Returns whether the workers were let go (False without libgomp, as on macOS)."""
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all  # the copy torch loaded, found by its soname
    except (OSError, AttributeError):
        return False
    return pause(OMP_PAUSE_SOFT) == 0


@contextmanager
def inductor_calls() -> Iterator[list[tuple[Any, list[Any], Any]]]:
    """Every call of an inductor-compiled graph made by this thread inside the block, as (the graph, its inputs, its
    outputs); nothing where this torch's inductor does not have the class this reads (its internals:
    `compiled_replay` then keeps dynamo's path)."""
    calls: list[tuple[Any, list[Any], Any]] = []
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        yield calls
        return
    original, thread = CompiledFxGraph.__call__, threading.get_ident()

    def recording(graph: Any, inputs: Sequence[Any]) -> Any:
        given = list(inputs)  # the compiled call empties the list it is given
        out = original(graph, inputs)
        if threading.get_ident() == thread:  # another thread's compiled step is not this one's
            calls.append((graph, given, out))
        return out

    CompiledFxGraph.__call__ = recording
    try:
        yield calls
    finally:
        CompiledFxGraph.__call__ = original


def compiled_replay(calls: list[tuple[Any, list[Any], Any]]) -> Callable[[], None] | None:
    """A compiled step called again the way a CUDA graph is replayed: inductor's compiled code on the tensors it was
    given the first time, without dynamo's guards and AOTAutograd's wrapper around it (0.05 ms of a 0.30 ms
    one-token step and 0.13 of a 1.03 ms width-8 cycle on the CPU, docs/log.md). Sound for this decoder's steps: a
    step reads and writes only tensors that live as long as the decoder (weights, caches, state buffers, written in
    place), and its shape is fixed per compiled variant. None (keep dynamo's path) unless the step ran as one
    compiled graph whose inputs are all tensors and which returns nothing the wrapper would have to copy back."""
    if len(calls) != 1:
        return None
    graph, inputs, out = calls[0]
    run = getattr(graph, "current_callable", None)
    if run is None or out or not all(isinstance(tensor, torch.Tensor) for tensor in inputs):
        return None
    return lambda: run(list(inputs))  # a fresh list: the compiled call empties it
