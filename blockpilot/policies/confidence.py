"""The confidence rule (`blockpilot.predictor.confidence`) as a per-step policy: whether to draft, and how wide,
before every cycle, from the anchor's top-1 probability the cycle computed and the last cycle's outcome, priced by
the engine's measured cycles."""

from __future__ import annotations

from collections.abc import Sequence

from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState
from blockpilot.predictor.confidence import FIRST_OR_AUTOREGRESSIVE, ConfidenceRule, cycle_outcome


class ConfidencePolicy(BlockSizePolicy):
    """b before every cycle from `ConfidenceRule.choose`; the first from the prefill's distribution. Priced by the
    engine's measured cycles where it has them (`measured_prices`), else by the rule's calibrated curve alone."""

    name = "confidence"

    def __init__(self, rule: ConfidenceRule, measured_prices: bool = True) -> None:
        self.rule = rule
        self.measured_prices = measured_prices

    @property
    def block_size_choices(self) -> tuple[int, ...]:
        return self.rule.candidates

    def initial_block_size(self, prefill: PrefillState) -> int:
        _, top = prefill.top_k(1)
        prices = prefill.prices if self.measured_prices else None
        return self.rule.choose(prefill.temperature, float(top[0]), FIRST_OR_AUTOREGRESSIVE, prices)

    def autoregressive_for_good(self, prefill: PrefillState, block_size: int) -> bool:
        """A row that starts autoregressive where the rule, at this temperature and these prices, would stay so
        (`ConfidenceRule.never_drafts`: at T = 1 on the mini zoo it drafted none of 425 cycles and paid 12% for the
        option)."""
        prices = prefill.prices if self.measured_prices else None
        return block_size == 1 and self.rule.never_drafts(prefill.temperature, prices)

    def next_block_sizes(self, cycles: Sequence[CycleState]) -> list[int]:
        choose, measured = self.rule.choose, self.measured_prices
        return [
            cycle.block_size
            if cycle.anchor_confidence is None
            else choose(
                cycle.temperature,
                cycle.anchor_confidence,
                cycle_outcome(cycle.block_size, cycle.acceptance_length),
                cycle.prices if measured else None,
            )
            for cycle in cycles
        ]
