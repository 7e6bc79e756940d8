"""Key/value caches with a row per request and a slot per absolute position.

Row r's token at position p lives at slot p of row r. Each forward pass writes its new keys and values at
the positions it computes them for; attention reads slots [0, span) under a mask that lets a query at
position q see only slots <= q of its own row (the target) or < its block's anchor (the drafter's context).
So a rejected draft needs no crop: its slots lie past the row's committed length, are masked from then on,
and are overwritten by the next cycle. Rows of different lengths share one tensor without compaction. While
drafting, the drafter's blocks borrow the slots past the longest row for their own keys and values (the
verify's context write then rewrites every slot a row will read).

Active rows occupy the first rows of each buffer; a row that leaves is replaced by the last one (one row
copied), so a decoding pass reads plain views, never a gather.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


def _grown(size: int, needed: int, step: int, limit: int | None = None) -> int:
    """A capacity that holds `needed`: doubled (amortized growth), but never past `limit` when it need not be."""
    if needed <= size:
        return size
    grown = max(needed, 2 * size, step)
    return grown if limit is None else max(needed, min(grown, limit))


class SlotStore:
    """Per-layer (keys, values) buffers of shape (rows, heads, positions, head_dim), allocated on first write."""

    def __init__(self, num_layers: int, rows: int = 1, positions: int = 256) -> None:
        self.num_layers = num_layers
        self.row_capacity = rows
        self.position_capacity = positions
        self.row_limit: int | None = None  # the most rows the engine ever writes (its batch, and its prefill row)
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def reserve(self, rows: int, positions: int, position_limit: int | None = None) -> None:
        """Make room for `rows` rows and `positions` positions, keeping what is stored; growth stops at
        `position_limit` (the most any admitted row can need) instead of doubling past it."""
        new_rows = _grown(self.row_capacity, rows, 1, self.row_limit)
        new_positions = _grown(self.position_capacity, positions, 64, position_limit)
        if (new_rows, new_positions) == (self.row_capacity, self.position_capacity):
            return
        for index, pair in enumerate(self.layers):
            if pair is None:
                continue
            grown = []
            for old in pair:
                buffer = old.new_zeros(new_rows, old.shape[1], new_positions, old.shape[3])
                buffer[: old.shape[0], :, : old.shape[2]] = old
                grown.append(buffer)
            self.layers[index] = (grown[0], grown[1])
        self.row_capacity, self.position_capacity = new_rows, new_positions

    def write(
        self,
        layer: int,
        rows: slice,  # consecutive rows written by this pass
        positions: torch.Tensor,  # (n, S) absolute positions of the new entries
        keys: torch.Tensor,  # (n, heads, S, head_dim)
        values: torch.Tensor,
        token_rows: torch.Tensor | None = None,  # packed pass (n = 1): (S,) each entry's row within `rows`
    ) -> None:
        pair = self.layers[layer]
        if pair is None:
            shape = (self.row_capacity, keys.shape[1], self.position_capacity, keys.shape[3])
            pair = (keys.new_zeros(shape), values.new_zeros(shape))
            self.layers[layer] = pair
        if token_rows is not None:
            row_index = (rows.start + token_rows)[None]
        else:
            row_index = torch.arange(rows.start, rows.stop, device=positions.device)[:, None].expand_as(positions)
        pair[0][row_index, :, positions] = keys.transpose(1, 2).to(pair[0].dtype)
        pair[1][row_index, :, positions] = values.transpose(1, 2).to(pair[1].dtype)

    def read(self, layer: int, rows: slice, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slots [0, span) of `rows`: (n, heads, span, head_dim) each."""
        keys, values = self.layers[layer]
        return keys[rows, :, :span], values[rows, :, :span]

    def read_all(self, rows: slice, span: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.read(layer, rows, span) for layer in range(self.num_layers) if self.layers[layer] is not None]

    def release(self) -> None:
        """Free every buffer (an idle engine holds no cache); the next write allocates them anew."""
        self.layers = [None] * self.num_layers
        self.row_capacity, self.position_capacity = 1, 256

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, positions) the buffers hold room for."""
        return self.row_capacity, self.position_capacity

    def move_row(self, source: int, destination: int, length: int) -> None:
        """Copy the first `length` slots of row `source` over row `destination`."""
        for pair in self.layers:
            if pair is not None:
                for buffer in pair:
                    buffer[destination, :, :length] = buffer[source, :, :length]


class TargetSlotCache(Cache):
    """The target's cache for a batch of rows, as a transformers `Cache`: set the window, then run the target.

    `window(rows, positions, span)` says which rows the next forward pass covers, at which positions its
    tokens sit, and how many slots its attention reads; the model's attention layers then call `update`. A packed
    pass (`RaggedTokens`: one sequence of every row's tokens) gives `token_rows`, each token's row; its update
    writes each token into its own row and still returns every row's slots.
    """

    def __init__(self, num_layers: int, rows: int = 1, positions: int = 256) -> None:
        super().__init__(layers=[])
        self.store = SlotStore(num_layers, rows, positions)
        self._rows = slice(0, 0)
        self._positions: torch.Tensor | None = None
        self._token_rows: torch.Tensor | None = None
        self._span = 0

    position_limit: int | None = None  # set by the engine: the most any admitted row can need

    def window(self, rows: slice, positions: torch.Tensor, span: int, token_rows: torch.Tensor | None = None) -> None:
        self.store.reserve(rows.stop, span, self.position_limit)
        self._rows, self._positions, self._span, self._token_rows = rows, positions, span, token_rows

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.store.write(layer_idx, self._rows, self._positions, key_states, value_states, self._token_rows)
        return self.store.read(layer_idx, self._rows, self._span)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._span

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self._span, 0

    def __len__(self) -> int:
        return self.store.num_layers
