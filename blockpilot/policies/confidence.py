"""The confidence rule (`blockpilot.predictor.confidence`) as a per-step policy: whether to draft, and how wide,
before every cycle, from the anchor's top-1 probability the cycle computed and the last cycle's outcome, priced by
the engine's measured cycles."""

from __future__ import annotations

from collections.abc import Sequence

from blockpilot.policies.base import BlockSizePolicy, CycleState, PrefillState
from blockpilot.predictor.confidence import FIRST_OR_AUTOREGRESSIVE, ConfidenceRule, DraftRecord, cycle_outcome

DRAFT_RECORD = "confidence_drafts"  # where a request's `DraftRecord` lives in its `PrefillState.derived`


def draft_record(prefill: PrefillState | None) -> DraftRecord:
    """The request's record of its drafts against the rule (a new one where a cycle carries no prefill state)."""
    return prefill.derived.setdefault(DRAFT_RECORD, DraftRecord()) if prefill is not None else DraftRecord()


class ConfidencePolicy(BlockSizePolicy):
    """b before every cycle from `ConfidenceRule.choose`; the first from the prefill's distribution. Priced by the
    engine's measured cycles where it has them (`measured_prices`), else by the rule's calibrated curve alone; what
    the table expects of drafts corrected by the request's own (`DraftRecord`)."""

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
        return self.rule.choose(
            prefill.temperature, float(top[0]), FIRST_OR_AUTOREGRESSIVE, prices, draft_record(prefill)
        )

    def autoregressive_for_good(
        self, prefill: PrefillState, block_size: int, option_price: float = 0.0, saves: float | None = None
    ) -> bool:
        """A row that starts autoregressive where what the rule's drafts save, as the engine measured it (`saves`),
        else as the labels tell at this temperature and these prices (`ConfidenceRule.drafting_saves`: at T = 1 on
        the mini zoo the rule drafted none of 425 cycles and paid 12% for the option), does not pay for keeping the
        option."""
        if block_size != 1:
            return False
        if saves is None:
            saves = self.rule.drafting_saves(prefill.temperature, prefill.prices if self.measured_prices else None)
        return saves <= option_price

    def next_block_sizes(self, cycles: Sequence[CycleState]) -> list[int]:
        choose, measured, sizes = self.rule.choose, self.measured_prices, []
        for cycle in cycles:
            record = draft_record(cycle.prefill)
            record.settle(cycle.block_size, cycle.acceptance_length)
            if cycle.anchor_confidence is None:
                sizes.append(cycle.block_size)
                continue
            outcome = cycle_outcome(cycle.block_size, cycle.acceptance_length)
            prices = cycle.prices if measured else None
            sizes.append(choose(cycle.temperature, cycle.anchor_confidence, outcome, prices, record))
        return sizes
