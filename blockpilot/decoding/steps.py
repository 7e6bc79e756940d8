"""How a decoder's steps run per compile mode (`compiled.COMPILE_MODES`): each step, a method of the decoder named with
its shape (`("_cycle", rows, span, width, rejection, truncate)`, `_kept_cycle` alike; a packed one `("_packed_cycle",
rows, span, width, tokens, rejection, truncate)`), is compiled and/or captured once, the first time it runs or when it
is built up front, and replayed after. Once frozen (a serving engine, after its declared shapes), nothing compiles: a
step runs on the smallest built step that holds it, else eagerly (logged once)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from blockpilot.decoding.compiled import compiled_replay, inductor_calls, inductor_options
from blockpilot.models.loading import synchronize

logger = logging.getLogger(__name__)

Step = tuple  # (name, *shape)


class Steps:
    """The built steps of `owner` (a `StaticDecoder`) in `mode` on `device`. `kept()` gives the owner's tensors that
    a build's warm-up may move (a row's length and last token), restored after it: its writes lie at or past each
    row's length, where the real step writes again."""

    def __init__(self, owner: Any, mode: str, device: torch.device, kept: Callable[[], Sequence[torch.Tensor]]) -> None:
        self.owner, self.mode, self.device, self._kept = owner, mode, device, kept
        self.replay = True  # compiled steps on a CPU run without dynamo once built (False: through it, to compare)
        self.frozen = False
        self.compile_seconds: float | None = None  # every build so far, added up
        self.built: dict[Step, Callable[[], None]] = {}
        self._graphs: list[torch.cuda.CUDAGraph] = []  # kept alive while their replays are in `built`
        self._compiled: dict[str, Callable[..., None]] = {}
        self._eager: set[Step] = set()

    def run(self, name: str, *shape: Any) -> None:
        """Step `name` at `shape`, built once per shape (on a frozen decoder: the smallest built step that holds it,
        else eagerly)."""
        if self.mode == "off":
            getattr(self.owner, name)(*shape)
            return
        step = self.built.get((name, *shape))
        if step is None and self.frozen:
            step = self.built.get(self.holding(name, shape))
            if step is None:
                if (name, *shape) not in self._eager:
                    self._eager.add((name, *shape))
                    logger.warning(
                        "step %s%s was not built up front: it runs eagerly (nothing compiles while serving)",
                        name,
                        shape,
                    )
                getattr(self.owner, name)(*shape)
                return
        if step is None:
            self.build(name, *shape)
            step = self.built[(name, *shape)]
        step()

    def can_run(self, step: Step) -> bool:
        """Whether `step` runs compiled or as built: not a frozen decoder's step that was not built."""
        name, *shape = step
        return not self.frozen or self.mode == "off" or step in self.built or self.holding(name, shape) is not None

    def holding(self, name: str, shape: Sequence[Any]) -> Step | None:
        """The smallest built step of `name` that holds `shape`: as many rows or more (the others are free rows,
        which commit nothing), as long a span or longer (masked), and for a chain cycle as wide or wider (a row's b
        stops its acceptance) under the same rules (rejection, truncation), a packed one with tokens for every row;
        a tree step's slots and the flags of the others must match. None when no built step holds it."""
        rows, *rest = shape
        span = rest.pop(0) if rest else 0
        fits = []
        for key in self.built:
            if key[0] != name or key[1] < rows or (span and key[2] < span):
                continue
            if name in ("_cycle", "_kept_cycle") and (key[3] < rest[0] or list(key[4:]) != rest[1:]):
                continue
            # a packed cycle's tokens hold the rows' blocks and one for each more (free) row
            if name == "_packed_cycle" and (
                key[3] < rest[0] or key[4] < rest[1] + key[1] - rows or list(key[5:]) != rest[2:]
            ):
                continue
            if name not in ("_cycle", "_kept_cycle", "_packed_cycle") and list(key[3:]) != rest:
                continue
            fits.append(key)
        # what the step computes beyond rows x span
        extent = {"_cycle": 3, "_kept_cycle": 3, "_packed_cycle": 4}.get(name)
        size = lambda key: key[1] * (key[2] if span else 1) * (key[extent] if extent else 1)  # noqa: E731
        return min(fits, key=size, default=None)

    def build(self, name: str, *shape: Any) -> None:
        """Compile (or load from the on-disk cache) and capture step `name` at `shape` now, if the mode compiles and
        it is not built yet."""
        if self.mode != "off" and (name, *shape) not in self.built:
            self.built[(name, *shape)] = self._build(name, *shape)

    def compiled_or_eager(self, compiled: Callable, eager: Callable, *args: object) -> object:
        """`compiled(*args)`; once frozen, `eager(*args)` where the compiled form would recompile (logged once a
        function: its callers send it only what it was compiled for, so this is a pass slower than it should be)."""
        if not self.frozen:
            return compiled(*args)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return compiled(*args)
        except RuntimeError as error:  # these shapes would recompile: eager, the same pass
            if "recompile" not in str(error).lower():
                raise
            name = getattr(eager, "__name__", repr(eager))
            if (name,) not in self._eager:
                self._eager.add((name,))
                logger.warning("the compiled %s would compile again for these inputs: it runs eagerly", name)
            return eager(*args)

    def add_seconds(self, seconds: float) -> None:
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds

    def _build(self, name: str, *shape: Any) -> Callable[[], None]:
        started = time.perf_counter()
        kept = tuple(self._kept())
        state = [t.clone() for t in kept]
        function = getattr(self.owner, name)
        if "compile" in self.mode:
            if name not in self._compiled:
                # One compiled variant per shape the engine runs at (rows, span, width or tree slots, flags): a few
                # buckets each, more than dynamo's default of 8 recompiles of one function.
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
                self._compiled[name] = torch.compile(
                    function, fullgraph=True, dynamic=False, options=inductor_options(self.device)
                )
            function = self._compiled[name]
        step: Callable[[], None] = lambda: function(*shape)  # noqa: E731
        if self.mode == "compile" and self.device.type == "cpu" and self.replay:  # a GPU replays a CUDA graph
            with inductor_calls() as calls:
                step()  # compiles
            replay = compiled_replay(calls)
            if replay is None:
                logger.warning(
                    "the compiled step %s%s cannot be replayed (torch %s did not run it as one graph with no outputs): "
                    "it goes through dynamo at every call, about 0.1 ms slower on a CPU",
                    name,
                    shape,
                    torch.__version__,
                )
            step = replay or step
        elif "graph" in self.mode:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compilation, allocator, kernels' first launch
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self._graphs.append(graph)
            step = graph.replay
        else:
            step()  # compiles
        for tensor, saved in zip(kept, state, strict=True):
            tensor.copy_(saved)
        synchronize(self.device)
        self.add_seconds(time.perf_counter() - started)
        return step
