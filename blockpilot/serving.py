"""The adaptive decoder behind the HTTP endpoint, Ray-free: request checks, policy choice, stop strings,
streamed text. `pipelines/serve.py` wraps it in a FastAPI app on Ray Serve.

Per request: `temperature` (0..2), `max_tokens` (1..cap), `stop` (strings), `seed`, and two extensions:
`block_size` forces a fixed b (1..max_block_size), `policy` is `adaptive` (the predictor when one is
loaded, else the drafter's training block size) or `fixed` (the training block size).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from blockpilot.decoding.policies import BlockSizePolicy, FixedBlockSize
from blockpilot.decoding.speculative import Generation, GenerationConfig, GenerationResult
from blockpilot.models.loading import SpeculativeModels

POLICIES = ("adaptive", "fixed")


class RequestError(ValueError):
    """A request that cannot be served: `field` names the parameter, `status` is the HTTP status."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.message, self.status = field, message, status


@dataclass(frozen=True)
class ServeLimits:
    max_tokens_cap: int = 512
    default_max_tokens: int = 128
    max_block_size: int | None = None  # None: twice the drafter's training block size
    max_stop_strings: int = 4
    request_timeout_s: float = 120.0


@dataclass(frozen=True)
class DecodeRequest:
    """A checked request, prompt tokenized."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    stop: tuple[str, ...]
    seed: int | None
    block_size: int | None
    policy: str


@dataclass
class StreamedText:
    """Turns committed token chunks into text deltas: whole characters only, stop strings cut and never
    half-shown (text that could still become a stop string is held back until it cannot)."""

    tokenizer: Any
    stop: Sequence[str]
    tokens: list[int] = field(default_factory=list)
    emitted: str = ""
    stopped: bool = False

    def push(self, new_tokens: Sequence[int], final: bool = False) -> str:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped, final = text[:cut], True, True
        elif not final:
            if text.endswith("\ufffd"):  # a character split across tokens: wait for its last byte
                text = text.rstrip("\ufffd")
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta


class DecoderEngine:
    """Target + drafter (+ predictor) serving completions one at a time (batch size 1 per engine)."""

    def __init__(
        self,
        models: SpeculativeModels,
        predictor: Any | None = None,
        *,
        model_name: str = "blockpilot",
        limits: ServeLimits | None = None,
    ) -> None:
        if models.tokenizer is None:
            raise ValueError("serving needs a tokenizer")
        self.models, self.predictor, self.model_name = models, predictor, model_name
        self.limits = limits or ServeLimits()
        if predictor is not None and models.drafter is not None:
            from blockpilot.predictor import LearnedPolicy

            self.learned: BlockSizePolicy | None = LearnedPolicy(predictor)
            self.learned.check_fits(models.target.get_output_embeddings().weight.shape[0], models.train_block_size)
        else:
            self.learned = None
        self.context = int(getattr(models.target.config, "max_position_embeddings", 1 << 30))
        self._lock = threading.Lock()

    @property
    def max_block_size(self) -> int:
        if self.limits.max_block_size is not None:
            return self.limits.max_block_size
        return 2 * self.models.train_block_size if self.models.drafter is not None else 1

    # ---------------------------------------------------------------- request checks

    def check(self, body: dict[str, Any], *, chat: bool) -> DecodeRequest:
        """A checked request, or RequestError naming the offending field."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("messages", "messages must be a non-empty list of {role, content} objects")
            for index, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                    raise RequestError(f"messages[{index}]", "each message needs a string 'content'")
                if message.get("role") not in ("system", "user", "assistant"):
                    raise RequestError(f"messages[{index}].role", "role must be 'system', 'user' or 'assistant'")
            if not any(m["content"].strip() for m in messages):
                raise RequestError("messages", "messages are empty")
            prompt_ids = self.models.encode_prompt([{"role": m["role"], "content": m["content"]} for m in messages])
            prompt_field = "messages"
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if prompt is None:
                raise RequestError("prompt", "prompt is required")
            if not isinstance(prompt, str):
                raise RequestError("prompt", "prompt must be a string")
            if not prompt.strip():
                raise RequestError("prompt", "prompt is empty")
            prompt_ids = self.models.encode_prompt(prompt, chat=False)
            prompt_field = "prompt"

        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        max_tokens = self.limits.default_max_tokens if max_tokens is None else max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise RequestError("max_tokens", "max_tokens must be an integer")
        if not 1 <= max_tokens <= self.limits.max_tokens_cap:
            raise RequestError(
                "max_tokens", f"max_tokens must be between 1 and {self.limits.max_tokens_cap}, got {max_tokens}"
            )
        if len(prompt_ids) >= self.context:
            raise RequestError(
                prompt_field, f"the prompt has {len(prompt_ids)} tokens; the context holds {self.context}"
            )
        if len(prompt_ids) + max_tokens > self.context:
            raise RequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of {self.context}",
            )

        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else temperature  # OpenAI's default
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise RequestError("temperature", "temperature must be a number")
        if not math.isfinite(temperature) or not 0 <= temperature <= 2:
            raise RequestError("temperature", f"temperature must be a number in [0, 2], got {temperature}")

        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop", "stop must be a non-empty string or a list of them")
        if len(stop) > self.limits.max_stop_strings:
            raise RequestError("stop", f"at most {self.limits.max_stop_strings} stop strings")

        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError("seed", "seed must be an integer")

        block_size = body.get("block_size")
        if block_size is not None:
            if isinstance(block_size, bool) or not isinstance(block_size, int):
                raise RequestError("block_size", "block_size must be an integer")
            if not 1 <= block_size <= self.max_block_size:
                raise RequestError(
                    "block_size", f"block_size must be between 1 and {self.max_block_size}, got {block_size}"
                )
        policy = body.get("policy", "adaptive")
        if policy not in POLICIES:
            raise RequestError("policy", f"policy must be one of {list(POLICIES)}, got {policy!r}")
        return DecodeRequest(prompt_ids, max_tokens, float(temperature), tuple(stop), seed, block_size, policy)

    # ---------------------------------------------------------------- decoding

    def policy_for(self, request: DecodeRequest) -> tuple[BlockSizePolicy | None, str]:
        if self.models.drafter is None:
            return None, "autoregressive"
        if request.block_size is not None:
            return FixedBlockSize(request.block_size), "fixed"
        if request.policy == "adaptive" and self.learned is not None:
            return self.learned, "adaptive"
        return FixedBlockSize(self.models.train_block_size), "fixed"

    def stream(
        self, request: DecodeRequest, cancel: threading.Event | None = None
    ) -> Iterator[tuple[str, dict | None]]:
        """Text deltas as cycles commit; the last item carries the final stats (finish reason, usage, ...).

        Holds the engine's lock for the whole generation; `cancel` (set by the server when the client goes
        away) and the request timeout end it after the current cycle.
        """
        policy, policy_name = self.policy_for(request)
        config = GenerationConfig(
            max_new_tokens=request.max_tokens,
            temperature=request.temperature,
            stop_token_ids=tuple(self.models.stop_token_ids()),
            seed=request.seed,
        )
        text = StreamedText(self.models.tokenizer, request.stop)
        deadline = time.monotonic() + self.limits.request_timeout_s
        timed_out = False
        with self._lock:
            generation = Generation(self.models, request.prompt_ids, policy=policy, config=config)
            for chunk in generation:
                delta = text.push(chunk)
                if delta:
                    yield delta, None
                timed_out = time.monotonic() > deadline
                if text.stopped or (cancel is not None and cancel.is_set()) or timed_out:
                    generation.cancel()
            result = generation.result
        tail = text.push([], final=True)
        yield tail, self._stats(result, text, policy_name, timed_out=timed_out)

    def complete(self, request: DecodeRequest) -> tuple[str, dict]:
        parts, stats = [], {}
        for delta, final in self.stream(request):
            parts.append(delta)
            stats = final or stats
        return "".join(parts), stats

    def _stats(self, result: GenerationResult | None, text: StreamedText, policy_name: str, timed_out: bool) -> dict:
        assert result is not None
        if text.stopped or result.stop_reason == "stop":
            finish = "stop"
        elif timed_out:
            finish = "timeout"
        elif result.stop_reason == "cancelled":
            finish = "cancelled"
        else:
            finish = "length"
        return {
            "finish_reason": finish,
            "usage": {
                "prompt_tokens": result.prompt_length,
                "completion_tokens": len(result.token_ids),
                "total_tokens": result.prompt_length + len(result.token_ids),
            },
            "blockpilot": {
                "block_size": result.block_size if self.models.drafter is not None else 1,
                "policy": policy_name,
                "tau": None if math.isnan(result.tau) else round(result.tau, 4),
                "cycles": result.cycles,
                "prefill_time_s": round(result.prefill_time_s, 6),
                "decode_time_s": round(result.decode_time_s, 6),
            },
        }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
