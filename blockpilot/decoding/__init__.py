"""Decoding: the speculative engine (one request or a batch, one code path), acceptance rules, block-size policies."""

from blockpilot.decoding.acceptance import VERIFY_RULES, VerifyRule
from blockpilot.decoding.engine import RowUpdate, SpeculativeEngine, generate, generate_many
from blockpilot.decoding.policies import (
    Autoregressive,
    BlockSizePolicy,
    CycleState,
    EntropyHeuristic,
    FixedBlockSize,
    PerRequestPolicy,
    PrefillState,
)
from blockpilot.decoding.request import GenerationConfig, GenerationRequest, GenerationResult

__all__ = [
    "VERIFY_RULES",
    "Autoregressive",
    "BlockSizePolicy",
    "CycleState",
    "EntropyHeuristic",
    "FixedBlockSize",
    "GenerationConfig",
    "GenerationRequest",
    "GenerationResult",
    "PerRequestPolicy",
    "PrefillState",
    "RowUpdate",
    "SpeculativeEngine",
    "VerifyRule",
    "generate",
    "generate_many",
]
