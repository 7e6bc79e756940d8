"""Block-size policies: the contract and its state (`base`), one module per family (`fixed`, `learned`, `step`)
and the resolver that builds any of them from a spec (`resolve`). Only the contract is imported here, so the
engine and the predictor can read it without loading the families."""

from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState, distribution_summary

__all__ = ["BlockSizePolicy", "CycleState", "PrefillState", "distribution_summary"]
