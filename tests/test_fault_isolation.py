"""One row's fault ends that row alone: its policy raising or answering a bad value (for the whole batch at once,
then asked row by row), non-finite target logits (NaN in its cache slots; greedy or sampled). The faulty row reports
its error; the other rows of the batch decode what they decode alone; the engine goes on serving, and the next row
placed in the faulty row's cache slots decodes exactly. A model pass that raises (out of memory) fails the rows of
that step alone. The same through
the serving decoder: the faulty request gets its error, the others their text, and the decoder stays healthy."""

from __future__ import annotations

import pytest
import torch

from blockpilot.decoding import Engine, GenerationConfig, GenerationRequest, generate_many
from blockpilot.policies.base import BlockSizePolicy

PROMPTS = ("Count from 1 to 9.", "List four colors.", "Spell cat.")
FAULTY = 1  # the index of the faulty request among PROMPTS


class Poisoned(BlockSizePolicy):
    """b = 3, shared by every row, the request's own (asked before every cycle, lone or not); for the row whose
    prompt is `poison` it fails at its second cycle."""

    name = "poisoned"
    adapts = False

    def __init__(self, poison, fault: str) -> None:
        self.poison, self.fault = tuple(poison), fault

    def initial_block_size(self, prefill):
        return 3

    def next_block_sizes(self, cycles):
        poisoned = [cycle.cycle >= 1 and tuple(cycle.prefill.prompt_ids.tolist()) == self.poison for cycle in cycles]
        if self.fault == "raises" and any(poisoned):
            raise RuntimeError("the policy broke on this request")
        if self.fault == "answers 0":
            return [0 if bad else 3 for bad in poisoned]
        if self.fault == "answers for too few rows" and any(poisoned):
            return [3] * (len(cycles) - 1)
        return [3] * len(cycles)


def nan_in_cache_of(engine: Engine, row_id: int) -> None:
    """NaN into every cache slot of row `row_id`'s cache row (the target's keys and values): its next cycle's logits
    are not finite, and a row placed there later reads the NaN past its own length unless the slots are cleared."""
    index = next(i for i, row in enumerate(engine.rows) if row.id == row_id)
    for buffer in engine.decoder.target.body.buffers():
        buffer[index] = float("nan")


def run_batch(models, requests, inject=None, engine=None):
    """{row index: (tokens, stop reason, error)} of one engine over `requests` (`inject(engine, row id)` called after
    its first step), then one more request served on the freed rows: it decodes what it decodes alone."""
    engine = engine or Engine(models, max_batch=len(requests))
    ids = [engine.submit(request) for request in requests]
    tokens, ends = {i: [] for i in ids}, {}
    for step, updates in enumerate(iter(engine.step, None)):
        for update in updates:
            tokens[update.row_id] += update.new_tokens
            if update.result is not None:
                ends[update.row_id] = (update.result.stop_reason, update.error)
        if step == 0 and inject is not None:
            inject(engine, ids[FAULTY])
        if not engine.busy:
            break
    after = [engine.submit(request) for request in requests]  # the engine is still in a usable state
    finished = {u.row_id: u.result for u in engine.run() if u.result is not None}
    for index, (request, row_id) in enumerate(zip(requests, after, strict=True)):
        if index != FAULTY:  # the faulty row's policy fails it again
            alone = generate_many(models, [request], engine=Engine(models, tree_nodes=engine.tree_nodes))[0]
            assert finished[row_id].token_ids == alone.token_ids, "a request on the freed rows decoded differently"
    return {index: (tokens[i], *ends[i]) for index, i in enumerate(ids)}


@pytest.mark.parametrize(
    "fault, temperature",
    [
        ("raises", 0.0),
        ("answers 0", 0.0),
        ("answers for too few rows", 0.0),
        ("nan logits", 0.0),
        ("nan logits", 1.0),
    ],
)
def test_a_faulty_row_ends_alone_and_the_others_decode_as_alone(tiny_models, fault, temperature):
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS]
    # No stop tokens: every row runs its 24 tokens, so the faulty one reaches its fault.
    configs = [GenerationConfig(max_new_tokens=24, temperature=temperature, seed=i) for i in range(3)]
    inject = None
    if fault == "nan logits":
        policy = Poisoned((), "none")
        inject = nan_in_cache_of
    else:
        policy = Poisoned(prompts[FAULTY], fault)
    policies = [policy] * 3
    requests = [GenerationRequest(p, c, q) for p, c, q in zip(prompts, configs, policies, strict=True)]
    ends = run_batch(tiny_models, requests, inject)

    tokens, reason, error = ends[FAULTY]
    assert reason == "error" and error is not None, f"the faulty row ended as {reason!r}"
    for index in (0, 2):
        alone = generate_many(tiny_models, [requests[index]])[0]
        assert ends[index][1] in ("stop", "length") and ends[index][2] is None
        assert ends[index][0] == alone.token_ids, f"row {index} decoded differently beside the faulty row"


@pytest.mark.parametrize("fault", ["raises", "answers 0", "answers past its largest tree"])
def test_a_tree_policy_that_fails_one_request_ends_that_row_alone(tiny_models, fault):
    """A per-request tree budget is checked like a block size: for the whole batch at once, then row by row."""
    from blockpilot.decoding.engine import Engine
    from blockpilot.policies.fixed import FixedTree

    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS]
    poison = tuple(prompts[FAULTY])

    class PoisonedTree(FixedTree):
        def initial_tree_budgets(self, prefills):
            bad = [tuple(prefill.prompt_ids.tolist()) == poison for prefill in prefills]
            if fault == "raises" and any(bad):
                raise RuntimeError("the policy broke on this request")
            wrong = 0 if fault == "answers 0" else self.nodes + 1
            return [wrong if b else self.nodes for b in bad]

    policy = PoisonedTree(7, tiny_models.train_block_size)
    requests = [GenerationRequest(p, GenerationConfig(max_new_tokens=16), policy) for p in prompts]
    ends = run_batch(tiny_models, requests, engine=Engine(tiny_models, max_batch=3, tree_nodes=7))
    tokens, reason, error = ends[FAULTY]
    assert reason == "error" and error is not None and not tokens
    assert fault == "raises" or "tree budget" in str(error)
    for index in (0, 2):
        alone = generate_many(tiny_models, [requests[index]], engine=Engine(tiny_models, tree_nodes=7))[0]
        assert ends[index][1] in ("stop", "length") and ends[index][2] is None
        assert ends[index][0] == alone.token_ids, f"row {index} decoded differently beside the faulty row"


def test_the_library_call_raises_the_faulty_rows_error(tiny_models):
    prompt = tiny_models.encode_prompt(PROMPTS[0])
    request = GenerationRequest(prompt, GenerationConfig(max_new_tokens=16), Poisoned(prompt, "raises"))
    with pytest.raises(RuntimeError, match="the policy broke"):
        generate_many(tiny_models, [request])


def test_the_serving_decoder_gives_the_faulty_request_its_error_and_stays_healthy(tiny_models):
    from blockpilot.serving import BatchedDecoder, RowFailure, ServeLimits

    decoder = BatchedDecoder(tiny_models, limits=ServeLimits(max_batch=3)).start()
    try:
        checked = [
            decoder.check(decoder.encode_completion(text), max_tokens=16, temperature=0.0, ignore_eos=True)
            for text in PROMPTS
        ]
        decoder.adaptive = Poisoned(checked[FAULTY].prompt_ids, "raises")  # the server's policy for every request
        alone = {index: decoder.complete(checked[index])[0] for index in (0, 2)}
        handles = [decoder.submit(request) for request in checked]
        outcomes = [list(handle.events(timeout_s=60)) for handle in handles]
        kind, error = outcomes[FAULTY][-1]
        assert kind == "error" and isinstance(error, RowFailure) and "the policy broke" in str(error)
        for index in (0, 2):
            assert outcomes[index][-1][0] == "done"
            assert "".join(value for kind, value in outcomes[index] if kind == "delta") == alone[index]
        assert decoder.healthy and decoder.failure is None
    finally:
        decoder.stop()


def test_a_device_failure_fails_the_engine_not_one_row(tiny_models):
    """A CUDA device assert poisons the process: the engine raises it (the serving decoder then turns unhealthy and
    the replica is replaced) instead of ending one row and going on with a broken device."""
    prompt = tiny_models.encode_prompt(PROMPTS[0])

    class Broken(Poisoned):
        def next_block_sizes(self, cycles):
            raise RuntimeError("CUDA error: device-side assert triggered")

    engine = Engine(tiny_models, max_batch=2)
    engine.submit(GenerationRequest(prompt, GenerationConfig(max_new_tokens=16), Broken((), "none")))
    with pytest.raises(RuntimeError, match="device-side assert"):
        list(engine.run())


@pytest.mark.parametrize("where", ["cycle", "prefill"])
def test_a_model_pass_out_of_memory_fails_that_steps_rows_and_the_engine_serves_on(tiny_models, where, monkeypatch):
    """Three rows decode; one of their passes runs out of memory: those rows end with the error, the engine goes
    on, and the same requests afterwards decode exactly what they decode alone."""
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS]
    requests = [GenerationRequest(p, GenerationConfig(max_new_tokens=16), Poisoned((), "none")) for p in prompts]
    engine = Engine(tiny_models, max_batch=3)
    decoder = type(engine.decoder)
    original = getattr(decoder, where)
    calls = {"n": 0}

    def failing_once(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == (2 if where == "cycle" else 1):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(decoder, where, failing_once)
    ids = [engine.submit(request) for request in requests]
    ends = {u.row_id: u for u in engine.run() if u.result is not None}
    assert all(ends[i].result.stop_reason == "error" for i in ids)
    assert all(isinstance(ends[i].error, torch.OutOfMemoryError) for i in ids)
    monkeypatch.setattr(decoder, where, original)
    again = generate_many(tiny_models, requests, engine=engine)
    alone = [generate_many(tiny_models, [request])[0] for request in requests]
    assert [r.token_ids for r in again] == [r.token_ids for r in alone]
    assert not engine.busy


def test_tokens_banned_at_minus_infinity_are_not_a_fault(tiny_models, monkeypatch):
    """A logit of -inf bans a token (a legitimate distribution); only NaN, +inf or nothing finite fails a row."""
    import blockpilot.decoding.static as static

    forward = static.StaticTarget.forward

    def banning(self, *args, **kwargs):
        logits, features = forward(self, *args, **kwargs)
        logits = logits.clone()
        logits[..., : logits.shape[-1] // 2] = float("-inf")  # half the vocabulary banned
        return logits, features

    monkeypatch.setattr(static.StaticTarget, "forward", banning)
    prompt = tiny_models.encode_prompt(PROMPTS[0])
    request = GenerationRequest(prompt, GenerationConfig(max_new_tokens=16, temperature=1.0, seed=1), Poisoned((), "none"))
    (result,) = generate_many(tiny_models, [request])
    assert result.stop_reason in ("stop", "length") and result.token_ids
