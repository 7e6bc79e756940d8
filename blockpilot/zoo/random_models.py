"""Randomly initialised models: a target (Qwen3, Llama, Qwen2 or Qwen3-MoE), its tokenizer and a DFlash drafter.

For smoke tests and first-time users: everything runs, nothing is learned (tau stays near 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockpilot.models.drafter import DFlashConfig, DFlashDrafter, dflash_target_layer_ids
from blockpilot.models.loading import SpeculativeModels, check_drafter_fits_target, resolve_device_dtype
from blockpilot.options import RANDOM_FAMILIES


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a target/drafter pair."""

    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    drafter_layers: int = 1
    num_feature_layers: int = 2
    feature_layers: tuple[int, ...] | None = None  # target layers the drafter reads; None: DFlash's rule
    block_size: int = 8
    max_positions: int = 2048
    init_std: float = 0.02
    num_experts: int = 8  # a Qwen3-MoE target's experts a sparse layer, each token's top experts_per_token
    experts_per_token: int = 2
    expert_intermediate_size: int = 32


def random_target(
    vocab_size: int,
    shape: ModelShape = ModelShape(),
    *,
    family: str = "qwen3",
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    tie_word_embeddings: bool = True,
    rope_parameters: dict[str, Any] | None = None,
    attention_bias: bool = False,
) -> Any:
    """A randomly initialised causal LM of `family` (transformers' own class: `Qwen3ForCausalLM`,
    `LlamaForCausalLM`, `Qwen2ForCausalLM`, which has q/k/v biases whatever `attention_bias` says,
    `Qwen3MoeForCausalLM`, every layer sparse, with the shape's experts) at `shape`;
    `rope_parameters` as transformers takes them (default: the class's own)."""
    import transformers

    classes = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    if family not in classes:
        raise ValueError(f"family must be one of {RANDOM_FAMILIES}, got {family!r}")
    config_class, model_class = classes[family]
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        initializer_range=shape.init_std,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    if rope_parameters is not None:
        fields["rope_parameters"] = rope_parameters
    if family == "qwen2":  # its head size is the width over the heads
        if shape.head_dim * shape.num_heads != shape.hidden_size:
            raise ValueError(f"a Qwen2 target's head_dim is hidden_size / num_heads; {shape} does not have that")
    else:
        fields.update(head_dim=shape.head_dim, attention_bias=attention_bias)
    if family == "qwen3_moe":
        fields.update(
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.experts_per_token,
            moe_intermediate_size=shape.expert_intermediate_size,
            norm_topk_prob=True,
        )
    torch.manual_seed(seed)
    model = model_class(config_class(**fields)).eval()
    if eos_token_id is not None:
        model.generation_config.eos_token_id = eos_token_id
        model.generation_config.pad_token_id = pad_token_id
    return model


def drafter_for(
    target: Any,
    shape: ModelShape = ModelShape(),
    *,
    mask_token_id: int,
    seed: int = 0,
    target_layer_ids: list[int] | None = None,
) -> DFlashDrafter:
    """A randomly initialised DFlash drafter that reads `target`'s hidden states."""
    target_config = target.config
    num_target_layers = target_config.num_hidden_layers
    config = DFlashConfig(
        hidden_size=target_config.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.drafter_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=target.get_output_embeddings().weight.shape[0],
        block_size=shape.block_size,
        target_layer_ids=list(
            target_layer_ids
            or shape.feature_layers
            or dflash_target_layer_ids(num_target_layers, shape.num_feature_layers)
        ),
        num_target_layers=num_target_layers,
        mask_token_id=mask_token_id,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=float(target_config.rope_parameters["rope_theta"]),
        max_position_embeddings=target_config.max_position_embeddings,
    )
    torch.manual_seed(seed)
    return DFlashDrafter(config).init_weights(shape.init_std).eval()


# A wider initialisation than training uses, so that random models generate varied text instead of one
# token repeated, and their next-token distributions are peaked enough to make greedy ties unlikely.
RANDOM_ZOO_SHAPE = ModelShape(init_std=0.2)


def write_random_zoo(
    out: str | Path, *, seed: int = 0, shape: ModelShape = RANDOM_ZOO_SHAPE, family: str = "qwen3"
) -> dict[str, Path]:
    """Write `target/` (model + tokenizer; a target of `family`) and `drafter/` (z-lab layout) under `out`."""
    from blockpilot.zoo.tokenizer import SPECIAL_TOKENS, train_byte_level_tokenizer

    out = Path(out)
    tokenizer = train_byte_level_tokenizer([], vocab_size=len(SPECIAL_TOKENS) + 256)
    target = random_target(
        len(tokenizer),
        shape,
        family=family,
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    drafter = drafter_for(target, shape, mask_token_id=tokenizer.mask_token_id, seed=seed + 1)
    target_dir, drafter_dir = out / "target", out / "drafter"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    drafter.save_pretrained(drafter_dir)
    return {"target": target_dir, "drafter": drafter_dir}


def random_models_like(
    config: DFlashConfig,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    family: str = "qwen3",
    rope_parameters: dict[str, Any] | None = None,
    tie_word_embeddings: bool = True,
    **target_shape: int,
) -> SpeculativeModels:
    """A random target of `family` and DFlash drafter at the sizes a drafter config names, built on `device`.

    The drafter is `config` itself; the target takes its width, heads, MLP, vocabulary and
    `num_target_layers` (a DFlash drafter copies its target's layer shape), so z-lab's Qwen3-4B b16 config
    gives a Qwen3-4B-shaped pair. For timing at a real model's shape: a cycle's cost does not depend on weight
    values. No tokenizer: prompts are token ids.
    """
    if config.num_target_layers is None:
        raise ValueError("the drafter config names no num_target_layers: the target's depth is unknown")
    if config.mask_token_id is None:
        raise ValueError("the drafter config names no mask_token_id")
    device, dtype = resolve_device_dtype(device, dtype)
    shape = ModelShape(
        hidden_size=config.hidden_size,
        num_layers=config.num_target_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        max_positions=config.max_position_embeddings,
        **target_shape,  # what the target has that a drafter config does not say (an MoE target's experts)
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in place: a 4B model in fp32 on the host would be 16 GB
    try:
        with device:
            target = random_target(
                config.vocab_size,
                shape,
                family=family,
                seed=seed,
                rope_parameters=rope_parameters,
                tie_word_embeddings=tie_word_embeddings,
            )
            torch.manual_seed(seed + 1)
            drafter = DFlashDrafter(config).init_weights(shape.init_std).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    check_drafter_fits_target(target, drafter.config, config.mask_token_id)
    name = f"random {family} ({config.num_target_layers} layers x {config.hidden_size}, vocabulary {config.vocab_size})"
    drafter_name = f"random DFlash b{config.block_size}"
    return SpeculativeModels(target, None, drafter, config.mask_token_id, target_id=name, drafter_id=drafter_name)
