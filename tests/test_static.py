"""The static cycle (`blockpilot.decoding.static`) and the engine on it (`static_engine.py`): preallocated caches,
fixed shapes, compiled or eager. At T = 0 it decodes the target's greedy output for any policy and batch mix, rows
joining and leaving; per-step policies choose what they choose on the eager engine; compiled, it decodes what eager
does (`test_commands_offline.py` runs the command compiled). Sampling at T > 0: `test_sampling_exactness.py`."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from support import context_writes, greedy_reference
from test_step_policy import growing_step_model, random_step_model, vocab_of

from blockpilot.decoding import GenerationConfig, GenerationRequest, forwards, generate_many
from blockpilot.decoding.compiled import COMPILE_MODES, compiled_replay, inductor_calls, inductor_options
from blockpilot.decoding.engine import Engine, engine_for, power_buckets, tree_buckets
from blockpilot.decoding.forwards import StaticTarget
from blockpilot.decoding.static import CONFIDENCE_UNITS, StaticDecoder, span_bucket
from blockpilot.policies.base import BlockSizePolicy
from blockpilot.policies.fixed import Autoregressive, FixedBlockSize
from blockpilot.policies.step import StepPolicy

PROMPTS = ["Count from 3 to 14.", "Sort these numbers: 5 3 9 1", "def add(a, b):", "Reverse: a b c d e", "Hi", "x y"]


def references(models, max_new_tokens: int, texts=PROMPTS) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [models.encode_prompt(text) for text in texts]
    stop = models.stop_token_ids()
    return prompts, [greedy_reference(models.target, p, max_new_tokens, stop) for p in prompts]


def decode(models, engine, prompts, policies, max_new_tokens, **config):
    settings = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=tuple(models.stop_token_ids()), **config)
    requests = [GenerationRequest(p, settings, q) for p, q in zip(prompts, policies, strict=True)]
    return generate_many(models, requests, engine=engine)


@pytest.mark.parametrize("max_batch", [1, 3, 6])
def test_greedy_static_decoding_is_the_targets_greedy_output_rows_joining_and_leaving(tiny_models, max_batch):
    """Six requests of mixed b (1 to the width, and one past it, capped) and budgets (so that rows end at different
    cycles whatever the weights) through 1, 3 or 6 rows: the last row moves into each hole, waiting rows join mid-run."""
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS]
    budgets = [40, 12, 33, 7, 25, 18]
    stop = tuple(tiny_models.stop_token_ids())
    expected = [greedy_reference(tiny_models.target, p, m, stop) for p, m in zip(prompts, budgets)]
    engine = Engine(tiny_models, max_batch=max_batch)
    policies = [FixedBlockSize(b) for b in (1, 3, engine.width, 2, engine.width + 4, 5)]
    requests = [
        GenerationRequest(p, GenerationConfig(max_new_tokens=m, stop_token_ids=stop), q)
        for p, m, q in zip(prompts, budgets, policies, strict=True)
    ]
    results = generate_many(tiny_models, requests, engine=engine)
    assert [r.token_ids for r in results] == expected
    assert max(b for r in results for b in r.block_sizes) <= engine.width
    assert not engine.busy and not engine.decoder.active.any(), "every cache row is free again"


def test_a_cycle_runs_at_the_width_bucket_of_its_widest_block(tiny_models):
    """Rows at b = 2 and 3 in an engine of width 8 cycle at width 4 (the bucket of 3), not 8. No stop tokens: every
    row runs its 24 tokens, whatever the weights."""
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[:3]]
    expected = [greedy_reference(tiny_models.target, p, 24) for p in prompts]
    engine = Engine(tiny_models, max_batch=2, width=8)
    assert engine.widths == [1, 2, 4, 8]
    widths, cycle = [], engine.decoder.cycle
    engine.decoder.cycle = lambda n, span, width, *rule: widths.append(width) or cycle(n, span, width, *rule)
    policies = [FixedBlockSize(2), FixedBlockSize(3), Autoregressive()]
    requests = [GenerationRequest(p, GenerationConfig(max_new_tokens=24), q) for p, q in zip(prompts, policies)]
    results = generate_many(tiny_models, requests, engine=engine)
    assert [r.token_ids for r in results] == expected
    assert set(widths) <= {1, 2, 4} and 4 in widths  # 2 or 1 once the wider rows have left


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_unequal_blocks_run_packed_and_decode_what_padded_rows_do(tiny_models, temperature):
    """Rows at b = 1, 2, 5 and 8 in one engine of width 8: cycles that mix them compute their b summed, rounded up to
    a power of two (`_packed_cycle`: 16 entries, not 4 rows x 8), and every row commits what it commits padded, a row
    that verifies by `rejection` and one that cuts its distributions (top-k) included; at T = 0 the target's greedy
    output. No stop tokens: every row runs its budget, whatever the weights."""
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[:4]]
    configs = [
        GenerationConfig(max_new_tokens=20, temperature=temperature, seed=7 + i, verify=rule, top_k=5 * (i == 3))
        for i, rule in enumerate(["match", "rejection", "match", "match"])
    ]
    policies = [FixedBlockSize(b) for b in (1, 2, 5, 8)]
    outputs, packed = {}, []
    for pack in (True, False):
        engine = Engine(tiny_models, max_batch=4, width=8, batch_pricing=False, pack_rows=pack)
        run = engine.decoder.steps.run

        def counted(name, *shape, run=run):
            if name == "_packed_cycle":
                packed.append(shape)
            run(name, *shape)

        engine.decoder.steps.run = counted
        requests = [GenerationRequest(p, c, q) for p, c, q in zip(prompts, configs, policies, strict=True)]
        outputs[pack] = [r.token_ids for r in generate_many(tiny_models, requests, engine=engine)]
    assert outputs[True] == outputs[False]
    if temperature == 0:
        assert outputs[True] == [greedy_reference(tiny_models.target, p, 20) for p in prompts]
    assert packed and (4, 256, 8, 16, temperature > 0, temperature > 0) in packed


def cycled(decoder: StaticDecoder, n: int, span: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cycle of rows 0 .. n - 1 and its outputs, which the one integer tensor the engine copies to the host
    (`report`) holds too: tokens, count, finite and the anchor's top-1 probability in `CONFIDENCE_UNITS`."""
    decoder.cycle(n, span, width)
    tokens, counts, finite = decoder.outputs(n, width)
    report = decoder.report[:n]
    assert torch.equal(report[:, :width], tokens) and torch.equal(report[:, -4], counts)
    assert torch.equal(report[:, -3], finite.long()) and not report[:, -1].any()  # no decision set: none chosen
    assert torch.equal(report[:, -2], (decoder.anchor_confidence[:n] * CONFIDENCE_UNITS).round().long())
    return tokens, counts, finite


@pytest.mark.slow
def test_a_compiled_packed_cycle_commits_what_the_eager_padded_one_does(tiny_models):
    """Cycle by cycle: four rows at b = 1, 2, 5 and 8 (width 8) commit the same tokens packed into 16 entries,
    compiled, as padded into 32, eager (the same state after every cycle, then; one step compiled)."""
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[:4]]
    decoders = [StaticDecoder(tiny_models, rows=4, width=8, capacity=256, compile=mode) for mode in ("compile", "off")]
    for decoder, pack in zip(decoders, (True, False), strict=True):
        decoder.pack_rows = pack
        for row, prompt in enumerate(prompts):
            decoder.prefill(row, [torch.tensor(prompt[:-1])])
            decoder.place(row, length=len(prompt) - 1, last_token=prompt[-1], temperature=0.0, seed=row)
        decoder.set_block_sizes([1, 2, 5, 8])
    packed, padded = decoders
    drafted = 0
    for _ in range(6):
        outputs = [[t.clone() for t in cycled(decoder, 4, 256, 8)] for decoder in decoders]
        assert packed.packed == 16 and padded.packed == 0
        (tokens, counts, _), (expected_tokens, expected_counts, _) = outputs
        assert torch.equal(counts, expected_counts)
        for row, count in enumerate(counts.tolist()):
            assert torch.equal(tokens[row, :count], expected_tokens[row, :count])
        drafted += int((counts > 1).sum())
    assert drafted, "no draft accepted: the test would not tell a wrong draft from a right one"
    # Frozen (a replica after its declared shapes, `serve --compile-packed`), blocks that fit fewer entries run on
    # the step built for 16, compiling nothing.
    built = set(packed.steps.built)
    packed.frozen = True
    for decoder in decoders:
        decoder.set_block_sizes([1, 1, 2, 3])
    for _ in range(3):
        outputs = [[t.clone() for t in cycled(decoder, 4, 256, 8)] for decoder in decoders]
        assert packed.packed == 8 and set(packed.steps.built) == built
        (tokens, counts, _), (expected_tokens, expected_counts, _) = outputs
        assert torch.equal(counts, expected_counts)
        for row, count in enumerate(counts.tolist()):
            assert torch.equal(tokens[row, :count], expected_tokens[row, :count])


def test_autoregressive_and_a_target_without_drafter(tiny_models):
    prompts, expected = references(tiny_models, 24, PROMPTS[:3])
    engine = Engine(tiny_models, max_batch=2)
    assert [r.token_ids for r in decode(tiny_models, engine, prompts, [Autoregressive()] * 3, 24)] == expected
    alone = Engine(replace(tiny_models, drafter=None), max_batch=2)
    assert alone.width == 1
    assert [r.token_ids for r in decode(tiny_models, alone, prompts, [None] * 3, 24)] == expected


class Alternating(FixedBlockSize):
    """Autoregression and drafting b in turn, cycle by cycle."""

    def next_block_size(self, cycle):
        return 1 if cycle.block_size > 1 else self.block_size


class DraftsLate(FixedBlockSize):
    """Autoregressive for 20 cycles (more than a row keeps unencoded, `PENDING_CONTEXT`), then drafting b."""

    def initial_block_size(self, prefill):
        return 1

    def next_block_size(self, cycle):
        return 1 if cycle.cycle < 19 else self.block_size


def test_a_row_switching_between_autoregression_and_drafting_drafts_as_if_it_had_drafted_all_along(tiny_models):
    """Autoregressive cycles keep the target's features of the positions they commit and write them into the
    drafter's context before the row drafts again (or when more wait than the decoder keeps), so a row that drafts
    again accepts exactly what the acceptance table, built from every position's features, says a block there
    accepts: each drafting cycle's tau is a(cursor, b). Beside a row that always drafts (its cycles then run at width
    4) and alone (width 1: no drafter pass), greedy."""
    from blockpilot.blocks import PENDING_CONTEXT, flush_passes
    from blockpilot.table import acceptance_table

    assert PENDING_CONTEXT < 20
    prompts, expected = references(tiny_models, 40, PROMPTS)
    longest = sorted(range(len(prompts)), key=lambda i: -len(expected[i]))[:4]  # rows that run past 20 cycles
    prompts, expected = [prompts[i] for i in longest], [expected[i] for i in longest]
    assert len(expected[0]) > 24
    policies = [DraftsLate(4), Alternating(4), Alternating(4), FixedBlockSize(4)]
    *switching, beside = decode(tiny_models, Engine(tiny_models, max_batch=4), prompts, policies, 40)
    lone = Engine(tiny_models, max_batch=1)
    flushes, flush = [], lone.decoder.flush_context
    lone.decoder.flush_context = lambda n: (flushes.append(n), flush(n))
    alone = decode(tiny_models, lone, prompts[:3], policies[:3], 40)
    # the walks' rule (`flush_passes`), run; a last cycle cut to one token still runs at its chosen width, and may flush
    assert 0 <= len(flushes) - sum(flush_passes(r.block_sizes) for r in alone) <= len(alone)
    assert [r.token_ids for r in [*switching, beside]] == expected and [r.token_ids for r in alone] == expected[:3]
    assert any(1 in r.block_sizes and 4 in r.block_sizes for r in switching)
    assert switching[0].block_sizes[:20] == [1] * 20 and 4 in switching[0].block_sizes
    config = GenerationConfig(max_new_tokens=40, stop_token_ids=tuple(tiny_models.stop_token_ids()))
    requests = [GenerationRequest(p, config, FixedBlockSize(4), record=True) for p in prompts]
    recorded = generate_many(tiny_models, requests)
    for row, prompt, tokens, record in zip([*switching, *alone], prompts[:3] * 2, expected[:3] * 2, recorded[:3] * 2):
        table = acceptance_table(tiny_models, len(prompt), tokens, record.record.context_features, (1, 4), 40)
        cursor = 1
        for b, tau in zip(row.block_sizes, row.acceptance_lengths, strict=True):
            drafting = b > 1  # the last block is cut to the budget, as the table's is
            assert tau == table.commits[int(drafting), cursor - 1], (cursor, b)
            cursor += tau
    drafted = [tau for row in alone for b, tau in zip(row.block_sizes, row.acceptance_lengths) if b > 1]
    assert any(tau > 1 for tau in drafted), "no draft accepted: the test would not tell kept features from lost ones"


class LateDrafter(Alternating):
    """Autoregressive first, then drafting and autoregression in turn."""

    def initial_block_size(self, prefill):
        return 1


def test_a_row_autoregressive_for_good_spends_nothing_on_the_drafter(tiny_models):
    """A row whose policy keeps its first b, here autoregression, never drafts: neither its prefill nor its cycles
    write the drafter's context. A row that starts autoregressive under a policy that may draft later keeps it from
    its prompt on. Both greedy."""
    prompts, expected = references(tiny_models, 12, PROMPTS[:2])
    engine = Engine(tiny_models, max_batch=1)
    encoded = context_writes(engine)
    assert not LateDrafter(4).keeps_block_size and Autoregressive().keeps_block_size
    (alone,) = decode(tiny_models, engine, prompts[:1], [Autoregressive()], 12)
    assert alone.token_ids == expected[0] and alone.block_sizes and encoded == []
    (late,) = decode(tiny_models, engine, prompts[1:], [LateDrafter(4)], 12)
    assert late.token_ids == expected[1] and late.block_sizes[0] == 1
    assert encoded[0] == len(prompts[1]) and len(encoded) > 1


def test_per_step_policies_choose_on_the_static_engine_what_they_choose_on_the_eager_one(tiny_models):
    """The engine asks a policy with the same states (prefill, cycle, anchor logits) as the eager engine does: at
    T = 0 every choice, and so every cycle's block size and acceptance, is the same. No stop tokens: every row runs
    its 32 tokens, so the growing model changes b whatever the weights."""
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[:4]]
    expected = [greedy_reference(tiny_models.target, p, 32) for p in prompts]
    vocab = vocab_of(tiny_models)
    policies = [
        StepPolicy(growing_step_model(vocab)),
        FixedBlockSize(3),
        StepPolicy(random_step_model(3, vocab=vocab)),
        StepPolicy(random_step_model(4, vocab=vocab)),
    ]
    requests = [GenerationRequest(p, GenerationConfig(max_new_tokens=32), q) for p, q in zip(prompts, policies)]
    # Every cycle the policies' b: a batch's own width follows the prices it measures, which vary run to run.
    static = generate_many(tiny_models, requests, engine=Engine(tiny_models, max_batch=4, batch_pricing=False))
    shaped = engine_for(tiny_models, requests)
    shaped.batch_pricing = False
    eager = generate_many(tiny_models, requests, engine=shaped)
    assert [r.token_ids for r in static] == [r.token_ids for r in eager] == expected
    assert [r.block_sizes for r in static] == [r.block_sizes for r in eager]
    assert [r.acceptance_lengths for r in static] == [r.acceptance_lengths for r in eager]
    assert len(set(static[0].block_sizes)) > 1, "a policy that never changes b would not test the per-step hook"


def test_long_prompts_are_prefilled_a_chunk_a_step_beside_running_rows(tiny_models):
    texts = ["Hi", "Count from 1 to 30: " + " ".join(map(str, range(1, 31))), "x y"]
    prompts, expected = references(tiny_models, 24, texts)
    assert len(prompts[1]) > 3 * 16
    engine = Engine(tiny_models, max_batch=2, prefill_chunk=16)
    requests = [
        GenerationRequest(p, GenerationConfig(max_new_tokens=24, stop_token_ids=tuple(tiny_models.stop_token_ids())))
        for p in prompts
    ]
    ids = [engine.submit(r) for r in requests]
    first = engine.step()
    assert engine.prefilling is not None and {u.row_id for u in first} == {ids[0]}, "the short row decodes meanwhile"
    out = {i: [] for i in ids}
    for update in [*first, *engine.run()]:
        out[update.row_id] += update.new_tokens
    assert [out[i] for i in ids] == expected


class Raises(BlockSizePolicy):
    name = "raises"

    def initial_block_size(self, prefill):
        return 3

    def next_block_size(self, cycle):
        if cycle.cycle >= 1:
            raise RuntimeError("the policy broke on this request")
        return 3


def test_a_faulty_row_ends_alone_a_cancelled_one_too_and_the_engine_goes_on(tiny_models):
    """No stop tokens: every row runs its 24 tokens, so the faulty one reaches its fault and the cancelled one its
    cancellation."""
    prompts = [tiny_models.encode_prompt(text) for text in PROMPTS[:3]]
    expected = [greedy_reference(tiny_models.target, p, 24) for p in prompts]
    engine = Engine(tiny_models, max_batch=3)
    config = GenerationConfig(max_new_tokens=24)
    ids = [engine.submit(GenerationRequest(p, config, q)) for p, q in zip(prompts, [FixedBlockSize(3), Raises(), None])]
    ends, tokens = {}, {i: [] for i in ids}
    first = engine.step()
    engine.cancel(ids[2])
    for update in [*first, *engine.run()]:
        tokens[update.row_id] += update.new_tokens
        if update.result is not None:
            ends[update.row_id] = (update.result.stop_reason, update.error)
    assert ends[ids[1]][0] == "error" and "broke" in str(ends[ids[1]][1])
    assert ends[ids[2]][0] == "cancelled"
    assert ends[ids[0]] == ("length", None) and tokens[ids[0]] == expected[0]
    again = generate_many(tiny_models, [GenerationRequest(prompts[0], config)], engine=engine)
    assert again[0].token_ids == expected[0]


def test_what_the_static_engine_cannot_decode_is_refused_naming_it(random_models):
    engine = Engine(random_models, max_batch=1, capacity=64, sampling=False)
    cases = [
        (GenerationConfig(max_new_tokens=60), False, "need [0-9]+ cache slots"),
        (GenerationConfig(max_new_tokens=4, temperature=1.0), False, "sampling=True"),
        (GenerationConfig(max_new_tokens=4), True, "record=True"),
    ]
    for config, record, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.submit(GenerationRequest([1, 2, 3], config, None, record))
    trees = Engine(random_models, max_batch=1, capacity=64, tree_nodes=4)
    with pytest.raises(ValueError, match="needs chains"):
        trees.submit(
            GenerationRequest([1, 2, 3], GenerationConfig(max_new_tokens=4, temperature=1.0, verify="rejection"))
        )
    with pytest.raises(ValueError, match="compile must be one of"):
        StaticDecoder(random_models, rows=1, width=2, capacity=32, compile="fast")
    assert "graph" in COMPILE_MODES
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            StaticDecoder(random_models, rows=1, width=2, capacity=32, compile="graph")
    with pytest.raises(ValueError, match="block sizes in"):
        StaticDecoder(random_models, rows=2, width=4, capacity=32).set_block_sizes([5, 1])


def test_buckets_bound_the_compiled_variants():
    assert power_buckets(1) == [1] and power_buckets(6) == [1, 2, 4, 6] and power_buckets(8) == [1, 2, 4, 8]
    assert power_buckets(64, smallest=4) == [4, 8, 16, 32, 64] and power_buckets(3, smallest=4) == [3]
    assert tree_buckets(64) == [3, 7, 15, 31, 63, 64] and tree_buckets(7) == [3, 7] and tree_buckets(2) == [2]
    assert span_bucket(10, 2048) == 256 and span_bucket(257, 2048) == 512 and span_bucket(3000, 2048) == 2048


class Accumulator:
    """A step in the decoder's manner: it reads and writes, in place, only tensors that outlive its calls."""

    def __init__(self) -> None:
        self.state, self.weight = torch.zeros(4), torch.arange(4.0)

    def step(self, scale: int) -> None:
        self.state.mul_(scale).add_(self.weight.sin())

    def step_returning(self, scale: int) -> torch.Tensor:
        return self.state * scale


@pytest.mark.slow
def test_a_compiled_prefill_serves_prompts_at_any_cache_row_as_the_eager_pass_does(tiny_models, monkeypatch, caplog):
    """`compile_prefill` (a replica's start) compiles the whole-prompt prefill and context passes of one prompt.
    Frozen, prompts of other lengths at other cache rows run them compiled, never falling back to the eager passes (a
    fallback is logged), and write what the eager passes write; several prompts, or one of a single token, go to the
    eager passes at once. (Prompts joining at another row once fell back, dynamo having specialized a slice's bounds,
    and, where few-row projections fuse, prompts past their 4 rows, `linear` having guarded the prompt's length.)"""
    monkeypatch.setattr(forwards, "few_rows", forwards.FEW_ROWS)  # as measured on a CPU whose few-row GEMM is slow
    compiled = StaticDecoder(tiny_models, rows=4, width=4, capacity=64, compile="compile")
    eager = StaticDecoder(tiny_models, rows=4, width=4, capacity=64, compile="off")
    compiled.compile_prefill()
    compiled.steps.frozen = True
    with caplog.at_level("WARNING", logger="blockpilot.decoding.steps"):
        for first, lengths in [(3, [9]), (1, [4]), (0, [6]), (2, [1]), (0, [5, 3])]:
            prompts = [torch.arange(1, n + 1) for n in lengths]
            logits, features = compiled.prefill(first, prompts, context=False)
            compiled.keep_context(first, features)
            expected_logits, expected_features = eager.prefill(first, prompts, context=False)
            eager.keep_context(first, expected_features)
            torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(features, expected_features, atol=1e-4, rtol=1e-4)
            rows = slice(first, first + len(prompts))
            for model in ("target", "drafter"):
                for name in ("keys_0", "values_0"):
                    written = getattr(getattr(compiled, model).body, name)[rows, : max(lengths)]
                    expected = getattr(getattr(eager, model).body, name)[rows, : max(lengths)]
                    assert written.abs().sum() > 0
                    torch.testing.assert_close(written, expected, atol=1e-4, rtol=1e-4)
    assert "would compile again" not in caplog.text


def test_a_compiled_step_replays_without_dynamo_what_dynamo_computes():
    options = dict(fullgraph=True, dynamic=False, options=inductor_options(torch.device("cpu")))
    replayed, reference = Accumulator(), Accumulator()
    compiled = torch.compile(replayed.step, **options)
    with inductor_calls() as calls:
        compiled(3)
    replay = compiled_replay(calls)
    assert replay is not None
    # The C++ wrapper's code, without a check of each input's sizes at every call (what `inductor_options` turns off)
    code = calls[0][0].source_code
    assert "inductor_entry_impl" in code and "assert_size_stride" not in code
    torch._dynamo.reset()  # dynamo keeps nothing compiled now, and may not compile again: the replay needs neither
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(3):
            replay()
        with pytest.raises(RuntimeError):
            compiled(3)
    for _ in range(4):
        reference.step(3)
    assert torch.allclose(replayed.state, reference.state) and replayed.state.abs().sum() > 0
    # A step that returns a tensor is not replayed: its output would be lost (the engine keeps dynamo's path).
    with inductor_calls() as calls:
        torch.compile(replayed.step_returning, fullgraph=True)(2)
    assert len(calls) == 1 and compiled_replay(calls) is None


def test_a_compiled_kernels_serial_parts_run_on_one_thread_with_one_barrier_before_the_next_shared_loop():
    """As the engine compiles on a CPU (`inductor_options`, `serial_parts_on_one_thread`), on two threads: a loop the
    threads share, serial parts on the first thread (`omp master`, no barrier each, where `omp single` had one), one
    barrier before the next shared loop, which reads what they wrote; the values eager computes."""

    def step(x, w, out, big, y):
        scores = (x[None, :] * w).sum(dim=1)  # (64,) a reduction per row: shared
        best = scores.amax()  # the serial parts: one value each
        total = torch.exp(scores - best).sum()
        out.copy_(torch.exp(scores - best) / total)
        y.copy_(big * total)  # shared again, reading a serial part's value

    x, w, big = torch.randn(4096), torch.randn(64, 4096), torch.randn(1 << 18)
    out, y, expected_out, expected_y = torch.zeros(64), torch.zeros(1 << 18), torch.zeros(64), torch.zeros(1 << 18)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one thread (a test worker's share of the cores) writes no OpenMP region at all
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):  # generated here, not a cached kernel's code
            compiled = torch.compile(step, fullgraph=True, dynamic=False, options=inductor_options(torch.device("cpu")))
            with inductor_calls() as calls:
                compiled(x, w, out, big, y)
    finally:
        torch.set_num_threads(threads)
    code = calls[0][0].source_code
    assert "omp single" not in code and code.count("omp master") >= 2 and code.count("omp barrier") == 1
    step(x, w, expected_out, big, expected_y)
    assert torch.allclose(out, expected_out, atol=1e-6) and torch.allclose(y, expected_y)


def test_few_row_projections_fuse_in_compiled_steps_and_compute_what_f_linear_does(monkeypatch):
    """`forwards.linear` where this CPU's MKL is slow at few rows (forced here, whatever it measures): inside a
    compiled step, up to FEW_ROWS rows (and a bias) as the fused reduction, equal to F.linear up to float
    reassociation; more rows, and every eager call, F.linear itself."""
    monkeypatch.setattr(forwards, "few_rows", forwards.FEW_ROWS)
    weight, bias = torch.randn(24, 16), torch.randn(24)
    fused = torch.compile(forwards.linear, fullgraph=True, dynamic=False, options=inductor_options(torch.device("cpu")))
    for shape, matmul in (((2, 2, 16), False), ((1, 5, 16), True)):  # a matmul only past FEW_ROWS rows
        x = torch.randn(shape)
        expected = torch.nn.functional.linear(x, weight, bias)
        with inductor_calls() as calls:
            assert torch.allclose(fused(x, weight, bias), expected, rtol=1e-5, atol=1e-5), shape
        assert ("mm_out" in calls[0][0].source_code) is matmul, shape
        assert torch.equal(forwards.linear(x, weight, bias), expected)  # eager: F.linear, bit for bit
    # What the measurement decides: on this CPU either; on a weight it times, an answer of FEW_ROWS or 0, kept.
    monkeypatch.setattr(forwards, "few_rows", None)
    assert forwards.measure_few_rows(torch.randn(64, 32)) in (0, forwards.FEW_ROWS)
    assert forwards.few_rows in (0, forwards.FEW_ROWS)


def test_the_static_target_computes_the_targets_logits(tiny_models):
    """Over the cache (a mask) and from slot 0 alone (a whole prompt, no mask), with its projections stacked into one
    matmul each: the model's parameters become views of the stacks (no second copy), which a second decoder reuses."""
    prompt = torch.tensor([tiny_models.encode_prompt(PROMPTS[0])])
    target = StaticTarget(tiny_models.target, rows=1, capacity=64, layer_ids=None)
    positions = torch.arange(prompt.shape[1])[None]
    mask = (torch.arange(64)[None, None, :] <= positions[:, :, None])[:, None]
    with torch.inference_mode():
        logits, _ = target(prompt, positions, positions, mask)
        whole_prompt, _ = target(prompt, positions, positions, None)
        expected = tiny_models.target(prompt).logits.float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(whole_prompt, expected, atol=1e-4, rtol=1e-4)
    attention = tiny_models.target.model.layers[0].self_attn
    stack = target.body.attention[0].qkv
    assert attention.q_proj.weight.data_ptr() == stack.data_ptr()
    assert attention.k_proj.weight.data_ptr() == stack[attention.q_proj.weight.shape[0] :].data_ptr()
    again = StaticTarget(tiny_models.target, rows=1, capacity=64, layer_ids=None)
    reused = again.body.attention[0].qkv
    assert reused.data_ptr() == stack.data_ptr() and torch.equal(reused, stack)


def test_a_recording_static_engine_keeps_what_the_tables_need(tiny_models):
    """Labeling's reference generations on the compiled cycle: a recorded row keeps its positions' target features
    and each token's distribution as the eager engine does (to float rounding), the rows beside it and a long prompt
    prefilled in chunks included, and at T = 0 the acceptance tables built from either record are the same."""
    from blockpilot.table import acceptance_table

    stop = tuple(tiny_models.stop_token_ids())
    prompts = [
        tiny_models.encode_prompt(text) for text in ("Count from 3 to 14.", "def add(a, b):", "List four colors.")
    ]
    config = GenerationConfig(max_new_tokens=24, stop_token_ids=stop)
    B = tiny_models.train_block_size
    requests = [GenerationRequest(p, config, FixedBlockSize(b), record=True) for p, b in zip(prompts, (B, 2, B + 1))]
    eager = generate_many(tiny_models, requests)
    static = generate_many(tiny_models, requests, engine=Engine(tiny_models, max_batch=2, record=True, prefill_chunk=8))
    for mine, theirs, prompt in zip(static, eager, prompts, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert mine.record.context_features.shape == (
            len(prompt) + len(mine.token_ids) - 1,
            theirs.record.context_features.shape[1],
        )
        torch.testing.assert_close(mine.record.context_features, theirs.record.context_features, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.record.entropy, theirs.record.entropy, atol=1e-4, rtol=1e-4)
        assert torch.equal(mine.record.top_ids[:, 0], theirs.record.top_ids[:, 0])
        tables = [
            acceptance_table(tiny_models, len(prompt), r.token_ids, r.record.context_features, (2, B, B + 1), 24)
            for r in (mine, theirs)
        ]
        assert (tables[0].commits == tables[1].commits).all()


def test_the_declared_shape_set_is_few_steps_that_hold_every_batch(random_models):
    """A replica builds this set up front: the smallest and largest row bucket x the width bucket of the policy's
    widest block size x the first spans; frozen, a cycle runs on the smallest built step that holds it, which decodes
    the same tokens as the eager cycle."""
    from blockpilot.policies.fixed import EntropyHeuristic

    engine = Engine(random_models, max_batch=4, capacity=1024, compile="compile")
    assert engine.buckets == [1, 2, 4] and engine.spans == [256, 512, 1024]
    assert engine.declared_shapes(FixedBlockSize(3).block_size_choices, spans=1) == [
        ("_cycle", rows, 256, 4, False, False) for rows in (1, 4)
    ]
    # A policy that may choose autoregression gets its width-1 steps too: its rows then skip the drafter's pass, and
    # where the policy keeps a row's first b, the drafter's context (such a row never drafts again), except in a batch
    # of several rows, which may run autoregressive where drafting does not pay for it (`batch_pricing`).
    wide = [("_cycle", rows, 256, 4, False, False) for rows in (1, 4)]
    keeping = [("_plain_cycle", 1, 256, False), ("_plain_cycle", 4, 256, False), ("_deferred_cycle", 4, 256, False)]
    assert engine.declared_shapes((1, 2, 3), spans=1) == [*keeping, *wide, ("_flush_context", 4)]
    # A policy whose rows may switch: the step that keeps the context for later at every row bucket, and those that
    # write it; its rows autoregressive for good (`autoregressive_for_good`) run the plain step.
    narrow = [(kind, rows, 256, False) for rows in (1, 4) for kind in ("_plain_cycle", "_deferred_cycle")]
    switching = [*narrow, *wide, ("_flush_context", 1), ("_flush_context", 4)]
    assert engine.declared_shapes((1, 2, 3), spans=1, keeps_block_size=False) == switching
    # Rows that sample cut distributions (a served model's top-k or top-p defaults): every cycle's variant too.
    truncating = [*[(*shape[:-1], True) for shape in narrow], *[(*shape[:-1], True) for shape in wide]]
    assert engine.declared_shapes((1, 2, 3), spans=1, keeps_block_size=False, truncate=True) == switching + truncating
    # Packed (`serve --compile-packed`): each bucket of several rows also packed into the largest token bucket below
    # its rows x width, which holds every packed batch of as many rows or fewer whose blocks fit it.
    packed = ("_packed_cycle", 4, 256, 4, 8, False, False)
    assert engine.declared_shapes(FixedBlockSize(3).block_size_choices, spans=1, packed=True) == [*wide, packed]
    engine.decoder.steps.built[packed] = lambda: None  # as if built
    engine.decoder.frozen = True
    assert engine.decoder.steps.holding("_packed_cycle", (2, 256, 4, 5, False, False)) == packed  # 5 + 2 free rows
    assert engine.decoder.steps.holding("_packed_cycle", (4, 256, 4, 16, False, False)) is None
    engine.decoder.steps.built.clear()
    engine.decoder.frozen = False
    # Where the cycle computes a per-step policy's choice, the smallest bucket's chain cycles also without it (a lone
    # row that keeps its b); frozen, a row that keeps its b runs that step where built, else the one that chooses.
    deciding = Engine(random_models, max_batch=4, capacity=1024, compile="compile")
    deciding.decoder.set_decision(lambda *inputs: inputs[5], 0)
    kept = ("_kept_cycle", 1, 256, 4, False, False)
    assert deciding.declared_shapes(FixedBlockSize(3).block_size_choices, spans=1) == [*wide, kept]
    ran = []
    deciding.decoder.steps.built[wide[0]] = lambda: ran.append("_cycle")
    deciding.decoder.frozen = True
    deciding.decoder.cycle(1, 256, 3, decide=False)
    deciding.decoder.steps.built[kept] = lambda: ran.append("_kept_cycle")
    deciding.decoder.cycle(1, 256, 3, decide=False)
    deciding.decoder.cycle(1, 256, 3)
    assert ran == ["_cycle", "_kept_cycle", "_cycle"]
    widest = next(w for w in engine.widths if w >= 5)
    assert {shape[3] for shape in engine.declared_shapes(EntropyHeuristic(2, 5).block_size_choices)} == {widest}
    assert {shape[2] for shape in engine.declared_shapes(None, spans=2)} == {256, 512}
    # Between the smallest and the largest row bucket, one every factor of 4, so that a batch runs on a step of at
    # most about 4x its rows.
    by_rows = {rows: Engine(random_models, max_batch=rows).declared_row_buckets() for rows in (8, 16, 64)}
    assert by_rows == {8: [1, 8], 16: [1, 4, 16], 64: [1, 4, 16, 64]}
    decoder = engine.decoder
    decoder.steps.built[("_cycle", 4, 512, 8, False, False)] = lambda: None  # as if built
    decoder.steps.built[("_cycle", 2, 256, 4, False, False)] = lambda: None
    assert decoder.steps.holding("_cycle", (2, 256, 3, False, False)) == ("_cycle", 2, 256, 4, False, False)
    assert decoder.steps.holding("_cycle", (3, 256, 4, False, False)) == ("_cycle", 4, 512, 8, False, False)
    assert decoder.steps.holding("_cycle", (1, 1024, 2, False, False)) is None
    assert decoder.steps.holding("_cycle", (1, 256, 2, True, False)) is None  # another rule: not held
    assert decoder.steps.holding("_cycle", (1, 256, 2, False, True)) is None  # truncating: not held either
    decoder.steps.built[("_kept_cycle", 1, 256, 8, False, False)] = lambda: None
    assert decoder.steps.holding("_kept_cycle", (1, 256, 4, False, False)) == ("_kept_cycle", 1, 256, 8, False, False)
    # A packed step holds a cycle of fewer rows when its entries hold their blocks and one for each free row.
    decoder.steps.built[("_packed_cycle", 4, 256, 8, 16, False, False)] = lambda: None
    held = ("_packed_cycle", 4, 256, 8, 16, False, False)
    assert decoder.steps.holding("_packed_cycle", (3, 256, 8, 15, False, False)) == held
    assert decoder.steps.holding("_packed_cycle", (3, 256, 8, 16, False, False)) is None  # 16 + 1 free row > 16
    assert decoder.steps.holding("_packed_cycle", (4, 256, 8, 16, True, False)) is None


def test_a_compiled_engine_for_requests_rounds_its_capacity_so_other_lengths_share_its_steps(random_models):
    """`engine_for` (what `generate` builds): compiled, the cache rounds up to a power of two (at least 256 slots), so
    a generation of another prompt length or budget runs the same compiled steps (their shapes hold the capacity);
    eager, it is exactly what the requests need (an eager cycle reads up to the capacity)."""
    def capacity(prompt: int, budget: int, compile: str) -> int:
        request = GenerationRequest([1] * prompt, GenerationConfig(max_new_tokens=budget), FixedBlockSize(2))
        return engine_for(random_models, [request], compile=compile).capacity

    reach = random_models.train_block_size + 2
    assert capacity(5, 20, "off") == 25 + reach and capacity(9, 40, "off") == 49 + reach
    assert capacity(5, 20, "compile") == capacity(9, 40, "compile") == 256
    assert capacity(100, 200, "compile") == 512


def test_compiled_kernels_go_under_the_home_unless_the_user_names_a_folder(monkeypatch, tmp_path):
    """Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR the first time it looks: that default is
    replaced by $BLOCKPILOT_HOME/inductor, a folder the user named is kept."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from blockpilot.decoding.engine import keep_compiled_kernels

    monkeypatch.setenv("BLOCKPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # as an import may do: the variable now holds inductor's default
    keep_compiled_kernels()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "home" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    keep_compiled_kernels()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
