"""Tokens routed to each expert of a mixture-of-experts model, since the worker started.

Sparse layers add their step's counts (``SparseMoeBlock``) through the forward context; the
worker reports the totals per expert and each layer's imbalance (``WorkerCounters``), which
is what operators watch: one hot expert slows every step it is in.
"""

from __future__ import annotations

import numpy as np

from engine.moe_config import MoeConfig


class ExpertTokenCounts:
    def __init__(self, moe: MoeConfig) -> None:
        self.sparse_layers = moe.sparse_layers
        self._row_of_layer = {layer: row for row, layer in enumerate(moe.sparse_layers)}
        # [sparse layers, experts] tokens routed since the start
        self._totals = np.zeros((len(moe.sparse_layers), moe.num_experts), dtype=np.int64)

    def add(self, layer_idx: int, counts: list[int]) -> None:
        """One sparse layer's tokens per expert in one step."""
        self._totals[self._row_of_layer[layer_idx]] += counts

    def per_expert(self) -> tuple[int, ...]:
        """Tokens each expert took, summed over the sparse layers."""
        return tuple(int(n) for n in self._totals.sum(axis=0))

    def layer_imbalance(self) -> tuple[tuple[int, float], ...]:
        """(layer, its busiest expert's tokens over the mean per expert) per sparse layer: 1.0
        is an even spread, num_experts one expert taking all; 0.0 before any token."""
        totals = self._totals.copy()
        means = totals.mean(axis=1)
        busiest = totals.max(axis=1)
        return tuple(
            (layer, float(most / mean) if mean > 0 else 0.0)
            for layer, most, mean in zip(self.sparse_layers, busiest, means, strict=True)
        )
