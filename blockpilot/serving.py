"""The decoder behind the HTTP endpoint, Ray-free: one batched engine loop, prompts encoded safely, text
streamed with stop strings. `pipelines/serve.py` parses the OpenAI requests (typed models) and wraps this in
a FastAPI app on Ray Serve.

`BatchedDecoder` runs the speculative engine in one background thread. Requests join the running batch
between cycles (up to `max_batch` rows) and leave it as soon as they end; each row has its own block-size
policy, temperature, seed and stop rules. Waiting requests sit in a bounded queue: a full queue, or a wait
longer than `queue_timeout_s`, is `Overloaded` (the endpoint's 503 with Retry-After). A request's
generation deadline (`request_timeout_s`) starts when its decoding starts; a cancelled handle (a client gone,
a proxy timeout) frees its row at the next cycle.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from blockpilot.checks import check_fits_context
from blockpilot.decoding.compiled import release_openmp_threads
from blockpilot.decoding.engine import Engine, generate_many, keep_compiled_kernels, shape_for
from blockpilot.decoding.request import GenerationConfig, GenerationRequest, GenerationResult
from blockpilot.models.loading import SpeculativeModels, text_prefix
from blockpilot.options import non_negative_float_arg, option, positive_float_arg, positive_int_arg
from blockpilot.policies.base import BlockSizePolicy
from blockpilot.policies.resolve import PolicySpec, resolve_policy

logger = logging.getLogger(__name__)

REQUEST_POLICIES = ("adaptive", "fixed")  # what a request may ask for; responses report the resolved policy name
MIN_TEMPERATURE = 0.01  # below it (and above 0) logits / T leave the range sampling is meaningful in


class RequestError(ValueError):
    """A request that cannot be served as asked: `field` names the parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class RowFailure(RuntimeError):
    """The engine failed this request alone (its policy, its logits, its sampling); the other requests go on."""


class Overloaded(RuntimeError):
    """No row can take the request in time: the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ServeLimits:
    """Bounds on what one request may ask and on the work a replica takes on (each is a `blockpilot serve` flag)."""

    max_tokens_cap: int = option(512, type=positive_int_arg, help="largest max_tokens a request may ask for")
    default_max_tokens: int = option(128, type=positive_int_arg, help="max_tokens when a request gives none")
    max_block_size: int | None = option(None, type=positive_int_arg, help="largest block_size: the engine's width (default: B + 2)")
    max_stop_strings: int = option(4, type=positive_int_arg, help="stop strings per request")
    max_stop_length: int = option(64, type=positive_int_arg, help="characters per stop string")
    max_prompt_chars: int = option(64_000, type=positive_int_arg, help="prompt characters, checked before tokenizing")
    max_prompt_tokens: int = option(8192, type=positive_int_arg, help="prompt tokens (at most the context)")
    max_cache_tokens: int | None = option(
        None,
        type=positive_int_arg,
        help="key/value cache slots the engine allocates for all its rows together (default: every row holds "
        "max_prompt_tokens + max_tokens_cap)",
    )
    max_body_bytes: int = option(1 << 20, type=positive_int_arg, help="request body size (larger: 413)")
    request_timeout_s: float = option(120.0, type=positive_float_arg, help="decoding time per request")
    queue_timeout_s: float = option(30.0, type=positive_float_arg, help="wait for a free row before 503")
    stall_timeout_s: float = option(
        120.0,
        type=positive_float_arg,
        help="an engine step longer than this (a hung kernel) marks the replica unhealthy",
    )
    max_messages: int = option(256, type=positive_int_arg, help="messages per chat request")
    prefill_chunk_tokens: int = option(
        512, type=positive_int_arg, help="a longer prompt is prefilled this many tokens a step, beside running rows"
    )
    max_batch: int = option(8, type=positive_int_arg, help="requests decoded together in one engine")
    max_queue: int = option(64, type=positive_int_arg, help="requests waiting for a row (more: 503)")
    stream_interval_s: float = option(
        0.05,
        type=non_negative_float_arg,
        help="seconds between a stream's chunks after its first, each carrying every token decoded meanwhile (0: one "
        "chunk per engine step); each chunk costs the server the same, and under load those costs slow decoding",
    )

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is None:
                continue
            zero_allowed = name == "stream_interval_s"
            number = isinstance(value, (int, float)) and math.isfinite(value)
            if not (number and (value >= 0 if zero_allowed else value > 0)):
                expected = "a finite number >= 0" if zero_allowed else "a positive number"
                raise ValueError(f"serve limit {name} must be {expected}, got {value!r}")


@dataclass
class StepTotals:
    """What the engine thread did since it started, as running totals: engine steps, their seconds, and the rows that
    committed tokens in them (rows per step = rows / steps). A metrics exporter reads their increase."""

    steps: int = 0
    seconds: float = 0.0
    rows: int = 0


@dataclass(frozen=True)
class DecodeRequest:
    """A checked request, prompt tokenized."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    stop: tuple[str, ...] = ()
    seed: int | None = None
    block_size: int | None = None  # forces a fixed b
    policy: str = "adaptive"
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks, tests)
    top_k: int = 0  # at T > 0, sample among the top_k most likely tokens (0: all)
    top_p: float = 1.0  # and among the fewest whose mass reaches top_p (1: all)


class IncrementalText:
    """Token chunks -> text deltas that never change once emitted, never drop text, and hold back both a
    character still split across tokens and any tail that could still become a stop string.

    Detokenization decodes a sliding window (the tokens since the last stable point), so each chunk costs the
    window, not the whole answer; stop strings are searched only where they can newly appear.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are emitted for good
        self.read_offset = 0  # tokens up to here are decoded into emitted or pending text
        self.emitted = ""
        self.pending = ""  # decoded, held back (a possible stop-string prefix)
        self.stopped = False

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _new_text(self, final: bool) -> str:
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        whole = self._decode(self.tokens[self.prefix_offset :])
        if len(whole) <= len(prefix) or (whole.endswith("\ufffd") and not final):
            return ""  # nothing new, or a character still waiting for its last byte
        start = len(prefix) if whole.startswith(prefix) else len(os.path.commonprefix([prefix, whole]))
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return whole[start:]

    def push(self, new_tokens: Sequence[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(new_tokens)
        candidate = self.pending + self._new_text(final)
        if self.stop:
            hit = min((i for i in (candidate.find(s) for s in self.stop) if i >= 0), default=-1)
            if hit >= 0:
                self.stopped, self.pending = True, ""
                self.emitted += candidate[:hit]
                return candidate[:hit]
            if not final:
                hold = next(
                    (
                        k
                        for k in range(min(len(candidate), self.longest_stop - 1), 0, -1)
                        if any(s.startswith(candidate[-k:]) for s in self.stop)
                    ),
                    0,
                )
                self.pending, candidate = candidate[len(candidate) - hold :], candidate[: len(candidate) - hold]
            else:
                self.pending = ""
        self.emitted += candidate
        return candidate


@dataclass(eq=False)  # a handle is one request: found in the queue by identity, not by comparing every field
class DecodeHandle:
    """One request in the decoder: events flow to `listener` (by default a queue that `events()` reads)."""

    request: DecodeRequest
    text: IncrementalText
    policy: BlockSizePolicy
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    row_id: int | None = None
    cancelled: bool = False
    timed_out: bool = False
    listener: Callable[[tuple[str, Any]], None] | None = None
    on_cancel: Callable[[DecodeHandle], None] | None = None  # the decoder's: frees a queued request's slot at once
    checked_at: float = 0.0  # when the server last asked whether this request's client is still there
    deadline: float | None = None  # past it (monotonic), the server's waiting side gives up on the engine
    _queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def emit(self, kind: str, value: Any) -> None:
        (self.listener or self._queue.put)((kind, value))

    def cancel(self) -> None:
        """Free the row at the next cycle, or the queue slot now (the client went away, or its time is up)."""
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel(self)

    def events(self, timeout_s: float | None = None) -> Iterator[tuple[str, Any]]:
        """("delta", text) ... then ("done", stats) or ("error", exception), for a synchronous consumer."""
        while True:
            kind, value = self._queue.get(timeout=timeout_s)
            yield kind, value
            if kind != "delta":
                return


class SerializedTokenizer:
    """A tokenizer shared by the HTTP threads (encoding) and the engine thread (decoding), one call at a time.
    A fast tokenizer is not safe across threads: `split_special_tokens` is a flag set on the shared Rust object
    for the length of a call, so a concurrent call could read another request's setting (user text parsed as
    control tokens), and concurrent calls can fail with "Already borrowed"."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self._lock = tokenizer, threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer.decode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # read-only attributes: chat_template, eos_token_id, ...
        return getattr(self._tokenizer, name)


class BatchedDecoder:
    """Target + drafter (+ per-request and per-step predictors) serving completions in one batched engine, its cycle
    run as `compile` says (`compiled.COMPILE_MODES`; `serve` passes "auto", what pays on the device)."""

    def __init__(
        self,
        models: SpeculativeModels,
        *,
        adaptive: PolicySpec | str = "fixed",
        model_name: str = "blockpilot",
        limits: ServeLimits | None = None,
        predictor: Any | None = None,
        compile: str = "off",
        compile_spans: int = 1,
        compile_packed: bool = False,
        served: dict[str, Any] | None = None,
    ) -> None:
        if models.tokenizer is None:
            raise ValueError("serving needs a tokenizer")
        self.models, self.model_name = models, model_name
        self.served = served or {}  # the models this decoder runs, as its deployment pinned them (`/v1/models`)
        self.tokenizer = SerializedTokenizer(models.tokenizer)
        self._prefix = text_prefix(models.tokenizer)  # a raw completion starts as the model's tokenizer starts text
        self.limits = limits or ServeLimits()
        self.adaptive = resolve_policy(adaptive, models, predictor=predictor)
        self.context = int(getattr(models.target.config, "max_position_embeddings", 1 << 30))
        self.stop_token_ids = tuple(models.stop_token_ids())
        # What a request that omits temperature, top_k or top_p gets: the target's generation_config, else OpenAI's.
        self.sampling_defaults = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} | models.sampling_defaults()
        keep_compiled_kernels()
        depth, tree_nodes = shape_for(self.adaptive)  # a tree policy's depth and budget shape the cycle
        width = self.limits.max_block_size or (models.train_block_size + 2 if models.drafter is not None else 1)
        width = max(width, depth or 1) if tree_nodes else width
        reach = max(width, (tree_nodes or 0) + 1)
        # Every row holds the longest prompt and budget a request may ask for; --max-cache-tokens bounds what the
        # engine allocates for its rows (and the spare row where long prompts are prefilled) together.
        capacity = min(self.context, self.max_prompt_tokens + self.limits.max_tokens_cap) + reach
        if self.limits.max_cache_tokens is not None:
            capacity = min(capacity, self.limits.max_cache_tokens // (self.limits.max_batch + 1))
            if capacity < reach + 2:
                raise ValueError(
                    f"max_cache_tokens {self.limits.max_cache_tokens} leaves {capacity} cache slots to each of "
                    f"{self.limits.max_batch + 1} rows: a row needs more than {reach + 1} (raise it, or lower max_batch)"
                )
        self._engine = Engine(
            models,
            max_batch=self.limits.max_batch,
            width=width,
            capacity=capacity,
            compile=compile,
            prefill_chunk=self.limits.prefill_chunk_tokens,
            tree_nodes=tree_nodes,
        )
        self._waiting: deque[DecodeHandle] = deque()
        self._active: dict[int, DecodeHandle] = {}
        self._lock = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()  # the engine loop's last sign of life
        self.failure: BaseException | None = None
        self.compile_spans, self.compile_packed = compile_spans, compile_packed
        self.warm_up_seconds: float | None = None  # what `start` spent building the engine's steps
        self.compiled_shapes: list[tuple] = []  # the steps `start` built up front
        self.totals = StepTotals()
        # Called from the engine thread with each finished request's stats (`complete`'s): a metrics exporter.
        self.on_finished: Callable[[dict[str, Any]], None] | None = None

    # ---------------------------------------------------------------- prompts

    @property
    def max_block_size(self) -> int:
        return self._engine.width

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.limits.max_prompt_tokens, self.context - 1)

    @property
    def cache_budget(self) -> int:
        """Cache slots a row holds: what a request's prompt, max_tokens and one cycle's block must fit in."""
        return self._engine.capacity

    def cache_need(self, request: DecodeRequest) -> int:
        """Cache slots a request's row can need: its prompt, its token budget, a cycle's block past them."""
        return len(request.prompt_ids) + request.max_tokens + self._engine.reach

    def _check_text(self, text: str, field_name: str) -> None:
        if len(text) > self.limits.max_prompt_chars:
            raise RequestError(field_name, f"{len(text)} characters; at most {self.limits.max_prompt_chars}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(field_name, "not valid Unicode (a lone surrogate?)") from None

    def _tokenize_user_text(self, text: str) -> list[int]:
        """User text as plain text: `<|im_end|>` typed by a user never becomes the special token."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_completion(self, prompt: str) -> list[int]:
        self._check_text(prompt, "prompt")
        if not prompt.strip():
            raise RequestError("prompt", "prompt is empty")
        return self._checked_prompt(self._prefix + self._tokenize_user_text(prompt), "prompt")

    def encode_chat(self, messages: Sequence[tuple[str, str]], enable_thinking: bool = False) -> list[int]:
        """(role, content) pairs through the chat template; contents are tokenized as user text, never as special
        tokens, so a message cannot forge a turn. `enable_thinking`: Qwen3's switch (its template opens a thinking
        block when on; templates without the switch ignore it). Off by default: DFlash's drafters are trained on
        answers without one."""
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("messages", f"model {self.model_name!r} has no chat template; use /v1/completions")
        if len(messages) > self.limits.max_messages:
            raise RequestError("messages", f"{len(messages)} messages; at most {self.limits.max_messages}")
        for index, (_, content) in enumerate(messages):
            self._check_text(content, f"messages[{index}].content")
        total = sum(len(content) for _, content in messages)
        if total > self.limits.max_prompt_chars:
            raise RequestError("messages", f"{total} characters in all; at most {self.limits.max_prompt_chars}")
        if not any(content.strip() for _, content in messages):
            raise RequestError("messages", "every message is empty")
        marks = [f"\x00{uuid.uuid4().hex}\x00" for _ in messages]
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": role, "content": mark} for (role, _), mark in zip(messages, marks, strict=True)],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=enable_thinking,
            )
        except Exception as error:  # jinja's TemplateError and whatever a template raises on purpose
            raise RequestError("messages", f"the chat template rejects these messages: {error}") from None
        ids: list[int] = []
        start = 0  # scanned with offsets: slicing off the rest per message copied it, quadratic in the messages
        for mark, (_, content) in zip(marks, messages, strict=True):
            found = rendered.find(mark, start)
            if found < 0:
                raise RequestError("messages", "the chat template rewrites message contents; cannot encode safely")
            ids += tokenizer(rendered[start:found], add_special_tokens=False)["input_ids"]
            ids += self._tokenize_user_text(content)
            start = found + len(mark)
        ids += tokenizer(rendered[start:], add_special_tokens=False)["input_ids"]
        return self._checked_prompt(ids, "messages")

    def _checked_prompt(self, ids: list[int], field_name: str) -> list[int]:
        if not ids:
            raise RequestError(field_name, "the prompt tokenizes to nothing")
        if len(ids) > self.max_prompt_tokens:
            raise RequestError(field_name, f"the prompt has {len(ids)} tokens; at most {self.max_prompt_tokens}")
        return ids

    def check(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int | None,
        temperature: float | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
        block_size: int | None = None,
        policy: str = "adaptive",
        ignore_eos: bool = False,
        top_k: int | None = None,
        top_p: float | None = None,
    ) -> DecodeRequest:
        """A request within this decoder's limits, or RequestError naming the parameter. Sampling parameters left
        None take `sampling_defaults`; top_k -1 (vLLM's) or 0 is every token."""
        defaults = self.sampling_defaults
        temperature = defaults["temperature"] if temperature is None else temperature
        top_k = defaults["top_k"] if top_k is None else top_k
        top_p = defaults["top_p"] if top_p is None else top_p
        max_tokens = self.limits.default_max_tokens if max_tokens is None else max_tokens
        if not 1 <= max_tokens <= self.limits.max_tokens_cap:
            raise RequestError("max_tokens", f"must be between 1 and {self.limits.max_tokens_cap}, got {max_tokens}")
        try:
            check_fits_context(len(prompt_ids), max_tokens, self.context)
        except ValueError as error:
            raise RequestError("max_tokens", str(error)) from None
        if not (math.isfinite(temperature) and (temperature == 0 or MIN_TEMPERATURE <= temperature <= 2)):
            raise RequestError(
                "temperature", f"must be 0 (greedy) or between {MIN_TEMPERATURE} and 2, got {temperature}"
            )
        if len(stop) > self.limits.max_stop_strings:
            raise RequestError("stop", f"at most {self.limits.max_stop_strings} stop strings, got {len(stop)}")
        for text in stop:
            if not text or len(text) > self.limits.max_stop_length:
                raise RequestError("stop", f"each stop string needs 1 to {self.limits.max_stop_length} characters")
        if seed is not None and not 0 <= seed < 2**63:
            raise RequestError("seed", f"must be in [0, 2^63), got {seed}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise RequestError("top_k", f"must be an integer >= 1, or -1 or 0 for every token, got {top_k!r}")
        if not (isinstance(top_p, (int, float)) and math.isfinite(top_p) and 0 < top_p <= 1):
            raise RequestError("top_p", f"must be in (0, 1], got {top_p!r}")
        if block_size is not None and not 1 <= block_size <= self.max_block_size:
            raise RequestError("block_size", f"must be between 1 and {self.max_block_size}, got {block_size}")
        if policy not in REQUEST_POLICIES:
            raise RequestError("policy", f"must be one of {list(REQUEST_POLICIES)}, got {policy!r}")
        request = DecodeRequest(
            tuple(prompt_ids),
            max_tokens,
            float(temperature),
            tuple(stop),
            seed,
            block_size,
            policy,
            ignore_eos,
            max(top_k, 0),
            float(top_p),
        )
        if self.cache_need(request) > self.cache_budget:
            raise RequestError(
                "max_tokens",
                f"the prompt and max_tokens need {self.cache_need(request)} cache slots; a row of this replica holds "
                f"{self.cache_budget} (ask for fewer tokens)",
            )
        return request

    def policy_for(self, request: DecodeRequest) -> BlockSizePolicy:
        if request.block_size is not None:
            return resolve_policy(PolicySpec("fixed", block_size=request.block_size), self.models)
        if request.policy == "adaptive":
            return self.adaptive
        return resolve_policy(PolicySpec("fixed"), self.models)

    # ---------------------------------------------------------------- the engine loop

    def start(self) -> BatchedDecoder:
        """Start the engine loop. First the engine builds its declared shapes (`Engine.declared_shapes`: the smallest
        and largest row bucket at the widest block the adaptive policy may choose, `block_size_choices`, the first
        `compile_spans` spans of cache; with `compile_packed`, each bucket of several rows packed too) and freezes,
        so that nothing compiles while serving (a batch runs on the smallest built step that holds it, else eagerly),
        then decodes one short request under the adaptive policy, of which the engine keeps what its cycles cost
        (`Engine.forget_requests`): `warm_up_seconds`, `compiled_shapes`."""
        with self._lock:
            if self._running:
                return self
        if self.warm_up_seconds is None:
            started = time.perf_counter()
            adaptive = self.adaptive
            defaults = self.sampling_defaults
            self._engine.decide_in_cycle(adaptive)  # a per-step policy's choice inside the lone row's cycle
            shapes = self._engine.declared_shapes(
                adaptive.block_size_choices,
                spans=self.compile_spans,
                packed=self.compile_packed,
                keeps_block_size=adaptive.keeps_block_size,
                # a sampling request that omits top_k and top_p samples cut where these defaults cut
                truncate=GenerationConfig(temperature=1.0, top_k=defaults["top_k"], top_p=defaults["top_p"]).truncates,
            )
            self._engine.compile_shapes(shapes)
            self.compiled_shapes = self._engine.decoder.built_shapes
            warm_up = GenerationConfig(max_new_tokens=2 * self._engine.width + 1)  # a few cycles, no stop
            generate_many(
                self.models,
                [GenerationRequest(self.models.encode_prompt("Hello"), warm_up, self.adaptive)],
                engine=self._engine,
            )
            self._engine.forget_requests()  # "Hello" is no sample of the requests: only its cycles' costs stay
            self.warm_up_seconds = time.perf_counter() - started
        with self._lock:
            if self._running:
                return self
            self._running = True
        release_openmp_threads()  # the engine thread's passes get the cores' OpenMP workers to themselves
        self._thread = threading.Thread(target=self._loop, name="blockpilot-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._running = False
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        """The engine thread runs, has not failed, and, with work to do, has stepped within `stall_timeout_s`
        (a hung kernel or a stuck step keeps the thread alive, not its heartbeat)."""
        if self.failure is not None or self._thread is None or not self._thread.is_alive():
            return False
        busy = bool(self._active or self._waiting)
        return not busy or time.monotonic() - self._beat < self.limits.stall_timeout_s

    @property
    def load(self) -> dict[str, int]:
        """Rows decoding and requests waiting, right now."""
        return {"active": len(self._active), "waiting": len(self._waiting), "max_batch": self.limits.max_batch}

    def submit(self, request: DecodeRequest, listener: Callable[[tuple[str, Any]], None] | None = None) -> DecodeHandle:
        """Queue a request; its events go to `listener` (called from the engine thread) or to `handle.events()`.
        `Overloaded` when the queue is full or the engine has failed."""
        handle = DecodeHandle(
            request,
            IncrementalText(self.tokenizer, request.stop),
            self.policy_for(request),
            listener=listener,
            on_cancel=self._unqueue,
        )
        with self._lock:
            if self.failure is not None:
                raise Overloaded(f"the decoder failed: {self.failure}", retry_after_s=60)
            if len(self._waiting) >= self.limits.max_queue:
                raise Overloaded(
                    f"{len(self._waiting)} requests are waiting; retry later", retry_after_s=self._retry_after()
                )
            self._waiting.append(handle)
            self._lock.notify_all()
        return handle

    def complete(self, request: DecodeRequest) -> tuple[str, dict[str, Any]]:
        """The whole text and the final stats, synchronously (tests, benchmarks)."""
        parts, stats = [], {}
        for kind, value in self.submit(request).events():
            if kind == "delta":
                parts.append(value)
            elif kind == "error":
                raise value
            else:
                stats = value
        return "".join(parts), stats

    def _unqueue(self, handle: DecodeHandle) -> None:
        """A cancelled request that still waits leaves the queue now, not when it reaches the front."""
        with self._lock:
            if handle in self._waiting:
                self._waiting.remove(handle)

    def _retry_after(self) -> float:
        return max(1.0, min(self.limits.queue_timeout_s, 5.0))

    def _loop(self) -> None:
        try:
            while True:
                self._beat = time.monotonic()
                with self._lock:
                    while self._running and not (self._waiting or self._active):
                        self._lock.wait(timeout=1.0)
                        self._beat = time.monotonic()
                    if not self._running:
                        break
                    self._admit()
                self._reap()
                if self._engine.busy:
                    started = time.perf_counter()
                    updates = self._engine.step()
                    totals = self.totals
                    totals.steps, totals.seconds = totals.steps + 1, totals.seconds + time.perf_counter() - started
                    totals.rows += sum(1 for update in updates if update.new_tokens)
                    for update in updates:
                        self._deliver(update)
            self._fail_all(RuntimeError("the decoder stopped"))
        except BaseException as error:  # a broken device: unhealthy from now on; every request gets the error
            self.failure = error
            self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            for handle in [*self._waiting, *self._active.values()]:
                handle.emit("error", error)
            self._waiting.clear()
            self._active.clear()

    def _admit(self) -> None:
        """Move waiting requests into the engine while it has rows free; expire those that waited too long."""
        now = time.monotonic()
        while self._waiting and len(self._active) < self.limits.max_batch:
            handle = self._waiting[0]
            if handle.cancelled:
                self._waiting.popleft()
                continue
            if now - handle.submitted_at > self.limits.queue_timeout_s:
                self._waiting.popleft()
                handle.emit("error", Overloaded("no decoding row became free in time", self._retry_after()))
                continue
            config = GenerationConfig(
                max_new_tokens=handle.request.max_tokens,
                temperature=handle.request.temperature,
                stop_token_ids=() if handle.request.ignore_eos else self.stop_token_ids,
                seed=handle.request.seed,
                top_k=handle.request.top_k,
                top_p=handle.request.top_p,
            )
            try:
                handle.row_id = self._engine.submit(GenerationRequest(handle.request.prompt_ids, config, handle.policy))
            except Exception as error:  # this request's alone: it gets the error, nobody waits on it forever
                self._waiting.popleft()
                # The engine's refusal of what was asked (a ValueError naming it) is the client's to fix: a 400.
                if isinstance(error, ValueError):
                    handle.emit("error", RequestError("request", f"the engine refused it: {error}"))
                else:
                    handle.emit("error", RowFailure(f"the engine refused the request: {error}"))
                continue
            self._waiting.popleft()
            handle.started_at = now
            self._active[handle.row_id] = handle
        for handle in [h for h in self._waiting if now - h.submitted_at > self.limits.queue_timeout_s]:
            self._waiting.remove(handle)
            handle.emit("error", Overloaded("no decoding row became free in time", self._retry_after()))

    def _reap(self) -> None:
        """Cancel rows whose client left or whose decoding time is up."""
        now = time.monotonic()
        for row_id, handle in list(self._active.items()):
            if not handle.cancelled and now - handle.started_at > self.limits.request_timeout_s:
                handle.timed_out = True
            if handle.cancelled or handle.timed_out:
                self._engine.cancel(row_id)

    def _deliver(self, update: Any) -> None:
        handle = self._active.get(update.row_id)
        if handle is None:
            return
        if update.error is not None:
            del self._active[update.row_id]
            handle.emit("error", RowFailure(f"decoding this request failed: {update.error}"))
            return
        if update.new_tokens:
            delta = handle.text.push(update.new_tokens)
            if delta:
                handle.emit("delta", delta)
            if handle.text.stopped:
                self._engine.cancel(update.row_id)
        if update.result is not None:
            del self._active[update.row_id]
            tail = handle.text.push([], final=True)
            if tail:
                handle.emit("delta", tail)
            stats = self._stats(handle, update.result)
            handle.emit("done", stats)
            if self.on_finished is not None:
                try:
                    self.on_finished(stats)
                except Exception:  # an exporter that fails costs its metrics, not the request or the engine
                    logger.exception("recording a finished request's metrics failed")

    def _stats(self, handle: DecodeHandle, result: GenerationResult) -> dict[str, Any]:
        stopped = handle.text.stopped or result.stop_reason == "stop"
        stats = {
            # OpenAI's values only: a generation cut by its deadline reports "length", and says why below.
            "finish_reason": "stop" if stopped else "length",
            "usage": {
                "prompt_tokens": result.prompt_length,
                "completion_tokens": len(result.token_ids),
                "total_tokens": result.prompt_length + len(result.token_ids),
            },
            "blockpilot": {
                "policy": result.policy,
                "block_size": result.block_size,
                "block_sizes": result.block_sizes,
                "acceptance_lengths": result.acceptance_lengths,
                "tree_nodes": result.tree_nodes,
                "tau": None if math.isnan(result.tau) else round(result.tau, 4),
                "cycles": result.cycles,
                "queue_time_s": round((handle.started_at or handle.submitted_at) - handle.submitted_at, 6),
                "prefill_time_s": round(result.prefill_time_s, 6),
                "decode_time_s": round(result.decode_time_s, 6),
                "models": self.served,
            },
        }
        if handle.timed_out and not stopped:
            stats["blockpilot"]["truncated"] = "request_timeout"
        return stats


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
