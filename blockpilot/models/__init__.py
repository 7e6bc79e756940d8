"""Models: the DFlash drafter and the loading of target, drafter and tokenizer."""

from blockpilot.models.drafter import DFlashConfig, DFlashDrafter, dflash_target_layer_ids
from blockpilot.models.loading import (
    MASK_TOKEN,
    SpeculativeModels,
    check_drafter_fits_target,
    load_models,
    load_target,
    load_tokenizer,
    resolve_device_dtype,
    resolve_mask_token_id,
)

__all__ = [
    "MASK_TOKEN",
    "DFlashConfig",
    "DFlashDrafter",
    "SpeculativeModels",
    "check_drafter_fits_target",
    "dflash_target_layer_ids",
    "load_models",
    "load_target",
    "load_tokenizer",
    "resolve_device_dtype",
    "resolve_mask_token_id",
]
