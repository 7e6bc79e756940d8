"""The adaptive decoder on Ray Serve: an OpenAI-style HTTP endpoint.

    blockpilot serve --target DIR --drafter DIR [--predictor PATH_OR_MODEL_URI] [--port 8000]
    serve run cluster/serve.yaml          # or `serve deploy` against a running cluster

Routes: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), `stream: true`
as server-sent events in OpenAI's chunk format, GET /v1/models, GET /health. Responses carry `usage` and
a `blockpilot` object (block size used, policy, mean tau, cycles, prefill and decode times).

The deployment loads its models through an injectable loader (`ModelLoader`: local paths or MLflow model
URIs by default; tests pass their own), so nothing is loaded at import time.
"""

# No `from __future__ import annotations` here: FastAPI must see `Request` as a class, not a string, on the
# methods that Serve's ingress wraps, or it reads `request` as a required query parameter (422).
import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from blockpilot.serving import DecoderEngine, RequestError, ServeLimits, new_id


@dataclass(frozen=True)
class ModelLoader:
    """What a replica loads: paths or hub ids for target and drafter, a predictor folder or MLflow model URI."""

    target: str
    drafter: str | None = None
    predictor: str | None = None
    model_name: str = "blockpilot"
    device: str | None = None
    dtype: str | None = None
    limits: ServeLimits = ServeLimits()

    def __call__(self) -> DecoderEngine:
        from transformers.utils import logging as hf_logging

        from blockpilot.models.loading import load_models
        from blockpilot.predictor import load_predictor

        hf_logging.disable_progress_bar()
        models = load_models(self.target, self.drafter, device=self.device, dtype=self.dtype)
        predictor = load_predictor(self.predictor) if self.predictor else None
        return DecoderEngine(models, predictor, model_name=self.model_name, limits=self.limits)


api = FastAPI(title="BlockPilot adaptive decoder")


@api.exception_handler(RequestError)
async def _request_error(request: Request, error: RequestError) -> JSONResponse:
    body = {
        "error": {
            "message": f"{error.field}: {error.message}",
            "type": "invalid_request_error",
            "param": error.field,
            "code": None,
        }
    }
    return JSONResponse(status_code=error.status, content=body)


async def read_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError("body", f"malformed JSON: {error}") from error
    if not isinstance(body, dict):
        raise RequestError("body", "the request body must be a JSON object")
    return body


async def respond(engine: DecoderEngine, request: Request, *, chat: bool) -> Any:
    body = await read_body(request)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", "stream must be true or false")
    checked = await asyncio.to_thread(engine.check, body, chat=chat)
    ident, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
    if stream:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = sse_events(engine, checked, request, ident, created, chat, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    text, stats = await asyncio.to_thread(engine.complete, checked)
    choice = {"index": 0, "finish_reason": stats["finish_reason"], "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": engine.model_name,
        "choices": [choice],
        "usage": stats["usage"],
        "blockpilot": stats["blockpilot"],
    }


async def sse_events(
    engine: DecoderEngine, checked: Any, request: Request, ident: str, created: int, chat: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format. The generation runs in a thread and hands its deltas over
    a queue; a client that goes away cancels it, so the replica is free again after the current cycle."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def produce() -> None:
        try:
            for item in engine.stream(checked, cancel):
                loop.call_soon_threadsafe(queue.put_nowait, ("item", item))
        except BaseException as error:  # surfaced to the client as the stream's last event
            loop.call_soon_threadsafe(queue.put_nowait, ("error", error))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, ("done", None))

    threading.Thread(target=produce, daemon=True).start()
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None, first: bool = False, extra: dict | None = None) -> bytes:
        if chat:
            content = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": content, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        payload = {"id": ident, "object": kind, "created": created, "model": engine.model_name, "choices": [choice]}
        return f"data: {json.dumps(payload | (extra or {}))}\n\n".encode()

    try:
        if chat:
            yield chunk(None, None, first=True)
        while True:
            try:
                what, value = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if what == "done":
                break
            if what == "error":
                message = {"error": {"message": str(value), "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(message)}\n\n".encode()
                break
            delta, final = value
            if final is None:
                yield chunk(delta, None)
                continue
            extra = {"blockpilot": final["blockpilot"]} | ({"usage": final["usage"]} if include_usage else {})
            yield chunk(delta, final["finish_reason"], extra=extra)
        yield b"data: [DONE]\n\n"
    finally:
        cancel.set()  # the client went away (or the stream ended): the generation stops after its current cycle


@serve.deployment(name="BlockPilotDecoder", max_ongoing_requests=8)
@serve.ingress(api)
class BlockPilotDecoder:
    """A replica: loads its engine through the injected loader, then serves the routes.

    Defined after the helpers it calls: `serve.ingress` pickles the app (and with it these methods and the
    module globals they see) when the class is decorated."""

    def __init__(self, loader: Callable[[], DecoderEngine]) -> None:
        self.engine = loader()

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.engine.model_name, "object": "model", "created": 0, "owned_by": "blockpilot"}],
        }

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await respond(self.engine, request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await respond(self.engine, request, chat=True)


def build_app(
    loader: Callable[[], DecoderEngine],
    *,
    num_replicas: int | None = 1,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
    autoscaling_config: dict | None = None,
    max_ongoing_requests: int = 8,
) -> Any:
    """The Serve application: the decoder deployment bound to `loader`; autoscaling settings pass through."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": num_cpus},
        "max_ongoing_requests": max_ongoing_requests,
    }
    if autoscaling_config:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    return BlockPilotDecoder.options(**options).bind(loader)


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run` / `serve deploy` entry (cluster/serve.yaml): ModelLoader's fields + deployment options."""
    args = dict(args)
    deployment = {
        k: args.pop(k)
        for k in ("num_replicas", "num_gpus", "num_cpus", "autoscaling_config", "max_ongoing_requests")
        if k in args
    }
    limits = ServeLimits(**args.pop("limits", {}))
    return build_app(ModelLoader(**args, limits=limits), **deployment)


@dataclass
class LocalServer:
    """A running local endpoint (embedded Ray, Serve on 127.0.0.1)."""

    url: str
    app_name: str

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

    def shutdown(self) -> None:
        serve.delete(self.app_name)


def serve_locally(
    loader: Callable[[], DecoderEngine],
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    app_name: str = "blockpilot",
    request_timeout_s: float = 180.0,
    **deployment: Any,
) -> LocalServer:
    """Start Serve on `host:port` (loopback by default) in the embedded Ray and deploy the decoder."""
    from pipelines.ray_runtime import ensure_ray

    ensure_ray()
    serve.start(http_options={"host": host, "port": port, "request_timeout_s": request_timeout_s})
    serve.run(build_app(loader, **deployment), name=app_name, route_prefix="/", blocking=False)
    return LocalServer(f"http://{host}:{port}", app_name)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.serve ...` = `blockpilot serve ...`."""
    import sys

    from blockpilot.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
