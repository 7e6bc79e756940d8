"""Grouped-query attention under a mask, on the key/value heads as stored: the same result as attention with
every key and value repeated per query head, and what a loaded target runs its masked passes with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockpilot.models.attention import GROUPED_SDPA, grouped_query_attention


def repeated_reference(query, key, value, mask):
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), attn_mask=mask
    )


def random_qkv(n=3, heads=6, kv_heads=2, q_len=5, kv_len=11, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, heads, q_len, dim, generator=generator),
        torch.randn(n, kv_heads, kv_len, dim, generator=generator),
        torch.randn(n, kv_heads, kv_len, dim, generator=generator),
    )


def row_masks(n, q_len, kv_len, seed=1):
    """Each row sees its own prefix of the keys, causally within the last q_len: the verify pass's pattern."""
    lengths = torch.randint(1, kv_len - q_len + 1, (n,), generator=torch.Generator().manual_seed(seed))
    positions = lengths[:, None] + torch.arange(q_len)
    return torch.arange(kv_len)[None, None, :] <= positions[:, :, None]  # (n, q, k)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_equals_attention_with_repeated_keys_and_values(heads, kv_heads):
    query, key, value = random_qkv(heads=heads, kv_heads=kv_heads)
    visible = row_masks(3, 5, 11)[:, None]  # (n, 1, q, k)
    additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    for mask in (visible, additive, visible[:1], visible[:, :, -1:], None):
        torch.testing.assert_close(
            grouped_query_attention(query, key, value, mask), repeated_reference(query, key, value, mask)
        )


def test_keys_and_values_reach_the_kernel_unrepeated(monkeypatch):
    """The point of the function: the kernel gets the KV heads as stored, not H / KV copies."""
    seen = []
    kernel = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append((query.shape[1], key.shape[1]))
        return kernel(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    query, key, value = random_qkv(heads=6, kv_heads=2)
    grouped_query_attention(query, key, value, row_masks(3, 5, 11)[:, None])
    assert seen == [(2, 2)]


def test_a_mask_per_head_still_gives_per_head_attention():
    query, key, value = random_qkv(heads=4, kv_heads=2)
    per_head = torch.rand(3, 4, 5, 11, generator=torch.Generator().manual_seed(2)) > 0.3
    per_head[..., 0] = True  # no query sees nothing
    torch.testing.assert_close(
        grouped_query_attention(query, key, value, per_head), repeated_reference(query, key, value, per_head)
    )


def test_heads_that_do_not_share_evenly_are_refused():
    query, key, value = random_qkv(heads=5, kv_heads=2)
    with pytest.raises(ValueError, match="5 query heads cannot share 2 key/value heads"):
        grouped_query_attention(query, key, value, None)


def test_loaded_targets_run_masked_passes_through_it(random_zoo, monkeypatch):
    """A target from `load_target` has the grouped implementation, and a masked pass (rows of different
    lengths, right-padded, as the engine's prefill and verify mask them) gives transformers' own SDPA logits."""
    from transformers import AutoModelForCausalLM

    from blockpilot.models import attention
    from blockpilot.models.loading import load_target

    target = load_target(random_zoo["target"], device="cpu")
    stock = AutoModelForCausalLM.from_pretrained(random_zoo["target"], attn_implementation="sdpa").eval()
    config = target.config
    assert config._attn_implementation == GROUPED_SDPA
    assert config.num_attention_heads > config.num_key_value_heads, "the fixture target uses grouped-query attention"
    lengths = torch.tensor([12, 7, 3])
    ids = torch.randint(0, config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(3))
    slots = torch.arange(12)
    mask = (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lengths[:, None, None])
    calls = []
    grouped = attention.grouped_query_attention
    monkeypatch.setattr(attention, "grouped_query_attention", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    with torch.no_grad():
        ours, theirs = target(ids, attention_mask=mask[:, None]).logits, stock(ids, attention_mask=mask[:, None]).logits
    assert len(calls) == config.num_hidden_layers, "every layer's masked attention went through it"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
