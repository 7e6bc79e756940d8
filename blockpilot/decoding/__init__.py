"""Decoding: prefill, draft, verify, generate; acceptance rules; block-size policies."""

from blockpilot.decoding.acceptance import VERIFY_RULES, VerifyRule
from blockpilot.decoding.policies import (
    BlockSizePolicy,
    CycleState,
    EntropyHeuristic,
    FixedBlockSize,
    PerRequestPolicy,
    PrefillState,
)
from blockpilot.decoding.speculative import Generation, GenerationConfig, GenerationResult, generate

__all__ = [
    "VERIFY_RULES",
    "BlockSizePolicy",
    "CycleState",
    "EntropyHeuristic",
    "FixedBlockSize",
    "Generation",
    "GenerationConfig",
    "GenerationResult",
    "PerRequestPolicy",
    "PrefillState",
    "VerifyRule",
    "generate",
]
