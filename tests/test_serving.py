"""The decoder engine behind the endpoint (no Ray): request checks, stop strings, streaming, cancel, timeout."""

from __future__ import annotations

import threading

import pytest

from blockpilot.decoding import FixedBlockSize, GenerationConfig, generate
from blockpilot.serving import DecoderEngine, RequestError, ServeLimits, StreamedText

# (body, chat, field named in the error). Shared with the HTTP table in test_serve.py.
BAD_REQUESTS = [
    ({}, False, "prompt"),
    ({"prompt": 42}, False, "prompt"),
    ({"prompt": "   "}, False, "prompt"),
    ({"prompt": "word " * 1200}, False, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, False, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, False, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, False, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, False, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, False, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, False, "temperature"),
    ({"prompt": "hi", "block_size": 0}, False, "block_size"),
    ({"prompt": "hi", "block_size": 99}, False, "block_size"),
    ({"prompt": "hi", "block_size": 2.5}, False, "block_size"),
    ({"prompt": "hi", "policy": "fastest"}, False, "policy"),
    ({"prompt": "hi", "stop": [""]}, False, "stop"),
    ({"prompt": "hi", "seed": "x"}, False, "seed"),
    ({}, True, "messages"),
    ({"messages": []}, True, "messages"),
    ({"messages": [{"role": "user"}]}, True, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, True, "messages[0].role"),
    ({"messages": [{"role": "user", "content": " "}]}, True, "messages"),
]


@pytest.fixture(scope="module")
def engine(tiny_models):
    return DecoderEngine(tiny_models, limits=ServeLimits(max_tokens_cap=256))


@pytest.mark.parametrize("body, chat, field", BAD_REQUESTS)
def test_bad_requests_name_the_field(engine, body, chat, field):
    with pytest.raises(RequestError) as error:
        engine.check(body, chat=chat)
    assert error.value.field == field and error.value.status == 400


def test_nan_temperature_is_rejected(engine):
    with pytest.raises(RequestError, match="temperature"):
        engine.check({"prompt": "hi", "temperature": float("nan")}, chat=False)


def test_completion_equals_the_library(engine, tiny_models):
    request = engine.check({"prompt": "Count from 1 to 9.", "max_tokens": 40, "temperature": 0}, chat=False)
    text, stats = engine.complete(request)
    ids = tiny_models.encode_prompt("Count from 1 to 9.", chat=False)
    expected = generate(
        tiny_models,
        ids,
        policy=FixedBlockSize(tiny_models.train_block_size),
        config=GenerationConfig(max_new_tokens=40, stop_token_ids=tuple(tiny_models.stop_token_ids())),
    )
    assert text == tiny_models.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert stats["usage"]["completion_tokens"] == len(expected.token_ids)
    assert stats["blockpilot"]["block_size"] == 4 and stats["blockpilot"]["policy"] == "fixed"
    assert stats["finish_reason"] in ("stop", "length")


def test_forced_block_size_and_policies(engine):
    request = engine.check(
        {"prompt": "Count from 1 to 9.", "max_tokens": 12, "block_size": 7, "policy": "fixed"}, chat=False
    )
    assert engine.complete(request)[1]["blockpilot"]["block_size"] == 7
    adaptive = engine.check({"prompt": "hi", "max_tokens": 5}, chat=False)
    assert engine.policy_for(adaptive)[1] == "fixed"  # no predictor loaded: the training block size


def test_stop_strings_cut_the_text_even_across_chunks(tiny_models):
    tokenizer = tiny_models.tokenizer
    ids = tokenizer("alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    streamed = StreamedText(tokenizer, ["gam"])
    pieces = [streamed.push([token]) for token in ids]
    assert "".join(pieces) == "alpha beta " and streamed.stopped
    held = StreamedText(tokenizer, ["XYZ"])
    assert "".join(held.push([t]) for t in ids) + held.push([], final=True) == "alpha beta gamma delta"


def test_split_characters_wait_for_their_last_byte(tiny_models):
    tokenizer = tiny_models.tokenizer
    ids = tokenizer("naïve ✓", add_special_tokens=False)["input_ids"]
    streamed = StreamedText(tokenizer, [])
    pieces = [streamed.push([token]) for token in ids] + [streamed.push([], final=True)]
    assert "".join(pieces) == "naïve ✓"
    assert all("\ufffd" not in piece for piece in pieces)


def test_cancel_and_timeout_end_a_generation_early(tiny_models):
    engine = DecoderEngine(tiny_models, limits=ServeLimits(max_tokens_cap=512))
    request = engine.check(
        {"prompt": "Tell a story about file.", "max_tokens": 400, "block_size": 1, "temperature": 1.0, "seed": 1},
        chat=False,
    )
    cancel = threading.Event()
    cancel.set()
    final = [stats for _, stats in engine.stream(request, cancel) if stats][0]
    assert final["finish_reason"] in ("cancelled", "stop") and final["usage"]["completion_tokens"] <= 2
    hasty = DecoderEngine(tiny_models, limits=ServeLimits(max_tokens_cap=512, request_timeout_s=0.0))
    assert hasty.complete(request)[1]["finish_reason"] in ("timeout", "stop")
