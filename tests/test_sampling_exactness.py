"""T > 0: both acceptance rules sample exactly the target's distribution.

On a 16-token vocabulary the exact joint law of the first three generated tokens is computed by
enumerating every prefix, and thousands of seeded generations are compared with it by a chi-square test
(cells with expected count < 5 pooled). Tolerance: the test fails when p < 1e-3. The sampled tokens 2
and 3 come out of one draft/verify cycle with two drafts, so acceptance, rejection and the bonus token
are all exercised. A negative control shows the test catches a classic bug (resampling from p instead
of the residual after a rejection).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support import greedy_reference, oracle_drafts

from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.models.loading import SpeculativeModels
from blockpilot.policies.fixed import FixedBlockSize
from blockpilot.zoo.random_models import ModelShape, drafter_for, random_target

VOCAB = 16
PROMPT = [1, 2, 3, 4]
TEMPERATURE = 0.6
TOP_K, TOP_P = 6, 0.8  # on this target's distributions at TEMPERATURE both cut: each keeps 2 to 6 tokens
SAMPLES = 2000
BATCH = 250
P_VALUE_FLOOR = 1e-3
SHAPE = ModelShape(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
    init_std=0.8,
    block_size=4,
)


@pytest.fixture(scope="module")
def small_target():
    return random_target(VOCAB, SHAPE, seed=3)


@pytest.fixture(scope="module")
def exact_joint(small_target) -> torch.Tensor:
    """P(x1, x2, x3) at TEMPERATURE, (V, V, V), by enumerating all prefixes."""
    return joint_law(small_target, lambda logits: torch.softmax(logits / TEMPERATURE, dim=-1))


@pytest.fixture(scope="module")
def truncated_joint(small_target) -> torch.Tensor:
    """The same law with each distribution cut by transformers' own warpers: temperature, top-k, then top-p."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    def warped(logits: torch.Tensor) -> torch.Tensor:
        scores = TopPLogitsWarper(TOP_P)(None, TopKLogitsWarper(TOP_K)(None, logits / TEMPERATURE))
        return torch.softmax(scores, dim=-1)

    return joint_law(small_target, warped)


def joint_law(small_target, probs_of) -> torch.Tensor:
    """P(x1, x2, x3), (V, V, V), with next-token distributions `probs_of(logits)`, by enumerating all prefixes."""
    with torch.no_grad():

        def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
            return probs_of(small_target(prefixes).logits[:, -1])

        prompt = torch.tensor(PROMPT)
        p1 = next_probs(prompt[None])[0]
        x1 = torch.arange(VOCAB)
        p2 = next_probs(torch.cat([prompt.expand(VOCAB, -1), x1[:, None]], dim=1))
        pairs = torch.cartesian_prod(x1, x1)
        p3 = next_probs(torch.cat([prompt.expand(VOCAB * VOCAB, -1), pairs], dim=1)).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs * counts.sum()
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


@pytest.fixture(scope="module")
def drafters(small_target):
    random_drafter = drafter_for(small_target, SHAPE, mask_token_id=VOCAB - 1, seed=5)
    # Unrelated to the target: most drafts are rejected (doubles that accept are patched into its cycle).
    return {"random": SpeculativeModels(small_target, None, random_drafter, VOCAB - 1)}


# ----------------------------------------------------------------------------- the static cycle's sampler


def static_counts(models: SpeculativeModels, width: int, rule: str = "match", **cut: float) -> torch.Tensor:
    """Counts of (x1, x2, x3) over SAMPLES seeds from the engine (`blockpilot.decoding.engine`) at
    `width` (every row at b = width), BATCH rows at a time; `cut`: top_k and top_p."""
    from blockpilot.decoding.engine import Engine

    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    engine = Engine(models, max_batch=BATCH, width=width, capacity=32)
    config = GenerationConfig(3, TEMPERATURE, verify=rule, **cut)
    requests = [
        GenerationRequest(PROMPT, replace(config, seed=seed), FixedBlockSize(width) if width > 1 else None)
        for seed in range(SAMPLES)
    ]
    for result in generate_many(models, requests, engine=engine):
        counts[tuple(result.token_ids)] += 1
    return counts


def test_the_static_sampler_follows_the_target_distribution_and_the_check_catches_shared_uniforms(
    drafters, exact_joint, monkeypatch
):
    """Autoregressive (width 1) draws by an exponential race over the uniforms of (seed, position, token) sample the
    joint law; the negative control draws every position of a row from the same uniforms, and the test must fail it."""
    import blockpilot.decoding.sampling as sampling

    assert chi_square_p_value(static_counts(drafters["random"], 1), exact_joint) > P_VALUE_FLOOR
    exact_uniforms = sampling.token_uniforms
    monkeypatch.setattr(
        sampling, "token_uniforms", lambda seeds, positions, vocab: exact_uniforms(seeds, positions * 0, vocab)
    )
    assert chi_square_p_value(static_counts(drafters["random"], 1), exact_joint) < 1e-9


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_drafts_the_target_accepts_keep_the_sampled_law(drafters, exact_joint, small_target, monkeypatch, rule):
    """Drafts along the target's own greedy path (most accepted at this temperature): tokens 2 and 3 come out of one
    cycle of accepted drafts and a bonus, and still follow the target's joint law under either rule."""
    oracle_drafts(monkeypatch, small_target, PROMPT + greedy_reference(small_target, PROMPT, 6))
    assert chi_square_p_value(static_counts(drafters["random"], 3, rule), exact_joint) > P_VALUE_FLOOR


def test_a_static_row_samples_what_it_would_alone_and_autoregressively(drafters):
    """The speculative output for a seed is the autoregressive one: at any block size, beside other rows (other
    seeds, temperatures, block sizes), so it samples the target's distribution exactly, as the test above shows."""
    from blockpilot.decoding.engine import Engine

    models = drafters["random"]
    seeds, temperatures = list(range(8)), [TEMPERATURE, 1.0, 0.0, 1.3] * 2
    requests = [
        GenerationRequest(PROMPT, GenerationConfig(16, t, seed=s), FixedBlockSize(b))
        for s, t, b in zip(seeds, temperatures, [4, 2, 3, 1] * 2, strict=True)
    ]
    autoregressive = Engine(models, max_batch=1, width=1, capacity=48)
    alone = [r.token_ids for r in generate_many(models, [replace(q, policy=None) for q in requests], engine=autoregressive)]
    mixed = generate_many(models, requests, engine=Engine(models, max_batch=8, width=4, capacity=48))
    assert [r.token_ids for r in mixed] == alone
    assert alone[2] == greedy_reference(models.target, PROMPT, 16)  # the T = 0 row is greedy
    assert len({tuple(tokens) for tokens in alone}) > 4  # seeds and temperatures do change the samples


def test_the_static_rejection_rule_follows_the_target_distribution_and_the_check_catches_a_bonus_from_p(
    drafters, exact_joint, small_target, monkeypatch
):
    """Tokens 2 and 3 from one cycle of two drafted samples, kept by speculative sampling's test on the device, with a
    real drafter (which the target mostly rejects) and a sharp double; the negative control draws the bonus after a
    rejection from p, not from max(0, p - q), and the test must fail it."""
    import blockpilot.decoding.sampling as sampling

    assert chi_square_p_value(static_counts(drafters["random"], 3, "rejection"), exact_joint) > P_VALUE_FLOOR
    sharp = SpeculativeModels(small_target, None, drafters["random"].drafter, VOCAB - 1)
    oracle_drafts(monkeypatch, small_target, PROMPT + greedy_reference(small_target, PROMPT, 6), sharpness=2.0)
    assert chi_square_p_value(static_counts(sharp, 3, "rejection"), exact_joint) > P_VALUE_FLOOR
    monkeypatch.setattr(sampling, "residual", lambda target, draft: target)
    assert chi_square_p_value(static_counts(sharp, 3, "rejection"), exact_joint) < 1e-9


def test_a_static_rejection_row_does_not_depend_on_the_other_rows(drafters):
    """Rows at `rejection` alone and beside rows of other rules, seeds, temperatures and block sizes: the same
    tokens; at T = 0 the rule is greedy."""
    from blockpilot.decoding.engine import Engine

    models = drafters["random"]

    def request(seed: int, temperature: float, b: int, rule: str) -> GenerationRequest:
        config = GenerationConfig(16, temperature, verify=rule, seed=seed)
        return GenerationRequest(PROMPT, config, FixedBlockSize(b))

    watched = [request(seed, TEMPERATURE, 4, "rejection") for seed in range(6)] + [request(9, 0.0, 4, "rejection")]
    alone = [generate_many(models, [r], engine=Engine(models, width=4, capacity=48))[0].token_ids for r in watched]
    others = [request(100 + i, 1.0 + 0.1 * i, 2 + i % 3, ("match", "rejection")[i % 2]) for i in range(6)]
    mixed = generate_many(models, others[:3] + watched + others[3:], engine=Engine(models, max_batch=8, width=4, capacity=48))
    assert [r.token_ids for r in mixed[3:10]] == alone
    assert alone[-1] == greedy_reference(models.target, PROMPT, 16)
    assert len({tuple(tokens) for tokens in alone[:-1]}) > 3


@pytest.mark.parametrize(("width", "rule"), [(1, "match"), (3, "match"), (3, "rejection")])
def test_top_k_and_top_p_sample_the_cut_law_and_drafts_do_not_leak_past_it(
    drafters, truncated_joint, exact_joint, small_target, monkeypatch, width, rule
):
    """With top-k and top-p, autoregression and both rules (drafts along the target's greedy path, most accepted;
    under `rejection` drafts sampled from the drafter's own cut distributions) sample the law transformers' warpers
    define; the same samples fail against the uncut law, and uncut samples fall outside the cut."""
    cut = {"top_k": TOP_K, "top_p": TOP_P}
    assert (truncated_joint > 0).sum() < (exact_joint > 1e-12).sum()  # the cut removes some of the law's support
    if width > 1:
        oracle_drafts(monkeypatch, small_target, PROMPT + greedy_reference(small_target, PROMPT, 6))
    counts = static_counts(drafters["random"], width, rule, **cut)
    assert chi_square_p_value(counts, truncated_joint) > P_VALUE_FLOOR
    assert counts[truncated_joint == 0].sum() == 0  # not one sample outside the cut
    assert chi_square_p_value(counts, exact_joint) < 1e-9
    if width == 1:  # the check catches samples of the uncut law: many fall outside the cut
        assert static_counts(drafters["random"], width, rule)[truncated_joint == 0].sum() > SAMPLES / 20


def test_a_truncating_row_samples_what_it_would_alone_and_autoregressively(drafters):
    """Rows with top-k and top-p beside rows without (and at T = 0): each row's tokens for its seed are those of
    autoregression with the same cut, at any block size; the cut changes the samples."""
    from blockpilot.decoding.engine import Engine

    models = drafters["random"]
    cuts = [{"top_k": 3}, {"top_p": 0.5}, {"top_k": 5, "top_p": 0.9}, {}] * 2
    requests = [
        GenerationRequest(PROMPT, GenerationConfig(16, t, seed=s, **c), FixedBlockSize(b))
        for s, t, c, b in zip(range(8), [1.0, 1.0, 1.3, 1.0, 0.0, 1.0, 0.8, 1.0], cuts, [4, 2, 3, 1] * 2, strict=True)
    ]
    autoregressive = Engine(models, max_batch=1, width=1, capacity=48)
    plain = [replace(q, policy=None) for q in requests]
    alone = [r.token_ids for r in generate_many(models, plain, engine=autoregressive)]
    mixed = generate_many(models, requests, engine=Engine(models, max_batch=8, width=4, capacity=48))
    assert [r.token_ids for r in mixed] == alone
    assert alone[4] == greedy_reference(models.target, PROMPT, 16)  # T = 0: a cut changes nothing
    uncut = [replace(q, config=replace(q.config, top_k=0, top_p=1.0), policy=None) for q in requests[:3]]
    assert [r.token_ids for r in generate_many(models, uncut, engine=autoregressive)] != alone[:3]
