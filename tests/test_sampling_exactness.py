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
from support import OracleDrafter, greedy_reference

import blockpilot.decoding.engine as engine
from blockpilot.decoding import GenerationConfig, GenerationRequest, generate_many
from blockpilot.models.loading import SpeculativeModels
from blockpilot.policies.fixed import FixedBlockSize
from blockpilot.zoo.random_models import ModelShape, drafter_for, qwen3_target

VOCAB = 16
PROMPT = [1, 2, 3, 4]
TEMPERATURE = 0.6
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
    return qwen3_target(VOCAB, SHAPE, seed=3)


@pytest.fixture(scope="module")
def exact_joint(small_target) -> torch.Tensor:
    """P(x1, x2, x3) at TEMPERATURE, (V, V, V), by enumerating all prefixes."""
    with torch.no_grad():

        def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
            logits = small_target(prefixes).logits[:, -1]
            return torch.softmax(logits / TEMPERATURE, dim=-1)

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


def sample_counts(models: SpeculativeModels, rule: str) -> tuple[torch.Tensor, float]:
    """Counts of (x1, x2, x3) over SAMPLES seeds, and the share of drafts accepted. The seeds run as rows of
    batches (each row its own generator): the batched engine's per-row sampling is what is tested."""
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    accepted = drafted = 0
    requests = [
        GenerationRequest(
            PROMPT,
            GenerationConfig(max_new_tokens=4, temperature=TEMPERATURE, verify=rule, seed=seed),
            FixedBlockSize(4),
        )
        for seed in range(SAMPLES)
    ]
    for result in generate_many(models, requests, max_batch=BATCH):
        x1, x2, x3 = result.token_ids[:3]
        counts[x1, x2, x3] += 1
        accepted += result.acceptance_lengths[0] - 1
        drafted += result.block_sizes[0] - 1
    return counts, accepted / drafted


@pytest.fixture(scope="module")
def drafters(small_target):
    random_drafter = drafter_for(small_target, SHAPE, mask_token_id=VOCAB - 1, seed=5)
    reference = PROMPT + greedy_reference(small_target, PROMPT, 6)

    def models(drafter):
        return SpeculativeModels(small_target, None, drafter, VOCAB - 1)

    return {
        # Unrelated to the target: most drafts are rejected.
        "random": models(random_drafter),
        # The target's own distributions along its greedy path: most drafts are accepted.
        "oracle": models(OracleDrafter(small_target, reference, 4)),
        # Close to the target but over-confident: frequent rejections whose residual differs from p.
        "sharp": models(OracleDrafter(small_target, reference, 4, sharpness=2.0)),
    }


@pytest.mark.parametrize(
    "drafter, rule",
    [
        ("random", "match"),
        ("random", "rejection"),
        ("oracle", "match"),
        ("oracle", "rejection"),
        ("sharp", "rejection"),
    ],
)
def test_first_tokens_follow_the_target_distribution(drafters, exact_joint, rule, drafter):
    counts, acceptance = sample_counts(drafters[drafter], rule)
    if drafter == "random":
        assert acceptance < 0.3, "this case is meant to reject most drafts"
    elif drafter == "oracle":
        assert acceptance > 0.6, "this case is meant to accept most drafts"
    p_value = chi_square_p_value(counts, exact_joint)
    assert p_value > P_VALUE_FLOOR, f"{rule}/{drafter}: p = {p_value:.2e}, acceptance {acceptance:.2f}"


def test_the_check_catches_resampling_from_p_after_a_rejection(drafters, exact_joint, monkeypatch):
    """Negative control: the textbook bug (bonus from p, not from max(0, p - q)) must fail the test."""
    exact_accept = engine.accept_rejection

    def biased_accept(draft_tokens, draft_probs, target_probs, generator):
        accepted, _ = exact_accept(draft_tokens, draft_probs, target_probs, generator)
        bonus = int(torch.multinomial(target_probs[accepted], 1, generator=generator))
        return accepted, bonus

    monkeypatch.setattr(engine, "accept_rejection", biased_accept)
    counts, _ = sample_counts(drafters["sharp"], "rejection")
    assert chi_square_p_value(counts, exact_joint) < 1e-9


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_a_seeded_row_does_not_depend_on_the_other_rows(drafters, rule):
    """The same seeds alone and inside mixed batches (other seeds, temperatures, block sizes) give the same tokens."""
    models = drafters["sharp"]

    def request(seed: int, temperature: float, b: int) -> GenerationRequest:
        config = GenerationConfig(max_new_tokens=12, temperature=temperature, verify=rule, seed=seed)
        return GenerationRequest(PROMPT, config, FixedBlockSize(b))

    watched = [request(seed, TEMPERATURE, 4) for seed in range(6)]
    alone = [generate_many(models, [r])[0].token_ids for r in watched]
    others = [request(100 + i, 1.0 + 0.1 * i, 2 + i % 5) for i in range(10)]
    mixed = generate_many(models, others[:5] + watched + others[5:], max_batch=7)
    assert [r.token_ids for r in mixed[5:11]] == alone


# ----------------------------------------------------------------------------- the static cycle's sampler


def static_counts(models: SpeculativeModels, width: int, rule: str = "match") -> torch.Tensor:
    """Counts of (x1, x2, x3) over SAMPLES seeds from the static engine (`blockpilot.decoding.static_engine`) at
    `width` (every row at b = width), BATCH rows at a time."""
    from blockpilot.decoding.engine import Engine

    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    engine = Engine(models, max_batch=BATCH, width=width, capacity=32)
    config = GenerationConfig(3, TEMPERATURE, verify=rule)
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
    import blockpilot.decoding.static as static

    assert chi_square_p_value(static_counts(drafters["random"], 1), exact_joint) > P_VALUE_FLOOR
    exact_uniforms = static.token_uniforms
    monkeypatch.setattr(
        static, "token_uniforms", lambda seeds, positions, vocab: exact_uniforms(seeds, positions * 0, vocab)
    )
    assert chi_square_p_value(static_counts(drafters["random"], 1), exact_joint) < 1e-9


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


def sharp_static_drafter(monkeypatch, target) -> None:
    """The static cycle's drafter made `OracleDrafter`'s "sharp" double: each slot's logits are the target's along its
    greedy continuation, doubled (close to p, not equal: rejections whose residual differs from p)."""
    import blockpilot.decoding.static as static

    reference = PROMPT + greedy_reference(target, PROMPT, 6)
    with torch.inference_mode():
        logits = 2.0 * target(torch.tensor([reference])).logits[0].float()  # (len, V): the next token's at each

    def draft_logits(self, n: int, span: int, width: int) -> torch.Tensor:
        positions = self.length[:n, None] + self.offsets[1:width]  # the drafted slots' positions
        return logits[(positions - 1).clamp(max=len(reference) - 1)]

    monkeypatch.setattr(static.StaticDecoder, "_draft_logits", draft_logits)


def test_the_static_rejection_rule_follows_the_target_distribution_and_the_check_catches_a_bonus_from_p(
    drafters, exact_joint, small_target, monkeypatch
):
    """Tokens 2 and 3 from one cycle of two drafted samples, kept by speculative sampling's test on the device, with a
    real drafter (which the target mostly rejects) and a sharp double; the negative control draws the bonus after a
    rejection from p, not from max(0, p - q), and the test must fail it."""
    import blockpilot.decoding.static as static

    assert chi_square_p_value(static_counts(drafters["random"], 3, "rejection"), exact_joint) > P_VALUE_FLOOR
    sharp = SpeculativeModels(small_target, None, drafters["random"].drafter, VOCAB - 1)
    sharp_static_drafter(monkeypatch, small_target)
    assert chi_square_p_value(static_counts(sharp, 3, "rejection"), exact_joint) > P_VALUE_FLOOR
    monkeypatch.setattr(static, "residual", lambda target, draft: target)
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
