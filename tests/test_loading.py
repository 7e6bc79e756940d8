"""Loading target, drafter and tokenizer from local folders; mismatches fail early and clearly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockpilot.models import (
    MASK_TOKEN,
    check_drafter_fits_target,
    load_models,
    resolve_device_dtype,
    resolve_mask_token_id,
)
from blockpilot.models.hub import resolve_model_dir


def test_random_zoo_loads_with_plain_transformers(random_zoo):
    target = AutoModelForCausalLM.from_pretrained(random_zoo["target"])
    assert type(target).__name__ == "Qwen3ForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(random_zoo["target"])
    assert tokenizer.mask_token == MASK_TOKEN


def test_load_models_resolves_mask_and_stop_tokens(random_models):
    tokenizer = random_models.tokenizer
    assert random_models.mask_token_id == tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    assert random_models.stop_token_ids() == [tokenizer.eos_token_id]
    assert random_models.train_block_size == random_models.drafter.block_size
    assert random_models.device.type == "cpu" and random_models.target.dtype == torch.float32


def test_chat_prompt_goes_through_the_template(random_models):
    ids = random_models.encode_prompt("hello")
    text = random_models.tokenizer.decode(ids)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    raw = random_models.encode_prompt("hello", chat=False)
    assert random_models.tokenizer.decode(raw) == "hello"


def test_default_device_and_dtype():
    device, dtype = resolve_device_dtype("cpu", None)
    assert device.type == "cpu" and dtype == torch.float32
    assert resolve_device_dtype("cpu", "bf16")[1] == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_device_dtype("cpu", "float8")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden_size", 32, "hidden size mismatch: drafter hidden_size=32, target hidden_size=64"),
        ("vocab_size", 999, "vocabulary mismatch: drafter vocab_size=999"),
        ("target_layer_ids", [0, 7], r"target layer ids out of range: \[7\]"),
        ("num_target_layers", 36, "made for a 36-layer target; this target has 4 layers"),
    ],
)
def test_mismatches_fail_early(random_models, field, value, message):
    config = dataclasses.replace(random_models.drafter.config, **{field: value})
    with pytest.raises(ValueError, match=message):
        check_drafter_fits_target(random_models.target, config, random_models.mask_token_id)


def test_mask_token_outside_vocabulary(random_models):
    with pytest.raises(ValueError, match="mask token id 5000 is outside"):
        check_drafter_fits_target(random_models.target, random_models.drafter.config, 5000)


def test_missing_mask_token(random_models):
    config = dataclasses.replace(random_models.drafter.config, mask_token_id=None)
    assert resolve_mask_token_id(config, random_models.tokenizer) == random_models.mask_token_id
    with pytest.raises(ValueError, match="missing mask token"):
        resolve_mask_token_id(config, None)


def test_missing_folders_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_models(tmp_path / "does-not-exist")
    with pytest.raises(FileNotFoundError, match="could not be fetched"):
        resolve_model_dir("nobody/no-such-model")  # HF_HUB_OFFLINE=1: a hub id fails here, clearly


def test_a_hub_download_takes_what_loading_reads(monkeypatch, tmp_path):
    """Llama's repository also holds its weights for Meta's code (`original/`) and may hold `.bin` copies: a
    target's download matches only configs, safetensors and tokenizer files; a drafter's, configs and weights."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from blockpilot.models.hub import DRAFTER_FILES

    asked = []
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo, allow_patterns: asked.append(allow_patterns) or tmp_path
    )
    assert resolve_model_dir("meta-llama/Llama-3.1-8B-Instruct") == tmp_path
    repository = [
        "config.json", "generation_config.json", "model-00001-of-00004.safetensors", "model.safetensors.index.json",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "original/consolidated.00.pth",
        "pytorch_model-00001-of-00004.bin", "LICENSE", "README.md", "USE_POLICY.md",
    ]  # fmt: skip
    taken = list(filter_repo_objects(repository, allow_patterns=asked[0]))
    assert taken == [name for name in repository if name.endswith((".json", ".safetensors"))]
    assert resolve_model_dir("z-lab/Qwen3-8B-DFlash-b16", allow_patterns=DRAFTER_FILES) == tmp_path
    assert asked[1] == DRAFTER_FILES
