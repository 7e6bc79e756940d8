"""The OpenAI protocol of the endpoint: the typed requests of /v1/completions and /v1/chat/completions, what of
OpenAI's fields this server refuses, and the conversion of a parsed request to the library's `DecodeRequest` (the
prompt tokenized, the bounds that depend on the models and limits checked by `BatchedDecoder.check`). Errors are the
library's plain `RequestError` naming the field; the HTTP layer (`pipelines/serve.py`) maps them to statuses."""

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from blockpilot.serving import BatchedDecoder, DecodeRequest, RequestError

# Every request field this server accepts beyond the typed ones below, and what it does with it. A field that would
# change what is generated or returned is honored (typed below) or accepted only at its neutral value (OpenAI's and
# vLLM's sampling extras), so nothing a client asks for is silently dropped; fields that change nothing generated
# (billing, tracing) are accepted and not used; anything else is a 400 naming it, as OpenAI answers an unrecognized
# argument. docs/operations.md has the table.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),  # chat: a flag; completions: a count, where even 0 asks for the sampled token's
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "min_p": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "modalities": (["text"],),
}
UNUSED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")


def neutral(value: Any, values: tuple[Any, ...]) -> bool:
    """Whether `value` is absent or one of `values`, of the same type (0 is not False: `logprobs: 0` asks)."""
    return value is None or any(type(value) is type(v) and value == v for v in values)


# ----------------------------------------------------------------------------- typed requests


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class GenerationFields(BaseModel):
    """What completions and chat completions share. Other fields are checked by `refuse_unsupported` against
    `NEUTRAL_VALUES` and `UNUSED_FIELDS`: refused rather than silently dropped."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    temperature: Optional[float] = Field(default=None, allow_inf_nan=True)
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None  # vLLM's extension; -1 or 0: every token
    stop: Union[str, list[str], None] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[StrictInt] = None
    block_size: Optional[StrictInt] = None  # extension: force a fixed b
    policy: str = "adaptive"  # extension: adaptive (the server's policy) or fixed (the training block size)
    ignore_eos: StrictBool = False  # extension: always generate max_tokens (benchmarks)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        if isinstance(value, bool) or (value is not None and not isinstance(value, (int, float))):
            raise ValueError("must be a number")
        if isinstance(value, int) and abs(value) > 1000:
            raise ValueError(f"must be a small number, got an integer of {len(str(abs(value)))} digits")
        return value

    def refuse_unsupported(self) -> None:
        """A 400 (`RequestError`) naming the first field this server would not honor exactly."""
        for name, value in (self.model_extra or {}).items():
            if name in UNUSED_FIELDS:
                continue
            if name not in NEUTRAL_VALUES:
                raise RequestError(name, "not a field this server knows (docs/operations.md lists them)")
            if not neutral(value, NEUTRAL_VALUES[name]):
                allowed = " or ".join(repr(v) for v in NEUTRAL_VALUES[name])
                raise RequestError(name, f"not supported by this server: only {allowed} (or absent) is accepted")
        if self.n is not None and self.n != 1:
            raise RequestError("n", "only n = 1 is supported")

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(GenerationFields):
    prompt: Union[str, list[str]]

    @property
    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise RequestError("prompt", "exactly one prompt per request (a list of one string is accepted)")
            return self.prompt[0]
        return self.prompt


class ChatTemplateOptions(BaseModel):
    """What a chat request may pass to the chat template (vLLM's `chat_template_kwargs`): Qwen3's thinking switch.
    Other keys are refused: a template may do anything with them."""

    model_config = ConfigDict(extra="forbid")

    enable_thinking: StrictBool = False


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: Optional[ChatTemplateOptions] = None


def _field_name(location: tuple[Any, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; pydantic's union branch names are dropped."""
    name = ""
    for part in location:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ("str", "list[str]", "list[TextPart]", "function-after[...]") or "[" in str(part):
            continue
        else:
            name += ("." if name else "") + str(part)
    return name or "body"


def parse_request(body: Any, model: type[GenerationFields]) -> GenerationFields:
    if not isinstance(body, dict):
        raise RequestError("body", "the request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        raise RequestError(_field_name(first["loc"]), first["msg"]) from None
    parsed.refuse_unsupported()
    return parsed


def decode_request(decoder: BatchedDecoder, parsed: GenerationFields) -> DecodeRequest:
    """The library's typed request from a parsed HTTP one (the prompt tokenized, every bound checked)."""
    if isinstance(parsed, ChatCompletionRequest):
        options = parsed.chat_template_kwargs or ChatTemplateOptions()
        prompt_ids = decoder.encode_chat([(m.role, m.text) for m in parsed.messages], options.enable_thinking)
    else:
        prompt_ids = decoder.encode_completion(parsed.text)
    return decoder.check(  # omitted sampling fields: the model's generation_config, else OpenAI's defaults
        prompt_ids,
        max_tokens=parsed.max_tokens if parsed.max_tokens is not None else parsed.max_completion_tokens,
        temperature=parsed.temperature,
        top_k=parsed.top_k,
        top_p=parsed.top_p,
        stop=parsed.stops,
        seed=parsed.seed,
        block_size=parsed.block_size,
        policy=parsed.policy,
        ignore_eos=parsed.ignore_eos,
    )
