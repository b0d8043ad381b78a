"""The one global of the engine: what the current forward pass needs besides its inputs.

The model runner sets it around each forward with ``set_forward_context``; attention layers
read it with ``get_forward_context`` to find their slice of the KV cache and the batch layout.
It is per thread, so engines of several workers in one process (tests, a colocated node) can
step at the same time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.attention.backend import AttentionBackend
    from engine.attention.metadata import AttentionMetadata
    from engine.models.expert_tokens import ExpertTokenCounts


@dataclass(frozen=True, slots=True)
class ForwardContext:
    # layout of the flattened token batch, with KV cache group 0's block tables and slots
    attn_metadata: AttentionMetadata
    # [num_slots, kv_planes, num_blocks, block_size, num_kv_heads, head_dim]: a layer's slot
    # is its place in its cache group (engine/kv_cache/cache_groups.py)
    kv_cache: torch.Tensor
    attn_backend: AttentionBackend  # computes attention over the paged cache
    # a mixture-of-experts model's sparse layers count their tokens per expert here (None: not)
    expert_tokens: ExpertTokenCounts | None = None
    # the same batch with each further cache group's block tables and slots (groups 1, 2, ...)
    later_group_metadata: tuple[AttentionMetadata, ...] = ()

    @classmethod
    def for_groups(
        cls,
        group_metadata: tuple[AttentionMetadata, ...],  # each cache group's, group 0 first
        kv_cache: torch.Tensor,
        attn_backend: AttentionBackend,
        expert_tokens: ExpertTokenCounts | None = None,
    ) -> ForwardContext:
        first, *later = group_metadata
        return cls(first, kv_cache, attn_backend, expert_tokens, tuple(later))

    def group_metadata(self, group: int) -> AttentionMetadata:
        """The batch's layout with cache group ``group``'s block tables and slots."""
        return self.attn_metadata if group == 0 else self.later_group_metadata[group - 1]


class _State(threading.local):
    current: ForwardContext | None = None


_state = _State()


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    previous = _state.current
    _state.current = context
    try:
        yield
    finally:
        _state.current = previous


def get_forward_context() -> ForwardContext:
    context = _state.current
    if context is None:
        raise RuntimeError("no forward context is set: run the model inside set_forward_context()")
    return context
