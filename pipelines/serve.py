"""The adaptive decoder on Ray Serve: an OpenAI-style HTTP endpoint.

    blockpilot serve --target DIR --drafter DIR [--predictor PATH_OR_URI] [--step-model PATH_OR_URI] [--port 8000]
    serve run cluster/serve.yaml          # or `serve deploy` against a running cluster

Routes: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), `stream: true` as
server-sent events in OpenAI's chunk format, GET /v1/models, GET /health. Responses carry `usage` and a
`blockpilot` object (policy, block sizes and acceptance lengths per cycle, mean tau, queue, prefill and
decode times). Requests are parsed by the typed models of `pipelines/openai_protocol.py`; anything out of bounds is
a 400 naming the field, a body over the size limit a 413, a full replica a 503 with Retry-After: the library raises
plain errors and this module maps them to statuses.

Each replica runs one `BatchedDecoder`: requests join its running batch. Ray's token authentication does
not cover Serve's HTTP proxy: set `--api-key` (or BLOCKPILOT_API_KEY) to require `Authorization: Bearer KEY`
on every route but /health.
"""

# No `from __future__ import annotations` here: FastAPI must see `Request` as a class, not a string, on the
# methods that Serve's ingress wraps, or it reads `request` as a required query parameter (422).
import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from blockpilot.blocks import cycle_shapes
from blockpilot.decoding.compiled import COMPILE_MODES
from blockpilot.decoding.engine import COMPILE_HELP
from blockpilot.options import (
    add_options,
    from_args,
    model_ref,
    nested,
    non_negative_float_arg,
    option,
    positive_float_arg,
    positive_int_arg,
)
from blockpilot.policies.resolve import adaptive_spec
from blockpilot.serving import (
    BatchedDecoder,
    Overloaded,
    RequestError,
    RowFailure,
    ServeLimits,
    StepTotals,
    new_id,
)
from pipelines.openai_protocol import ChatCompletionRequest, CompletionRequest, decode_request, parse_request

API_KEY_ENV = "BLOCKPILOT_API_KEY"
APP_NAME = "blockpilot"  # the Serve application `blockpilot serve` deploys
# Serve's own default; inside the 30 s a Kubernetes pod gets between SIGTERM and SIGKILL, with room to stop Ray.
DEFAULT_GRACE_PERIOD_S = 20.0
# ----------------------------------------------------------------------------- the app


@dataclass(frozen=True)
class ModelLoader:
    """What a replica loads: paths or hub ids for target and drafter; the per-request predictor and the per-step
    model, each a folder or an MLflow model URI."""

    target: str
    drafter: Optional[str] = None
    predictor: Optional[str] = None
    step_model: Optional[str] = None
    policy: Optional[str] = None  # the adaptive policy's spec; default: `adaptive_spec(predictor, step_model)`
    compile: str = "auto"
    compile_spans: int = 1
    compile_packed: bool = False
    model_name: str = "blockpilot"
    device: Optional[str] = None
    dtype: Optional[str] = None
    limits: ServeLimits = ServeLimits()
    api_key: Optional[str] = field(default=None, repr=False)  # a secret: kept out of logs and Serve's config dumps
    # The predictor and step model folders' contents as `pinned` found them: a replica refuses a folder that changed.
    digests: dict[str, str] = field(default_factory=dict)

    def adaptive_spec(self) -> str:
        return self.policy or str(adaptive_spec(self.predictor, self.step_model))

    def pinned(self) -> "ModelLoader":
        """This loader with its models fixed now, at deploy time: an MLflow alias (`@champion`) or `latest` becomes
        the version it names, a predictor or step model folder is fingerprinted. Every replica, and one that restarts
        after the alias moved, then serves the same models; a new champion is served from the next deploy on."""
        from pathlib import Path

        from blockpilot.files import folder_digest
        from blockpilot.tracking import pinned_model_uri, pinned_spec

        fixed = {
            name: pinned_model_uri(value) if value is not None else None
            for name, value in (("predictor", self.predictor), ("step_model", self.step_model))
        }
        digests = {name: folder_digest(value) for name, value in fixed.items() if value and Path(value).is_dir()}
        policy = pinned_spec(self.policy) if self.policy else None
        return replace(self, **fixed, policy=policy, digests=digests)

    def served(self) -> dict[str, Optional[str]]:
        """What a replica of this loader serves, as `/v1/models` and every response's `blockpilot` object name it."""
        names = ("target", "drafter", "predictor", "step_model")
        served = {name: getattr(self, name) for name in names} | {"policy": self.adaptive_spec()}
        return served | {f"{name}_digest": digest for name, digest in self.digests.items()}

    def check_pinned_folders(self) -> None:
        """Refuse a predictor or step model folder whose content changed since `pinned` (a replica started later
        would serve other weights than its siblings)."""
        from blockpilot.files import folder_digest

        for name, digest in self.digests.items():
            now = folder_digest(getattr(self, name))
            if now != digest:
                raise ValueError(
                    f"the {name} folder {getattr(self, name)} changed since this deployment pinned it ({digest}, now "
                    f"{now}): deploy again to serve it"
                )

    def __call__(self) -> BatchedDecoder:
        import logging

        from transformers.utils import logging as hf_logging

        from blockpilot.models.loading import load_models

        hf_logging.disable_progress_bar()
        self.check_pinned_folders()
        models = load_models(self.target, self.drafter, device=self.device, dtype=self.dtype)
        decoder = BatchedDecoder(
            models,
            adaptive=self.adaptive_spec(),
            model_name=self.model_name,
            limits=self.limits,
            compile=self.compile,
            compile_spans=self.compile_spans,
            compile_packed=self.compile_packed,
            served=self.served(),
        )
        decoder.start()
        logging.getLogger("ray.serve").warning(
            "engine (%s) started in %.1f s: %d shapes built up front; serving %s",
            decoder._engine.decoder.mode,
            decoder.warm_up_seconds,
            len(decoder.compiled_shapes),
            json.dumps(decoder.served),
        )
        return decoder


# No /docs, /redoc or /openapi.json: the API is OpenAI's (documented there), and those routes would answer without
# the key that every other route but /health asks for.
api = FastAPI(title="BlockPilot adaptive decoder", docs_url=None, redoc_url=None, openapi_url=None)


def _error(status: int, message: str, param: Optional[str], kind: str, headers: Optional[dict] = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(status_code=status, content=body, headers=headers)


class BodyTooLarge(RequestError):
    """A request body over the size limit: 413, not 400."""


@api.exception_handler(RequestError)
async def _request_error(request: Request, error: RequestError) -> JSONResponse:
    status = 413 if isinstance(error, BodyTooLarge) else 400
    return _error(status, f"{error.field}: {error.message}", error.field, "invalid_request_error")


class NoAnswerInTime(RowFailure):
    """The engine sent nothing for this request past every deadline it has (queue, decoding): the waiting side
    gives up, so that no client hangs on an engine that does (the heartbeat then replaces the replica)."""


@api.exception_handler(RowFailure)
async def _row_failure(request: Request, error: RowFailure) -> JSONResponse:
    # This request alone failed in the engine: a 500 for it (504 when the engine did not answer), the replica and
    # the other requests go on.
    if isinstance(error, NoAnswerInTime):
        return _error(504, "the decoder did not answer in time", None, "server_error")
    return _error(500, "decoding this request failed", None, "server_error")


@api.exception_handler(Overloaded)
async def _overloaded(request: Request, error: Overloaded) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(error.retry_after_s)))}
    return _error(503, str(error), None, "overloaded", headers)


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON within `max_bytes` (413 beyond), or RequestError naming what is wrong."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge("body", f"{declared} bytes; at most {max_bytes}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise BodyTooLarge("body", f"more than {max_bytes} bytes")
    try:
        return json.loads(raw or b"null")
    except RecursionError:
        raise RequestError("body", "JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as error:  # malformed, or an integer literal over Python's digit limit
        raise RequestError("body", f"malformed JSON: {error}") from None


def check_api_key(request: Request, key: Optional[str]) -> Optional[JSONResponse]:
    given = request.headers.get("authorization", "")
    if key and not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):  # in constant time
        return _error(401, "missing or wrong API key (Authorization: Bearer KEY)", None, "authentication_error")
    return None


async def respond(decoder: BatchedDecoder, request: Request, chat: bool) -> Any:
    body = await read_json(request, decoder.limits.max_body_bytes)
    parsed = parse_request(body, ChatCompletionRequest if chat else CompletionRequest)
    checked = await asyncio.to_thread(decode_request, decoder, parsed)
    loop = asyncio.get_running_loop()
    events = RequestEvents()
    handle = decoder.submit(checked, listener=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    limits = decoder.limits
    handle.deadline = handle.submitted_at + limits.queue_timeout_s + limits.request_timeout_s + ANSWER_GRACE_S
    ident, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
    try:
        first = await next_event(events, request, handle)
    except BaseException:
        handle.cancel()
        raise
    if first is None:  # the client left while the request waited
        handle.cancel()
        return None
    if first[0] == "error":
        raise first[1]  # Overloaded (503) when no row freed in time, else a server error
    if parsed.stream:
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        stream = sse_events(decoder, events, first, handle, request, ident, created, chat, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    try:
        parts, event = [], first
        while event is not None and event[0] == "delta":
            parts.append(event[1])
            event = await next_event(events, request, handle)
        if event is None:
            return None
        if event[0] == "error":
            raise event[1]
        stats = event[1]
    finally:
        handle.cancel()  # no-op when finished; frees the row when the client left or the proxy gave up
    choice = {"index": 0, "finish_reason": stats["finish_reason"], "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": "".join(parts)}} if chat else {"text": "".join(parts)}
    return {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": decoder.model_name,
        "choices": [choice],
        "usage": stats["usage"],
        "blockpilot": stats["blockpilot"],
    }


DISCONNECT_CHECK_S = 0.25  # how often a request's client is asked whether it is still there
ANSWER_GRACE_S = 30.0  # past a request's queue and decoding deadlines, how long its waiting side still waits


async def next_event(events: asyncio.Queue, request: Request, handle: Any) -> Optional[tuple[str, Any]]:
    """The next event of a request, or None once its client has disconnected (its row is then freed). The client
    is asked every `DISCONNECT_CHECK_S` even while events keep coming: a non-streaming request's deltas arrive every
    cycle, and checking only when none came let a request whose client left run to its end."""
    now = time.monotonic()
    if now - handle.checked_at >= DISCONNECT_CHECK_S:
        handle.checked_at = now
        if await request.is_disconnected():
            handle.cancel()
            return None
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_S)
        except TimeoutError:
            if handle.deadline is not None and time.monotonic() > handle.deadline:
                handle.cancel()
                raise NoAnswerInTime("the decoder sent nothing past the request's deadlines") from None
            handle.checked_at = time.monotonic()
            if await request.is_disconnected():
                handle.cancel()
                return None


class RequestEvents(asyncio.Queue):
    """A request's events on the server's event loop (the engine thread hands them over); `ended` is set once its
    last (the end, or an error) is queued, so a stream that waits out its interval is woken for it."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    def put_nowait(self, event: tuple[str, Any]) -> None:
        super().put_nowait(event)
        if event[0] != "delta":
            self.ended.set()


def queued_text(events: asyncio.Queue, text: str) -> tuple[str, Optional[tuple[str, Any]]]:
    """`text` and the deltas queued behind it, as one: where the engine ran ahead of a stream (within the stream's
    interval, or while the event loop was busy with others), one chunk carries them, not one each (a chunk costs the
    replica's event loop, Serve's streaming and its proxy the same however many tokens it holds). Also the first event
    queued that is not a delta (None: none)."""
    parts = [text]
    while not events.empty():
        event = events.get_nowait()
        if event[0] != "delta":
            return "".join(parts), event
        parts.append(event[1])
    return "".join(parts), None


async def sse_events(
    decoder: BatchedDecoder,
    events: RequestEvents,
    first: tuple[str, Any],
    handle: Any,
    request: Request,
    ident: str,
    created: int,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format; a client that goes away frees its row. The first token goes
    out at once; later chunks at most one per `stream_interval_s`, each with every delta decoded meanwhile, and the
    request's end as soon as it comes."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: Optional[str], finish: Optional[str], first_chunk: bool = False, extra: Optional[dict] = None) -> bytes:
        if chat:
            content = {"role": "assistant", "content": ""} if first_chunk else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": content, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        payload = {"id": ident, "object": kind, "created": created, "model": decoder.model_name, "choices": [choice]}
        return f"data: {json.dumps(payload | (extra or {}))}\n\n".encode()

    sent_at = -math.inf  # the first token goes out at once: the interval only spaces the chunks after it
    try:
        if chat:
            yield chunk(None, None, first_chunk=True)
        event: Optional[tuple[str, Any]] = first
        while event is not None:
            what, value = event
            if what == "delta":
                wait = sent_at + decoder.limits.stream_interval_s - time.monotonic()
                if wait > 0 and not events.ended.is_set():  # the deltas decoded meanwhile go with this one
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(events.ended.wait(), wait)
                value, event = queued_text(events, value)
                line = chunk(value, None)
                sent_at = time.monotonic()  # stamped as it leaves: building it is not part of the interval
                yield line
                if event is not None:  # the request's end, queued behind its last deltas
                    continue
            elif what == "error":
                # Overloaded says what to do; any other failure's text stays in the server's log.
                text = str(value) if isinstance(value, Overloaded) else "decoding this request failed"
                message = {"error": {"message": text, "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(message)}\n\n".encode()
                break
            else:
                extra = {"blockpilot": value["blockpilot"]} | ({"usage": value["usage"]} if include_usage else {})
                yield chunk(None, value["finish_reason"], extra=extra)
                break
            try:
                event = await next_event(events, request, handle)
            except NoAnswerInTime as error:  # the stream says so, as it says any other failure
                event = ("error", error)
        if event is not None:
            yield b"data: [DONE]\n\n"
    finally:
        handle.cancel()


METRICS_INTERVAL_S = 1.0  # how often a replica copies its engine's running totals into its metrics


class ReplicaMetrics:
    """A replica's Prometheus metrics, through Ray Serve's metrics API (Ray exports them with the node's metrics; the
    Ray dashboard and Grafana read them there, each with Serve's replica tags and the model's name): per finished
    request, its policy, finish reason, tokens, tau, queue time and the shape of every cycle it ran (the shapes
    chosen, `blocks.cycle_shapes`); per engine step, from the decoder's running totals every `METRICS_INTERVAL_S`,
    the steps, their seconds and the rows that decoded in them (mean cycle time and rows per cycle are ratios of their
    rates), and the rows decoding and the requests waiting now."""

    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        model_tag = ("model",)
        self.requests = metrics.Counter(
            "blockpilot_requests", "finished requests", tag_keys=("model", "policy", "finish_reason")
        )
        self.tokens = metrics.Counter("blockpilot_generated_tokens", "generated tokens", tag_keys=model_tag)
        self.cycles = metrics.Counter(
            "blockpilot_cycles", "draft/verify cycles by the shape they ran (b=1, b=4, tree:15)", ("model", "shape")
        )
        self.tau = metrics.Histogram(
            "blockpilot_request_tau", "a request's mean tokens a cycle", [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8], model_tag
        )
        self.queue = metrics.Histogram(
            "blockpilot_queue_seconds", "a request's wait for a row", [0.001, 0.01, 0.1, 0.5, 1, 5, 30], model_tag
        )
        self.steps = metrics.Counter("blockpilot_engine_steps", "engine steps (a cycle each)", tag_keys=model_tag)
        self.step_seconds = metrics.Counter("blockpilot_engine_step_seconds", "seconds in engine steps", model_tag)
        self.step_rows = metrics.Counter("blockpilot_engine_step_rows", "rows decoding, summed over steps", model_tag)
        self.active = metrics.Gauge("blockpilot_active_rows", "rows decoding", tag_keys=model_tag)
        self.waiting = metrics.Gauge("blockpilot_waiting_requests", "requests waiting for a row", tag_keys=model_tag)
        for metric in vars(self).values():
            metric.set_default_tags({"model": model})
        self._seen = StepTotals()

    def finished(self, stats: dict[str, Any]) -> None:
        """One finished request (`BatchedDecoder.on_finished`, from the engine thread)."""
        own = stats["blockpilot"]
        self.requests.inc(tags={"policy": own["policy"], "finish_reason": stats["finish_reason"]})
        self.tokens.inc(stats["usage"]["completion_tokens"])
        for shape, cycles in Counter(cycle_shapes(own["block_sizes"], own["tree_nodes"])).items():
            self.cycles.inc(cycles, tags={"shape": shape})
        if own["tau"] is not None:
            self.tau.observe(own["tau"])
        self.queue.observe(own["queue_time_s"])

    def sample(self, decoder: BatchedDecoder) -> None:
        """The engine's steps since the last sample, and the load now."""
        now = replace(decoder.totals)
        seen, self._seen = self._seen, now
        if now.steps > seen.steps:
            self.steps.inc(now.steps - seen.steps)
            self.step_seconds.inc(now.seconds - seen.seconds)
            self.step_rows.inc(now.rows - seen.rows)
        load = decoder.load
        self.active.set(load["active"])
        self.waiting.set(load["waiting"])


@serve.deployment(name="BlockPilotDecoder")
@serve.ingress(api)
class BlockPilotDecoder:
    """A replica: loads its decoder through the injected loader (its engine loop starts), then serves the routes.

    Defined after the helpers it calls: `serve.ingress` pickles the app (and with it these methods and the
    module globals they see) when the class is decorated."""

    def __init__(self, loader: Callable[[], BatchedDecoder]) -> None:
        self.decoder = loader()
        self.api_key = getattr(loader, "api_key", None) or os.environ.get(API_KEY_ENV) or None
        self.metrics = ReplicaMetrics(self.decoder.model_name)
        self.decoder.on_finished = self.metrics.finished
        threading.Thread(target=self._sample_metrics, name="blockpilot-metrics", daemon=True).start()

    def _sample_metrics(self) -> None:
        while True:
            time.sleep(METRICS_INTERVAL_S)
            try:
                self.metrics.sample(self.decoder)
            except Exception:  # a metrics backend that fails costs the metrics, not the replica
                logging.getLogger("ray.serve").exception("sampling the engine's metrics failed")

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine died (a broken device) is replaced."""
        if not self.decoder.healthy:
            raise RuntimeError(f"the decoder is not running: {self.decoder.failure!r}")

    @api.get("/health")
    async def health(self) -> Any:
        if not self.decoder.healthy:  # the cause goes to the replica's log (check_health), not to any caller
            return _error(503, "the decoder is not running", None, "server_error")
        return {"status": "ok", **self.decoder.load}

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        denied = check_api_key(request, self.api_key)
        if denied is not None:
            return denied
        card = {"id": self.decoder.model_name, "object": "model", "created": 0, "owned_by": "blockpilot"}
        return {"object": "list", "data": [card | {"blockpilot": self.decoder.served}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return check_api_key(request, self.api_key) or await respond(self.decoder, request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return check_api_key(request, self.api_key) or await respond(self.decoder, request, chat=True)


def build_app(
    loader: Callable[[], BatchedDecoder],
    *,
    num_replicas: Optional[int] = 1,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
    autoscaling_config: Optional[dict] = None,
    max_ongoing_requests: Optional[int] = None,
    max_queued_requests: Optional[int] = None,
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S,
) -> Any:
    """The Serve application: the decoder deployment bound to `loader`; autoscaling settings pass through. A
    replica that is stopped (the app deleted, redeployed or scaled down) finishes its requests in flight for up to
    `grace_period_s` first.

    A replica decodes `max_batch` requests and queues `max_queue`; by default Serve routes it twice that many,
    so that a burst beyond its capacity reaches the replica and is refused there at once, with Retry-After.
    Serve's own refusal (beyond `max_queued_requests` waiting in its router) is a bare 503 without that header,
    and the router's count of in-flight requests lags, so it must not be the limit a client meets first."""
    if isinstance(loader, ModelLoader):  # fixed here, where the app is deployed, not where each replica starts
        loader = loader.pinned()
    limits = getattr(loader, "limits", ServeLimits())
    ongoing = max_ongoing_requests or 2 * (limits.max_batch + limits.max_queue)
    options: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": num_cpus},
        "max_ongoing_requests": ongoing,
        "max_queued_requests": max_queued_requests or ongoing,
        "health_check_period_s": 10,
        "graceful_shutdown_timeout_s": grace_period_s,
        # How often a stopping replica looks whether its requests are done: Serve's 2 s would hold every stop.
        "graceful_shutdown_wait_loop_s": min(0.5, grace_period_s),
    }
    if autoscaling_config:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    return BlockPilotDecoder.options(**options).bind(loader)


# `build_app`'s keywords: what a serve config's `args` may give beside `ModelLoader`'s fields.
DEPLOYMENT_OPTIONS = (
    "num_replicas",
    "num_gpus",
    "num_cpus",
    "autoscaling_config",
    "max_ongoing_requests",
    "max_queued_requests",
    "grace_period_s",
)


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run` / `serve deploy` entry (cluster/serve.yaml): ModelLoader's fields + deployment options."""
    args = dict(args)
    deployment = {k: args.pop(k) for k in DEPLOYMENT_OPTIONS if k in args}
    limits = ServeLimits(**args.pop("limits", {}))
    return build_app(ModelLoader(**args, limits=limits), **deployment)


@dataclass
class LocalServer:
    """A running local endpoint (embedded Ray, Serve on 127.0.0.1)."""

    url: str
    app_name: str
    started_ray: bool = False  # whether serve_locally started the embedded Ray this server runs on

    @classmethod
    def at(cls, host: str, port: int, app_name: str = APP_NAME, route_prefix: str = "/") -> "LocalServer":
        """The endpoint an app `app_name` at `route_prefix` on Serve's `host:port` answers at."""
        return cls(f"http://{host}:{port}{route_prefix.rstrip('/')}", app_name)

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        """Block until GET /health answers 200 (the proxy and a replica are up), or raise TimeoutError."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the endpoint at {self.url} did not become healthy in {timeout_s:.0f}s")
            time.sleep(0.5)

    def in_flight(self) -> int:
        """Requests the endpoint is decoding or holding in its queue now (its replica's load; 0 when it does not
        answer)."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                load = json.loads(response.read())
        except (OSError, ValueError):
            return 0
        return int(load.get("active", 0)) + int(load.get("waiting", 0))

    def shutdown(self) -> None:
        """Delete the app; Serve lets each replica finish its requests in flight first (`build_app`'s grace). Nothing
        to do where Ray or Serve never started (a stop while starting)."""
        import ray
        from ray.serve.exceptions import RayServeException

        if not ray.is_initialized():
            return
        with contextlib.suppress(RayServeException):  # no Serve instance: nothing was deployed
            serve.delete(self.app_name)

    def close(self) -> None:
        """Delete the app; when `serve_locally` started the embedded Ray, stop that Ray too, and Serve with it.
        (`serve.shutdown()` first would kill its controller under its own graceful-shutdown task, which the raylet
        then reports as a failed task.)"""
        import ray

        self.shutdown()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def serve_locally(
    loader: Callable[[], BatchedDecoder],
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    app_name: str = APP_NAME,
    route_prefix: str = "/",
    request_timeout_s: float = 180.0,
    log_level: str = "INFO",
    **deployment: Any,
) -> LocalServer:
    """Start Serve on `host:port` (loopback by default) in the embedded Ray and deploy the decoder at
    `route_prefix` (several apps may share one Serve instance under different prefixes). At `log_level`
    WARNING, Serve's lifecycle lines and the per-request access log are left out (the demo's log)."""
    import logging

    from pipelines.ray_runtime import ensure_ray

    if host not in ("127.0.0.1", "localhost", "::1") and not getattr(loader, "api_key", None):
        logging.getLogger("ray.serve").warning(
            "serving on %s without an API key: anyone who reaches this host can use it (set --api-key)", host
        )
    started_ray = ensure_ray()
    logs = {"log_level": log_level, "enable_access_log": log_level in ("DEBUG", "INFO")}
    logging.getLogger("ray.serve").setLevel(log_level)
    serve.start(http_options={"host": host, "port": port, "request_timeout_s": request_timeout_s}, logging_config=logs)
    serve.run(
        build_app(loader, **deployment), name=app_name, route_prefix=route_prefix, blocking=False, logging_config=logs
    )
    return replace(LocalServer.at(host, port, app_name, route_prefix), started_ray=started_ray)


# ----------------------------------------------------------------------------- command line


@dataclass(frozen=True)
class ServeJob:
    target: str = option(type=model_ref, help="target model folder or hub id")
    drafter: Optional[str] = option(None, type=model_ref, help="DFlash drafter folder or hub id")
    predictor: Optional[str] = option(None, help="per-request predictor: folder or models:/blockpilot-predictor@champion")
    step_model: Optional[str] = option(
        None, help="per-step model: folder or models:/blockpilot-step-policy@champion (with --predictor: both)"
    )
    policy: Optional[str] = option(
        None, help="the adaptive policy's spec (default: learned+step, learned-step or learned from the models given, else fixed)"
    )
    compile: str = option("auto", choices=COMPILE_MODES, help=COMPILE_HELP)
    compile_spans: int = option(
        1,
        type=positive_int_arg,
        help="spans of cache (256, 512, ... slots) whose cycles the replica builds up front, for every row bucket; "
        "longer rows' cycles run eagerly (nothing compiles while serving)",
    )
    compile_packed: bool = option(
        False,
        help="also build each bucket of several rows' cycle packed (one more step a bucket and span): rows of unequal "
        "block sizes (a request's block_size, a budget's last block) then compute their own slots, not the widest's",
    )
    host: str = option("127.0.0.1", help="interface to bind (loopback by default)")
    port: int = option(8000, type=positive_int_arg, help="HTTP port")
    model_name: str = option("blockpilot", help="the model id the API reports")
    replicas: int = option(1, type=positive_int_arg, help="replicas (each runs one batched engine)")
    num_gpus: float = option(0.0, type=non_negative_float_arg, help="GPUs per replica")
    num_cpus: float = option(1.0, type=positive_float_arg, help="CPUs per replica: Ray runs its torch on as many threads")
    grace_period_s: float = option(
        DEFAULT_GRACE_PERIOD_S,
        type=non_negative_float_arg,
        help="on Ctrl-C or SIGTERM, seconds the requests in flight get to finish before the replicas stop",
    )
    api_key: Optional[str] = option(None, help=f"require Authorization: Bearer KEY (or set {API_KEY_ENV})")
    device: Optional[str] = option(None, help="cpu, cuda, ... (default: cuda when present)")
    dtype: Optional[str] = option(None, help="float32, bfloat16, ...")
    limits: ServeLimits = nested(ServeLimits)

    def loader(self) -> ModelLoader:
        """The replica's loader: every field the two share, taken as it is (`limits` stays a `ServeLimits`), the
        key falling back to the environment. One mapping, so a field added to both is passed once."""
        both = ModelLoader.__dataclass_fields__.keys() & self.__dataclass_fields__.keys()
        shared = {name: getattr(self, name) for name in both}
        shared["api_key"] = self.api_key or os.environ.get(API_KEY_ENV)
        return ModelLoader(**shared)


def run_serve_job(job: ServeJob) -> int:
    """Serve until Ctrl-C (SIGINT) or SIGTERM, then stop what this process started (`LocalServer.close`): on a
    cluster (`RAY_ADDRESS`) only this app goes."""
    import signal

    from pipelines.ray_runtime import ensure_ray

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Both set here: a process started in the background by a shell inherits SIGINT ignored. (`ensure_ray` keeps
    # them over Ray's own SIGTERM handler.)
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    # Known before anything starts: the replica answers requests before `serve.run` returns, so a signal may come
    # while `serve_locally` still waits on it, and must stop (and drain) what was started all the same.
    server = LocalServer.at(job.host, job.port)
    try:
        server.started_ray = ensure_ray()
        serve_locally(
            job.loader(),
            port=job.port,
            host=job.host,
            app_name=server.app_name,
            num_replicas=job.replicas,
            num_gpus=job.num_gpus,
            num_cpus=job.num_cpus,
            grace_period_s=job.grace_period_s,
        )
        server.wait_healthy()
        print(f"serving {job.model_name} at {server.url}/v1 (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        waiting = f"{server.in_flight()} in flight, up to {job.grace_period_s:g} s to finish"
        print(f"stopping the endpoint ({waiting})", flush=True)
    finally:
        # A second Ctrl-C while stopping would leave Serve's actors and the embedded Ray running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.close()
    return 0


def main(argv: Optional[list] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipelines.serve", description=__doc__)
    add_options(parser, ServeJob)
    try:
        return run_serve_job(from_args(ServeJob, parser.parse_args(argv)))
    except (ValueError, FileNotFoundError) as error:
        print(f"serve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
