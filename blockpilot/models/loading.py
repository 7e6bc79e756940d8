"""Loading target, drafter and tokenizer, and checking early that they fit together."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockpilot.models.attention import register_grouped_sdpa
from blockpilot.models.drafter import DFlashConfig, DFlashDrafter
from blockpilot.models.hub import resolve_model_dir

MASK_TOKEN = "<|MASK|>"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): what a wall-clock timing of GPU work needs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU (what DFlash checkpoints are trained in), fp32 on the CPU (exact and fast enough)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device_dtype(
    device: str | torch.device | None, dtype: str | torch.dtype | None
) -> tuple[torch.device, torch.dtype]:
    resolved_device = torch.device(device) if device is not None else default_device()
    if isinstance(dtype, str):
        names = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
        dtype = names[dtype]
    return resolved_device, dtype or default_dtype(resolved_device)


def load_target(
    path_or_id: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> Any:
    """The target causal LM (`AutoModelForCausalLM`) in eval mode, SDPA attention (grouped-query heads under a
    mask without copies: `grouped_query_attention`)."""
    from transformers import AutoModelForCausalLM

    device, dtype = resolve_device_dtype(device, dtype)
    directory = resolve_model_dir(path_or_id)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=register_grouped_sdpa())
    return model.to(device).eval()


def cache_keyword(model: Any) -> str:
    """The keyword a transformers causal LM takes its key/value cache by: `cache` in the transformers this project
    installs, `past_key_values` in older ones (the GPU machine's 5.17). The old name still works in the new version
    but warns on every call."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def load_tokenizer(path_or_id: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(path_or_id))


def target_dims(target: Any) -> tuple[int, int, int]:
    """(hidden size, number of layers, vocabulary size of the output head) of a causal LM."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    vocab = target.get_output_embeddings().weight.shape[0]
    return int(config.hidden_size), int(config.num_hidden_layers), int(vocab)


def resolve_mask_token_id(drafter_config: DFlashConfig, tokenizer: Any | None) -> int:
    """The drafter's own mask id, else the tokenizer's mask token, else its `<|MASK|>` token."""
    if drafter_config.mask_token_id is not None:
        return drafter_config.mask_token_id
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return int(tokenizer.mask_token_id)
        token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if token_id is not None and token_id != getattr(tokenizer, "unk_token_id", None):
            return int(token_id)
    raise ValueError(
        "missing mask token: the drafter config has no dflash_config.mask_token_id and the tokenizer has "
        f"neither a mask token nor {MASK_TOKEN!r}"
    )


def check_drafter_fits_target(target: Any, drafter_config: DFlashConfig, mask_token_id: int) -> None:
    """Fail early, naming the mismatch, rather than deep inside the first forward pass."""
    hidden, num_layers, vocab = target_dims(target)
    if drafter_config.hidden_size != hidden:
        raise ValueError(
            f"hidden size mismatch: drafter hidden_size={drafter_config.hidden_size}, target hidden_size={hidden}"
        )
    if drafter_config.vocab_size != vocab:
        raise ValueError(
            f"vocabulary mismatch: drafter vocab_size={drafter_config.vocab_size}, target head has {vocab} rows"
        )
    out_of_range = [i for i in drafter_config.target_layer_ids if not 0 <= i < num_layers]
    if out_of_range:
        raise ValueError(
            f"target layer ids out of range: {out_of_range} (of {drafter_config.target_layer_ids}); "
            f"the target has layers 0..{num_layers - 1}"
        )
    if drafter_config.num_target_layers is not None and drafter_config.num_target_layers != num_layers:
        raise ValueError(
            f"the drafter was made for a {drafter_config.num_target_layers}-layer target; "
            f"this target has {num_layers} layers"
        )
    if not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask token id {mask_token_id} is outside the target vocabulary [0, {vocab})")


@dataclass
class SpeculativeModels:
    """Target, optional drafter and tokenizer, checked to fit together, on one device."""

    target: Any
    tokenizer: Any | None
    drafter: DFlashDrafter | None = None
    mask_token_id: int | None = None
    target_id: str = ""
    drafter_id: str = ""

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def train_block_size(self) -> int | None:
        return self.drafter.block_size if self.drafter is not None else None

    def stop_token_ids(self) -> list[int]:
        """EOS ids of the generation config and the tokenizer."""
        ids: list[int] = []
        generation_config = getattr(self.target, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        return sorted(set(ids))

    def sampling_defaults(self) -> dict[str, float | int]:
        """The sampling the target's `generation_config` recommends, what a generation that does not say gets (as
        in transformers' `generate` and vLLM): `temperature`, `top_k` (> 0) and `top_p` (< 1), each where the
        config sets it (Qwen3: 0.6, 20, 0.95; Llama 3.1 Instruct: 0.6 and top_p 0.9). `do_sample` is not read:
        a temperature of 0 is how a request asks for greedy decoding here."""
        config = getattr(self.target, "generation_config", None)
        found: dict[str, float | int] = {}
        temperature, top_k, top_p = (getattr(config, name, None) for name in ("temperature", "top_k", "top_p"))
        if temperature is not None:
            found["temperature"] = float(temperature)
        if top_k is not None and int(top_k) > 0:
            found["top_k"] = int(top_k)
        if top_p is not None and float(top_p) < 1:
            found["top_p"] = float(top_p)
        return found

    def encode_prompt(self, prompt: str | list[dict[str, str]], *, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string or chat messages, through the chat template when there is one."""
        if self.tokenizer is None:
            raise ValueError("no tokenizer loaded: pass token ids instead of text")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not isinstance(prompt, str):
            raise ValueError("chat messages need a tokenizer with a chat template")
        return text_prefix(self.tokenizer) + self.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def text_prefix(tokenizer: Any) -> list[int]:
    """The ids `tokenizer` puts before any text when it adds its special tokens (Llama's BOS; none for Qwen's): what
    raw text starts with, as the model saw it in training. (A chat template writes its own.)"""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x", add_special_tokens=True)["input_ids"]
    if len(full) > len(plain) and full[len(full) - len(plain) :] == plain:
        return list(full[: len(full) - len(plain)])
    return []


def load_models(
    target: str | Path,
    drafter: str | Path | None = None,
    *,
    tokenizer: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> SpeculativeModels:
    """Load target (+ drafter) (+ tokenizer, by default from the target's folder) and check the fit."""
    device, dtype = resolve_device_dtype(device, dtype)
    target_model = load_target(target, device=device, dtype=dtype)
    tokenizer_model = load_tokenizer(tokenizer or target)
    if drafter is None:
        return SpeculativeModels(target_model, tokenizer_model, target_id=str(target))
    drafter_model = DFlashDrafter.from_pretrained(drafter, device=device, dtype=dtype)
    mask_token_id = resolve_mask_token_id(drafter_model.config, tokenizer_model)
    check_drafter_fits_target(target_model, drafter_model.config, mask_token_id)
    return SpeculativeModels(
        target_model, tokenizer_model, drafter_model, mask_token_id, target_id=str(target), drafter_id=str(drafter)
    )
