"""The endpoint on Ray Serve over real HTTP on 127.0.0.1 (tiny zoo + a predictor trained here)."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support import greedy_reference
from test_serving import BAD_REQUESTS

from blockpilot.decoding import GenerationConfig, generate
from blockpilot.predictor import LearnedPolicy, load_predictor

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def predictor_dir(tiny_labels, tmp_path_factory):
    """A sparse predictor fitted in-process on the tiny zoo's labels."""
    from blockpilot.data.labels import read_labels
    from blockpilot.predictor import BlockSizePredictor, PredictorConfig
    from blockpilot.predictor_training import (
        PredictorTrainConfig,
        fit_epochs,
        label_arrays,
        local_batches,
        make_optimizer,
        valid_rows,
    )

    arrays = label_arrays(valid_rows(read_labels(tiny_labels["train"])))
    model = BlockSizePredictor(
        PredictorConfig(
            "sparse", arrays.candidates, 512, top_k=16, hidden_size=32, train_block_size=arrays.train_block_size
        )
    )
    config = PredictorTrainConfig(epochs=5, batch_size=32, objective="expected-tau")
    fit_epochs(model, make_optimizer(model, config), range(5), local_batches(arrays, 32, 0), config, lambda *_: None)
    return model.save(tmp_path_factory.mktemp("predictor") / "predictor")


@pytest.fixture(scope="module")
def endpoint(local_ray, tiny_zoo, predictor_dir):
    from ray import serve

    from pipelines.serve import ModelLoader, serve_locally

    loader = ModelLoader(str(tiny_zoo / "target"), str(tiny_zoo / "drafter"), str(predictor_dir), model_name="tiny")
    server = serve_locally(loader, port=free_port(), request_timeout_s=120)
    server.wait_healthy(120)
    yield server.url
    server.shutdown()
    serve.shutdown()


def post(url: str, path: str, body, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout)


def test_models_and_health(endpoint):
    assert httpx.get(endpoint + "/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(endpoint + "/v1/models").json()["data"]] == ["tiny"]


def test_greedy_completion_equals_the_library(endpoint, tiny_models, predictor_dir):
    prompt = "Count from 3 to 14."
    response = post(
        endpoint, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    )
    assert response.status_code == 200
    payload = response.json()
    policy = LearnedPolicy(load_predictor(predictor_dir))
    expected = generate(
        tiny_models,
        tiny_models.encode_prompt(prompt, chat=False),
        policy=policy,
        config=GenerationConfig(max_new_tokens=40, stop_token_ids=tuple(tiny_models.stop_token_ids())),
    )
    assert payload["choices"][0]["text"] == tiny_models.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert payload["usage"]["completion_tokens"] == len(expected.token_ids)
    stats = payload["blockpilot"]
    assert stats["policy"] == "adaptive" and stats["block_size"] == expected.block_size
    assert {"tau", "cycles", "prefill_time_s", "decode_time_s"} <= set(stats)


def test_streamed_chunks_reassemble_to_the_same_text(endpoint):
    body = {"prompt": "Count from 3 to 14.", "max_tokens": 48, "temperature": 0, "block_size": 3}
    whole = post(endpoint, "/v1/completions", body).json()["choices"][0]["text"]
    pieces, finish = [], None
    with httpx.stream("POST", endpoint + "/v1/completions", json=body | {"stream": True}, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            pieces.append(chunk["choices"][0]["text"])
            finish = chunk["choices"][0]["finish_reason"] or finish
    assert "".join(pieces) == whole and finish in ("stop", "length")
    assert len(pieces) > 2


def test_the_openai_client_works_unchanged(endpoint, tiny_models):
    from openai import OpenAI

    client = OpenAI(base_url=endpoint + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="Count from 1 to 5.", max_tokens=16, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 16
    messages = [{"role": "user", "content": "Count from 1 to 8."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, seed=3)
    # T = 0 is lossless whatever b the predictor picks: the answer is the target's greedy reply.
    greedy = greedy_reference(tiny_models.target, tiny_models.encode_prompt(messages), 24, tiny_models.stop_token_ids())
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tiny_models.tokenizer.decode(greedy, skip_special_tokens=True)
    assert chat.model_extra["blockpilot"]["policy"] == "adaptive"
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == chat.choices[0].message.content


def test_bounded_load_every_request_succeeds(endpoint):
    def one(i: int) -> int:
        body = {"prompt": f"Count from {i} to {i + 6}.", "max_tokens": 12, "temperature": 0.7, "seed": i}
        return post(endpoint, "/v1/completions", body, timeout=300).status_code

    with ThreadPoolExecutor(max_workers=32) as pool:
        statuses = list(pool.map(one, range(32)))
    assert statuses == [200] * 32


@pytest.mark.parametrize("body, chat, field", BAD_REQUESTS)
def test_bad_requests_get_4xx_naming_the_field(endpoint, body, chat, field):
    response = post(endpoint, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert response.status_code in (400, 422)
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert httpx.get(endpoint + "/health").status_code == 200


@pytest.mark.parametrize(
    "raw, field",
    [
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "stream": "yes"}', "stream"),
    ],
)
def test_malformed_bodies(endpoint, raw, field):
    response = post(endpoint, "/v1/completions", raw)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    assert httpx.get(endpoint + "/health").status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_the_replica(endpoint):
    """A long generation whose client leaves is cancelled: the next request is served at once, not after it."""
    long_body = {
        "prompt": "Tell a story about file.",
        "max_tokens": 500,
        "temperature": 1.0,
        "seed": 5,
        "block_size": 1,
        "stream": True,
    }
    started = time.monotonic()
    full = post(endpoint, "/v1/completions", long_body | {"stream": False})
    full_seconds = time.monotonic() - started
    tokens = full.json()["usage"]["completion_tokens"]
    assert tokens > 100, "the long request must really be long for this test to mean anything"

    with httpx.stream("POST", endpoint + "/v1/completions", json=long_body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk received, then the client goes away
    started = time.monotonic()
    quick = post(endpoint, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0})
    waited = time.monotonic() - started
    assert quick.status_code == 200
    assert waited < 0.5 * full_seconds, f"waited {waited:.2f}s; the abandoned generation takes {full_seconds:.2f}s"
