"""Block-size policies and the prefill state they read."""

from __future__ import annotations

import math

import pytest
import torch

from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState
from blockpilot.policies.fixed import EntropyHeuristic, FixedBlockSize


def prefill_with_entropy(target_entropy_logits: torch.Tensor) -> PrefillState:
    return PrefillState(target_entropy_logits, torch.tensor([1, 2]), 0.0, 8)


def test_prefill_state_distribution_entropy_and_top_k():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    state = prefill_with_entropy(logits)
    torch.testing.assert_close(state.probs, torch.tensor([0.5, 0.25, 0.125, 0.125]))
    assert state.entropy == pytest.approx(-(0.5 * math.log(0.5) + 0.25 * math.log(0.25) + 2 * 0.125 * math.log(0.125)))
    ids, probs = state.top_k(2)
    assert ids.tolist() == [0, 1] and probs.tolist() == pytest.approx([0.5, 0.25])
    assert state.top_k(10)[0].numel() == 4


def test_entropy_heuristic_maps_confidence_to_longer_blocks():
    policy = EntropyHeuristic(min_block_size=4, max_block_size=12, high_entropy=2.0)
    certain = prefill_with_entropy(torch.tensor([50.0, 0.0, 0.0, 0.0]))
    uniform = prefill_with_entropy(torch.zeros(64))  # entropy ln 64 > 2
    assert policy.initial_block_size(certain) == 12
    assert policy.initial_block_size(uniform) == 4
    sizes = [policy.initial_block_size(prefill_with_entropy(torch.tensor([s, 0.0, 0.0, 0.0]))) for s in (0, 1, 2, 4, 8)]
    assert sizes == sorted(sizes) and all(4 <= b <= 12 for b in sizes)



def test_per_request_policies_keep_the_block_size_each_cycle():
    for policy in (FixedBlockSize(5), EntropyHeuristic(2, 6)):
        assert isinstance(policy, BlockSizePolicy)
        state = CycleState(cycle=3, block_size=5, acceptance_length=2, new_tokens=9, max_new_tokens=64, temperature=0.0)
        assert policy.next_block_size(state) == 5


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: FixedBlockSize(0), "block_size"),
        (lambda: FixedBlockSize(2.5), "block_size"),
        (lambda: EntropyHeuristic(5, 3), "must not exceed"),
        (lambda: EntropyHeuristic(1, 3, high_entropy=0.0), "high_entropy"),
    ],
)
def test_bad_policy_settings(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_resolver_builds_every_policy_by_name(random_models):
    from blockpilot.policies.resolve import PolicySpec, resolve_policy

    train = random_models.train_block_size
    assert resolve_policy("fixed", random_models) == FixedBlockSize(train)
    assert resolve_policy("fixed:3", random_models) == FixedBlockSize(3)
    assert resolve_policy("entropy", random_models) == EntropyHeuristic(train - 2, train + 2)
    assert resolve_policy("autoregressive", random_models).name == "autoregressive"
    from dataclasses import replace

    assert resolve_policy("entropy", replace(random_models, drafter=None)).name == "autoregressive"
    assert str(PolicySpec.parse("fixed:3")) == "fixed:3" and str(PolicySpec.parse("learned:models:/p@champion")) == "learned:models:/p@champion"
    for bad, message in (("fastest", "policy must be one of"), ("fixed:x", "fixed:<integer"), ("learned", "learned policy needs a model"), ("entropy:2", "takes no argument")):
        with pytest.raises(ValueError, match=message):
            resolve_policy(bad, random_models)


def test_specs_of_both_learned_models_and_the_servers_default():
    from blockpilot.policies.resolve import PolicySpec, adaptive_spec

    both = PolicySpec.parse("learned+step:models:/blockpilot-predictor@champion, runs/step")
    assert (both.predictor, both.step_model) == ("models:/blockpilot-predictor@champion", "runs/step")
    assert PolicySpec.parse(str(both)) == both
    assert PolicySpec.parse("learned-step:models:/s/2").step_model == "models:/s/2"
    for bad, message in (("learned+step:only-one", "PREDICTOR,STEP_MODEL"), ("learned+step:p,", "needs a model"), ("learned-step", "needs a model")):
        with pytest.raises(ValueError, match=message):
            PolicySpec.parse(bad)
    assert str(adaptive_spec("p", "s")) == "learned+step:p,s"
    assert str(adaptive_spec(None, "s")) == "learned-step:s" and str(adaptive_spec("p", None)) == "learned:p"
    assert str(adaptive_spec()) == "fixed"
