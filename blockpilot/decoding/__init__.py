"""Decoding: the engine (one request or a batch, one code path, compiled or not), its requests and results,
acceptance rules. Block-size policies are `blockpilot.policies`."""

from blockpilot.decoding.acceptance import VERIFY_RULES, VerifyRule
from blockpilot.decoding.engine import Engine, generate, generate_many
from blockpilot.decoding.request import GenerationConfig, GenerationRequest, GenerationResult
from blockpilot.decoding.rows import RowUpdate

__all__ = [
    "VERIFY_RULES",
    "Engine",
    "GenerationConfig",
    "GenerationRequest",
    "GenerationResult",
    "RowUpdate",
    "VerifyRule",
    "generate",
    "generate_many",
]
