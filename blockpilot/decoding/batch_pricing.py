"""Whether a batch's cycle drafts at all.

A cycle computes its widest row's width for every row, so under load one row's draft costs the whole batch. Before
a chain cycle of several rows where only adaptive policies chose to draft (a fixed b is the request's own choice),
the engine compares the batch's expected tokens a second at the chosen width with an autoregressive cycle's, each
priced by the engine's measured cycles at that row bucket (`Engine._measured_prices`); where autoregression wins,
every row runs b = 1 this cycle (lossless: any b is), and its policy chooses again after it. At one row the policy's
own choice stands.

A row's expected tokens at b: its chain's slots are accepted independently at the row's slot acceptance rate a (the
drafted slots it kept over those tried up to each first rejection, shrunk toward the rate of every row of the engine
by `PRIOR_SLOTS` slots), so a cycle commits (1 - a^b) / (1 - a) tokens, the target's own included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PRIOR_SLOTS = 4  # how many drafted slots the engine-wide rate counts for in a row's own


@dataclass
class SlotAcceptance:
    """The drafted slots a row (or every row) kept, and how many of its drafting cycles rejected one."""

    accepted: int = 0
    rejected: int = 0

    def add(self, block_size: int, committed: int) -> None:
        """A chain cycle of `block_size` that committed `committed` tokens (an autoregressive one tells nothing)."""
        if block_size > 1:
            self.accepted += committed - 1
            self.rejected += committed < block_size

    @property
    def tried(self) -> int:
        return self.accepted + self.rejected

    def rate(self, prior: float) -> float:
        """The slot acceptance rate, shrunk toward `prior` by `PRIOR_SLOTS` slots."""
        return (self.accepted + PRIOR_SLOTS * prior) / (self.tried + PRIOR_SLOTS)


def expected_commits(rate: float, block_size: int) -> float:
    """Tokens a chain of `block_size` commits when each drafted slot is accepted at `rate`, given its predecessors."""
    if rate >= 1.0:
        return float(block_size)
    return (1.0 - rate**block_size) / (1.0 - rate)


def drafting_pays(expected: Sequence[float], draft_price: float, autoregressive_price: float) -> bool:
    """Whether a cycle whose rows commit `expected` tokens at `draft_price` seconds commits at least as many tokens a
    second as an autoregressive cycle of the same rows (one token each) at `autoregressive_price`."""
    return sum(expected) * autoregressive_price >= len(expected) * draft_price
