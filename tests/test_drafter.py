"""The DFlash drafter: z-lab config and weight layout, checkpoint round trip, context caching."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockpilot.models.drafter import Blocks, DFlashConfig, DFlashDrafter, dflash_target_layer_ids
from blockpilot.zoo.random_models import ModelShape, drafter_for, random_models_like, random_target

FIXTURES = Path(__file__).parent / "fixtures"
ZLAB_WEIGHT_NAME = re.compile(
    r"^(fc|hidden_norm|norm)\.weight$"
    r"|^layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)"
    r"|mlp\.(gate_proj|up_proj|down_proj)|input_layernorm|post_attention_layernorm)\.weight$"
)


@pytest.fixture(scope="module")
def target_and_drafter():
    shape = ModelShape(drafter_layers=2, init_std=0.2)
    target = random_target(64, shape, seed=0)
    return target, drafter_for(target, shape, mask_token_id=63, seed=1)


def test_dflash_layer_rule():
    assert dflash_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_target_layer_ids(28, 1) == [14]
    shallow = dflash_target_layer_ids(4, 2)
    assert len(set(shallow)) == 2 and all(0 <= i < 4 for i in shallow)
    with pytest.raises(ValueError, match="distinct layers"):
        dflash_target_layer_ids(2, 3)


def test_parses_the_published_qwen3_4b_b16_config():
    config = DFlashConfig.from_dict(json.loads((FIXTURES / "zlab_qwen3_4b_dflash_b16_config.json").read_text()))
    assert config.block_size == 16
    assert config.mask_token_id == 151669
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.num_target_layers == 36
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (2560, 5, 128)
    assert config.rope_theta == 1_000_000
    assert config.context_feature_size == 5 * 2560
    # Unknown keys survive a round trip; the DFlash keys keep their published places.
    out = config.to_dict()
    assert out["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert out["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert out["block_size"] == 16 and out["num_target_layers"] == 36
    assert DFlashConfig.from_dict(out) == config


def test_random_models_take_the_shape_a_drafter_config_names():
    raw = json.loads((FIXTURES / "zlab_qwen3_4b_dflash_b16_config.json").read_text())
    # The published layout and vocabulary, narrowed so that the test builds in a second.
    raw.update(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    config = DFlashConfig.from_dict(raw)
    models = random_models_like(config, device="cpu", dtype="bfloat16")
    target_config = models.target.config
    assert (target_config.num_hidden_layers, target_config.hidden_size, target_config.vocab_size) == (36, 32, 151936)
    assert models.drafter.config.target_layer_ids == [1, 9, 17, 25, 33] and models.drafter.block_size == 16
    assert models.mask_token_id == 151669 and models.tokenizer is None
    assert models.target.dtype == torch.bfloat16 and models.drafter.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32  # set back after building in bf16
    with pytest.raises(ValueError, match="num_target_layers"):
        random_models_like(dataclasses.replace(config, num_target_layers=None), device="cpu")


def test_config_fields_may_sit_under_dflash_config_and_rope_parameters():
    raw = json.loads((FIXTURES / "zlab_qwen3_4b_dflash_b16_config.json").read_text())
    del raw["block_size"], raw["rope_theta"]
    raw["dflash_config"]["block_size"] = 10
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    config = DFlashConfig.from_dict(raw)
    assert config.block_size == 10 and config.rope_theta == 5e6


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda raw: raw.pop("block_size"), "block_size"),
        (lambda raw: raw.pop("hidden_size"), "hidden_size"),
        (lambda raw: raw.update(hidden_act="gelu"), "hidden_act"),
        (lambda raw: raw.update(layer_types=["sliding_attention"] * 5), "full-attention"),
        (lambda raw: raw.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (lambda raw: raw["dflash_config"].update(target_layer_ids=[]), "target_layer_ids"),
        (lambda raw: raw.update(num_key_value_heads=7), "num_key_value_heads"),
        # Fields of newer drafters the engine would ignore: refused, never drafted wrong.
        (lambda raw: raw["dflash_config"].update(output_multiplier=0.5), "dflash_config.output_multiplier = 0.5"),
        (lambda raw: raw.update(final_logit_softcapping=30.0), "final_logit_softcapping = 30.0 is not computed"),
        (lambda raw: raw.update(input_embedding_scale=2.0), "input_embedding_scale = 2.0"),
    ],
)
def test_bad_configs_name_the_field(change, message):
    raw = json.loads((FIXTURES / "zlab_qwen3_4b_dflash_b16_config.json").read_text())
    change(raw)
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_dict(raw)


def _draft_hidden(drafter, target, context_len=9, block=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (1, context_len + 1), generator=generator)
    with torch.no_grad():
        hidden_states = target(ids[:, :context_len], output_hidden_states=True).hidden_states
        features = torch.cat([hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
        kv = drafter.encode_context(features, torch.arange(context_len)[None])
        block_ids = torch.full((1, block), drafter.mask_token_id)
        block_ids[0, 0] = ids[0, context_len]
        embeds = target.get_input_embeddings()(block_ids)
        positions = torch.arange(context_len, context_len + block)[None]
        return features, embeds, positions, drafter(embeds, positions, kv)


def test_checkpoint_round_trip_gives_identical_logits(target_and_drafter, tmp_path):
    target, drafter = target_and_drafter
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    assert loaded.config == drafter.config
    before = target.lm_head(_draft_hidden(drafter, target)[-1])
    after = target.lm_head(_draft_hidden(loaded, target)[-1])
    assert torch.equal(before, after)


def test_checkpoint_uses_the_zlab_layout(target_and_drafter, tmp_path):
    _, drafter = target_and_drafter
    directory = drafter.save_pretrained(tmp_path / "drafter")
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    names = set(load_file(directory / "model.safetensors"))
    assert all(ZLAB_WEIGHT_NAME.match(name) for name in names), sorted(names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": drafter.target_layer_ids}
    assert raw["block_size"] == drafter.block_size and raw["num_target_layers"] == 4


def test_loading_rejects_weights_of_another_layout(target_and_drafter, tmp_path):
    _, drafter = target_and_drafter
    directory = drafter.save_pretrained(tmp_path / "drafter")
    state = load_file(directory / "model.safetensors")
    state["model.fc.weight"] = state.pop("fc.weight")
    save_file(state, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\].*unexpected \['model.fc.weight'\]"):
        DFlashDrafter.from_pretrained(directory)


def test_loading_in_bf16(target_and_drafter, tmp_path):
    _, drafter = target_and_drafter
    loaded = DFlashDrafter.from_pretrained(drafter.save_pretrained(tmp_path / "d"), dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and loaded.device.type == "cpu"


def test_masked_context_equals_a_shorter_context(target_and_drafter):
    """A block whose mask hides the context from position 6 on sees what a 6-position context gives."""
    target, drafter = target_and_drafter
    features, embeds, _, _ = _draft_hidden(drafter, target)
    positions = torch.arange(6, 11)[None]
    with torch.no_grad():
        short = drafter(embeds, positions, drafter.encode_context(features[:, :6], torch.arange(6)[None]))
        mask = torch.ones(1, 1, 5, 9 + 5, dtype=torch.bool)
        mask[..., 6:9] = False
        full_kv = drafter.encode_context(features, torch.arange(9)[None])
        masked = drafter(embeds, positions, full_kv, attention_mask=mask)
    torch.testing.assert_close(masked, short, rtol=1e-5, atol=1e-5)


def test_no_causal_mask_inside_the_block(target_and_drafter):
    """Every block slot sees every other: changing the last slot's input changes the first slot's output."""
    target, drafter = target_and_drafter
    features, embeds, positions, base = _draft_hidden(drafter, target)
    changed = embeds.clone()
    changed[0, -1] += 1.0
    with torch.no_grad():
        kv = drafter.encode_context(features, torch.arange(features.shape[1])[None])
        out = drafter(changed, positions, kv)
    assert not torch.allclose(out[0, 0], base[0, 0])


def test_config_validation_names_the_field():
    config = DFlashConfig.from_dict(json.loads((FIXTURES / "zlab_qwen3_4b_dflash_b16_config.json").read_text()))
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(config, block_size=0)


# ----------------------------------------------------------------------------- against an independent reference


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    halves = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + halves * sin


@torch.no_grad()
def zlab_reference_logits(drafter, target, features: torch.Tensor, first_token: int, size: int) -> torch.Tensor:
    """DFlash's drafter forward as z-lab's `DFlashDraftModel` computes it, written independently of the project's
    modules: one block [first, MASK...] after the whole context, keys/values over [context features ; block]
    with k_norm over both, rotary at absolute positions (context 0..C-1, block C..C+S-1), q_norm on queries,
    no mask, the target's head on slots 1..S-1. Reads the raw weights only."""
    cfg, w = drafter.config, drafter.state_dict()
    heads, kv_heads, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    c = features.shape[0]
    ids = torch.tensor([first_token] + [drafter.mask_token_id] * (size - 1))
    x = target.get_input_embeddings().weight[ids]
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    all_positions = torch.arange(c + size)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms((h @ w[p + "self_attn.q_proj.weight"].T).view(size, heads, d), w[p + "self_attn.q_norm.weight"], eps)
        both = torch.cat([ctx, h])
        k = _rms((both @ w[p + "self_attn.k_proj.weight"].T).view(c + size, kv_heads, d), w[p + "self_attn.k_norm.weight"], eps)
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(c + size, kv_heads, d)
        q = _rope(q.transpose(0, 1), all_positions[c:], cfg.rope_theta)
        k = _rope(k.transpose(0, 1), all_positions, cfg.rope_theta).repeat_interleave(heads // kv_heads, dim=0)
        v = v.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        attention = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1) @ v  # (heads, S, d)
        x = x + attention.transpose(0, 1).reshape(size, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return target.get_output_embeddings()(_rms(x, w["norm.weight"], eps)[1:])


def test_the_drafting_primitive_equals_an_independent_zlab_style_forward():
    """Blocks at several anchors, of several sizes, in one primitive call: each block's logits equal the
    reference's for that block alone over exactly the context before its anchor. On random weights (GQA,
    several layers), nothing shared with the project's drafter code but the weights."""
    shape = ModelShape(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, drafter_layers=3, init_std=0.2)
    target = random_target(80, shape, seed=3)
    drafter = drafter_for(target, shape, mask_token_id=79, seed=4)
    ids = torch.randint(0, 78, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden_states = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)[0]
    with torch.no_grad():
        context_kv = drafter.encode_context(features[None], torch.arange(24)[None])
    # Over one shared context the blocks are packed PACKED_SLOTS // width to a row: 4 blocks in one row, then 7
    # blocks in two rows of 4 (the last filled up with a copy).
    cases = [([6, 11, 17, 23], [5, 2, 8, 3], 8), ([2, 5, 6, 11, 14, 17, 23], [16, 2, 9, 3, 12, 1, 7], 16)]
    for anchor_list, size_list, width in cases:
        anchors, sizes = torch.tensor(anchor_list), torch.tensor(size_list)
        with torch.no_grad():
            blocks = Blocks(ids[0, anchors], anchors, sizes, width)
            hidden = drafter.draft_over_one_context(target.get_input_embeddings(), context_kv, blocks, mask_token_id=79)
            logits = target.get_output_embeddings()(hidden[:, 1:])
        assert hidden.shape == (len(anchor_list), width, shape.hidden_size)
        for row, (anchor, size) in enumerate(zip(anchor_list, size_list, strict=True)):
            expected = zlab_reference_logits(drafter, target, features[:anchor], int(ids[0, anchor]), size)
            torch.testing.assert_close(logits[row, : size - 1], expected, rtol=1e-4, atol=1e-4)
        # Deferred, the last layer's per-token part runs for the chosen slots of the chosen blocks only.
        with torch.no_grad():
            deferred = drafter.draft_over_one_context(
                target.get_input_embeddings(), context_kv, blocks, 79, defer_last_layer=True
            )
            chosen = torch.tensor([len(anchor_list) - 1, 0])
            torch.testing.assert_close(deferred.hidden(chosen, 2, 5), hidden[chosen, 2:5], rtol=1e-5, atol=1e-5)

