"""Generation at T = 0: lossless against the target's greedy decoding, and honest end-of-generation stats."""

from __future__ import annotations

import pytest
from support import check_stats_invariants, greedy_reference, oracle_drafts

from blockpilot.data.sources import prompt_texts
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate, generate_many
from blockpilot.decoding.rows import PREFILL_MAX_PADDING, prefill_groups
from blockpilot.policies.fixed import EntropyHeuristic, FixedBlockSize
from blockpilot.policies.resolve import resolve_policy

PROMPTS = ["Count from one to ten.", "def add(a, b):", "The quick brown fox"]


@pytest.fixture(scope="module")
def prompt_ids(random_models):
    return [random_models.encode_prompt(p) for p in PROMPTS]


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
def test_greedy_equals_target_greedy_for_fixed_block_sizes(random_models, prompt_ids, block_size):
    for ids in prompt_ids:
        expected = greedy_reference(random_models.target, ids, 40)
        result = generate(
            random_models, ids, policy=FixedBlockSize(block_size), config=GenerationConfig(max_new_tokens=40)
        )
        assert result.token_ids == expected
        assert result.block_size == block_size
        check_stats_invariants(result, 40)


def test_greedy_equals_target_greedy_with_entropy_policy(random_models, prompt_ids):
    """The entropy policy's b is what it computes from each prompt's prefill, and the output stays exact."""
    policy = EntropyHeuristic(min_block_size=2, max_block_size=10, high_entropy=6.0)
    for ids in prompt_ids:
        expected = greedy_reference(random_models.target, ids, 40)
        result = generate(random_models, ids, policy=policy, config=GenerationConfig(max_new_tokens=40))
        assert result.token_ids == expected
        assert result.block_size == policy.initial_block_size(result.prefill)
        assert result.policy == "entropy" and result.block_sizes[0] == max(result.block_sizes) == result.block_size
        check_stats_invariants(result, 40)


def test_autoregressive_without_drafter_equals_reference(random_models, prompt_ids):
    from dataclasses import replace

    models = replace(random_models, drafter=None, mask_token_id=None)
    result = generate(models, prompt_ids[0], config=GenerationConfig(max_new_tokens=30))
    assert result.token_ids == greedy_reference(random_models.target, prompt_ids[0], 30)
    assert result.block_size == 1 and set(result.acceptance_lengths) == {1}
    assert result.drafter_forward_passes == 0 and result.policy == "autoregressive"


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_accepted_drafts_keep_output_exact(random_models, prompt_ids, block_size, monkeypatch):
    """With drafts that the target accepts (an oracle), whole blocks commit and the output stays exact."""
    ids = prompt_ids[1]
    expected = greedy_reference(random_models.target, ids, 50)
    reference = ids + expected
    wrong = [len(ids) + k for k in (3, 4, 11, 19, 20, 21, 33)]
    oracle_drafts(monkeypatch, random_models.target, reference, wrong_positions=wrong)
    result = generate(random_models, ids, policy=FixedBlockSize(block_size), config=GenerationConfig(max_new_tokens=50))
    assert result.token_ids == expected
    check_stats_invariants(result, 50)
    assert max(result.acceptance_lengths) == block_size  # full blocks were accepted
    assert min(result.acceptance_lengths) < block_size  # and the wrong drafts were rejected
    assert result.tau > 1.5


def _oracle_models(random_models, ids, monkeypatch):
    expected = greedy_reference(random_models.target, ids, 60)
    oracle_drafts(monkeypatch, random_models.target, ids + expected)
    return random_models, expected


@pytest.mark.parametrize("slot", ["first", "middle", "last"])
def test_stop_token_inside_a_block(random_models, prompt_ids, slot, monkeypatch):
    """A stop token committed at the first, a middle or the last slot of a cycle ends the output there."""
    ids, block_size = prompt_ids[0], 6
    models, expected = _oracle_models(random_models, ids, monkeypatch)
    # With every draft accepted, cycle c commits expected[1 + c*b : 1 + (c+1)*b]. Take the first cycle
    # whose token at the wanted slot appears nowhere earlier, so that it is where the output must stop.
    offset = {"first": 0, "middle": 2, "last": block_size - 1}[slot]
    index = next(i for i in range(1 + offset, len(expected), block_size) if expected.index(expected[i]) == i)
    stop = expected[index]
    result = generate(
        models,
        ids,
        policy=FixedBlockSize(block_size),
        config=GenerationConfig(max_new_tokens=60, stop_token_ids=(stop,)),
    )
    assert result.token_ids == expected[: index + 1]
    assert result.token_ids[-1] == stop and result.stop_reason == "stop"
    check_stats_invariants(result, 60)
    # The target accepted the whole block, but tokens past the stop never count.
    assert result.acceptance_lengths[-1] == offset + 1
    assert sum(result.acceptance_lengths) == index


def test_stop_token_at_the_prefill_ends_before_any_cycle(random_models, prompt_ids):
    ids = prompt_ids[0]
    first = greedy_reference(random_models.target, ids, 1)[0]
    result = generate(random_models, ids, config=GenerationConfig(max_new_tokens=20, stop_token_ids=(first,)))
    assert result.token_ids == [first] and result.cycles == 0 and result.stop_reason == "stop"
    assert result.to_dict()["tau"] is None


def generate_counting_target_passes(models, requests, monkeypatch) -> tuple[list, int]:
    """`generate_many`'s results and how many forward passes the target ran for them."""
    import blockpilot.decoding.static as static

    passes = []
    forward = static.StaticTarget.forward

    def counting(self, *args, **kwargs):
        passes.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(static.StaticTarget, "forward", counting)
    return generate_many(models, requests), len(passes)


def test_rows_that_join_together_share_one_prefill_and_stay_exact(random_models, prompt_ids, monkeypatch):
    """Prompts of similar lengths joining in the same step are prefilled in one padded target pass; each row
    still gives its own greedy output, a row that stops at its first token leaves at once, the others go on."""
    assert len({len(ids) for ids in prompt_ids}) == len(prompt_ids), "prompts of different lengths"
    stop_first = greedy_reference(random_models.target, prompt_ids[1], 1)[0]
    configs = [
        GenerationConfig(max_new_tokens=30),
        GenerationConfig(max_new_tokens=30, stop_token_ids=(stop_first,)),
        GenerationConfig(max_new_tokens=25),
    ]
    requests = [
        GenerationRequest(ids, config, FixedBlockSize(b))
        for ids, config, b in zip(prompt_ids, configs, (4, 2, 8), strict=True)
    ]
    results, passes = generate_counting_target_passes(random_models, requests, monkeypatch)
    assert results[0].token_ids == greedy_reference(random_models.target, prompt_ids[0], 30)
    assert results[1].token_ids == [stop_first] and results[1].stop_reason == "stop"
    assert results[2].token_ids == greedy_reference(random_models.target, prompt_ids[2], 25)
    assert passes == 1 + max(result.cycles for result in results), "one prefill pass, then one verify a cycle"


def test_prefill_groups_keep_padding_bounded():
    lengths = [40, 3, 5, 41, 4, 120, 6, 39, 4]
    groups = prefill_groups(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths))), "every prompt once"
    for group in groups:
        assert len(group) * max(lengths[i] for i in group) <= PREFILL_MAX_PADDING * sum(lengths[i] for i in group)
    assert [sorted(lengths[i] for i in g) for g in groups] == [[3, 4, 4, 5, 6], [39, 40, 41], [120]]
    assert prefill_groups([7, 7, 7]) == [[0, 1, 2]], "prompts of one length share a pass"
    assert prefill_groups([3, 9], max_padding=1.0) == [[0], [1]]
    with pytest.raises(ValueError, match="max_padding must be >= 1"):
        prefill_groups([3], max_padding=0.5)


def test_prompts_of_very_different_lengths_prefill_apart_and_stay_exact(random_models, prompt_ids, monkeypatch):
    """A long prompt joining with short ones gets its own prefill pass (padding every short prompt to it would
    multiply their work); every row still gives its own greedy output."""
    long_prompt = (prompt_ids[0] * 4)[:150]
    prompts = [prompt_ids[1], long_prompt, prompt_ids[2]]
    requests = [GenerationRequest(ids, GenerationConfig(max_new_tokens=12), FixedBlockSize(4)) for ids in prompts]
    results, passes = generate_counting_target_passes(random_models, requests, monkeypatch)
    for ids, result in zip(prompts, results, strict=True):
        assert result.token_ids == greedy_reference(random_models.target, ids, 12)
    assert passes == 2 + max(result.cycles for result in results), "two prefill passes, then one verify a cycle"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 9, 10, 11, 17])
def test_max_new_tokens_inside_a_block(random_models, prompt_ids, max_new_tokens, monkeypatch):
    ids, block_size = prompt_ids[2], 8
    models, expected = _oracle_models(random_models, ids, monkeypatch)
    result = generate(
        models, ids, policy=FixedBlockSize(block_size), config=GenerationConfig(max_new_tokens=max_new_tokens)
    )
    assert result.token_ids == expected[:max_new_tokens]
    assert result.stop_reason == "length"
    check_stats_invariants(result, max_new_tokens)


def test_per_cycle_hook_can_change_the_block_size(random_models, prompt_ids, monkeypatch):
    """A per-cycle policy (a later issue's) plugs in through `next_block_size`; output stays exact."""

    class Growing(FixedBlockSize):
        def next_block_size(self, cycle):
            return min(cycle.block_size + 1, 12)

    ids = prompt_ids[1]
    models, expected = _oracle_models(random_models, ids, monkeypatch)
    result = generate(models, ids, policy=Growing(2), config=GenerationConfig(max_new_tokens=40))
    assert result.token_ids == expected[:40]
    assert result.block_sizes[:4] == [2, 3, 4, 5]
    check_stats_invariants(result, 40)


def test_policy_returning_a_bad_block_size_fails_clearly(random_models, prompt_ids):
    class Broken(FixedBlockSize):
        def initial_block_size(self, prefill):
            return 0

    with pytest.raises(ValueError, match="returned block size 0"):
        generate(random_models, prompt_ids[0], policy=Broken(3))

    class ShortBatch(FixedBlockSize):
        def next_block_sizes(self, cycles):
            return []

    with pytest.raises(ValueError, match="returned 0 block sizes for 1 rows"):
        generate(random_models, prompt_ids[0], policy=ShortBatch(3))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"verify": "typical"}, "verify"),
    ],
)
def test_bad_generation_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)


def test_bad_prompts(random_models):
    with pytest.raises(ValueError, match="empty"):
        generate(random_models, [])
    with pytest.raises(ValueError, match="token ids must lie"):
        generate(random_models, [10_000])
    with pytest.raises(ValueError, match="exceeds the target's context"):
        generate(random_models, [5] * 2040, config=GenerationConfig(max_new_tokens=16))


def test_stats_are_returned_not_printed(random_models, prompt_ids, capsys):
    result = generate(random_models, prompt_ids[0], config=GenerationConfig(max_new_tokens=12))
    assert capsys.readouterr().out == ""
    payload = result.to_dict()
    assert {
        "token_ids",
        "acceptance_lengths",
        "block_size",
        "tau",
        "prefill_time_s",
        "decode_time_s",
        "target_forward_passes",
    } <= set(payload)
    assert result.prefill_time_s > 0 and result.decode_time_s > 0
    assert isinstance(result.prefill.entropy, float) and result.prefill.probs.shape == (len(random_models.tokenizer),)


def test_seeded_sampling_is_reproducible(random_models, prompt_ids):
    config = GenerationConfig(max_new_tokens=24, temperature=1.0, seed=123)
    first = generate(random_models, prompt_ids[0], config=config)
    second = generate(random_models, prompt_ids[0], config=config)
    other = generate(random_models, prompt_ids[0], config=GenerationConfig(max_new_tokens=24, temperature=1.0, seed=7))
    assert first.token_ids == second.token_ids
    assert first.token_ids != other.token_ids


def test_rejection_rule_at_temperature_zero_is_greedy(random_models, prompt_ids):
    ids = prompt_ids[1]
    result = generate(random_models, ids, config=GenerationConfig(max_new_tokens=30, verify="rejection"))
    assert result.token_ids == greedy_reference(random_models.target, ids, 30)


# ----------------------------------------------------------------------------- the trained tiny zoo


@pytest.fixture(scope="module")
def zoo_prompts(tiny_zoo, tiny_models):
    return [tiny_models.encode_prompt(text) for text in prompt_texts(f"zoo:{tiny_zoo}:heldout", limit=6)]


@pytest.mark.parametrize("policy", [1, 2, 4, 8, 16, "entropy"])
def test_trained_drafter_keeps_greedy_exact(tiny_models, zoo_prompts, policy):
    """With a trained DFlash drafter (real acceptances, real drafter cache), T = 0 output stays exact."""
    policy = resolve_policy("entropy", tiny_models) if policy == "entropy" else FixedBlockSize(policy)
    stop = tuple(tiny_models.stop_token_ids())
    accepted_any = False
    for ids in zoo_prompts:
        expected = greedy_reference(tiny_models.target, ids, 48, stop)
        result = generate(
            tiny_models, ids, policy=policy, config=GenerationConfig(max_new_tokens=48, stop_token_ids=stop)
        )
        assert result.token_ids == expected
        check_stats_invariants(result, 48)
        accepted_any |= any(tau > 1 for tau in result.acceptance_lengths)
    if policy.name == "entropy" or policy.block_size > 1:
        assert accepted_any, "a trained drafter should get some drafts accepted"


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_trained_drafter_sampling_stats(tiny_models, zoo_prompts, rule):
    stop = tuple(tiny_models.stop_token_ids())
    for seed, ids in enumerate(zoo_prompts):
        config = GenerationConfig(max_new_tokens=40, temperature=0.8, verify=rule, seed=seed, stop_token_ids=stop)
        result = generate(tiny_models, ids, policy=FixedBlockSize(4), config=config)
        check_stats_invariants(result, 40)
        assert all(t not in stop for t in result.token_ids[:-1])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_unequal_blocks_in_one_batch_decode_as_each_row_alone(tiny_models, zoo_prompts, temperature):
    """Rows of different block sizes in one batch give each row what it gives alone, greedy or seeded."""
    stop = tuple(tiny_models.stop_token_ids())
    requests = [
        GenerationRequest(
            ids,
            GenerationConfig(max_new_tokens=40, temperature=temperature, seed=seed, stop_token_ids=stop),
            FixedBlockSize(b),
        )
        for seed, (ids, b) in enumerate(zip(zoo_prompts, (2, 8, 3, 6, 1, 5), strict=True))
    ]
    alone = [generate_many(tiny_models, [request])[0] for request in requests]
    batched = generate_many(tiny_models, requests, max_batch=len(requests))
    for mine, theirs, ids in zip(batched, alone, zoo_prompts, strict=True):
        assert (mine.token_ids, mine.acceptance_lengths, mine.block_sizes) == (
            theirs.token_ids,
            theirs.acceptance_lengths,
            theirs.block_sizes,
        )
        check_stats_invariants(mine, 40)
        if temperature == 0:
            assert mine.token_ids == greedy_reference(tiny_models.target, ids, 40, stop)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_long_prompts_prefill_a_chunk_a_step_beside_running_rows_and_decode_as_whole(
    tiny_models, zoo_prompts, temperature
):
    """With `prefill_chunk`, a prompt longer than a chunk is prefilled over several steps in a row of its own
    while the other rows cycle; it then joins and decodes exactly what it decodes prefilled whole (greedy, or
    seeded at T = 1), and a short row is not held behind it."""
    from blockpilot.decoding import Engine

    stop = tuple(tiny_models.stop_token_ids())
    short = tiny_models.encode_prompt("Hi.")
    chunk = len(short)  # the short prompt is prefilled whole, the long ones in chunks
    longs = [ids + ids for ids in zoo_prompts[:2]]  # each at least twice the short one
    assert longs and len(short) <= chunk, "the test needs long prompts and a short one"
    requests = [
        GenerationRequest(ids, GenerationConfig(max_new_tokens=24, temperature=temperature, seed=i, stop_token_ids=stop),
                          FixedBlockSize(3))
        for i, ids in enumerate([*longs, short])
    ]
    whole = [generate_many(tiny_models, [request])[0] for request in requests]
    engine = Engine(tiny_models, max_batch=3, prefill_chunk=chunk)
    ids = [engine.submit(request) for request in requests]
    first_tokens_at: dict[int, int] = {}
    results = {}
    for step, updates in enumerate(iter(engine.step, None)):
        for update in updates:
            if update.new_tokens:
                first_tokens_at.setdefault(update.row_id, step)
            if update.result is not None:
                results[update.row_id] = update.result
        if not engine.busy:
            break
    for row_id, alone in zip(ids, whole, strict=True):
        assert results[row_id].token_ids == alone.token_ids
        check_stats_invariants(results[row_id], 24)
    # The short prompt, behind the long ones, decodes while the first long one is still being prefilled.
    assert first_tokens_at[ids[2]] < first_tokens_at[ids[0]]
    assert first_tokens_at[ids[0]] >= len(longs[0]) // chunk - 1, "the long prompt took a chunk a step"
