"""Maps sequences onto physical blocks: prefix-cache lookup, slot allocation, copy-on-write.

Verbs, in the order a sequence meets them:
  attach_cached_prefix (or adopt, for KV received) -> release_outside_window (a model whose
  every layer has a sliding window) and can_allocate / allocate_slots (every step) -> fork
  (n > 1) -> free

They are the only writers of a sequence's block table. Blocks for KV that has yet to arrive (a
decode worker's hand-off) are taken with ``reserve`` and, unless a sequence adopts them, given
back with ``release``. Where every layer has an attention window, a hand-off moves only the
prompt's blocks from the first one the next token's window reaches (``first_moved_block``):
the decode side reserves those alone, and ``adopt`` marks the ones before them RELEASED.
"""

from __future__ import annotations

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.prefix_hash import extend_block_hashes
from engine.sequence import Sequence

# a block-table entry whose block was given back (outside the attention window); never read
RELEASED = -1


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        long_prompt_length: int | None = None,
        attention_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # a model whose KV differs for prompts past this length (LongRoPE: their frequencies are
        # the long set): such prompts' blocks are salted apart from shorter prompts' (None: no
        # such length)
        self.long_prompt_length = long_prompt_length
        # every layer of the model sees only this many positions (a sliding window): a
        # sequence's blocks wholly before its next token's window are given back as it goes
        # (None: sequences keep all their blocks)
        self.attention_window = attention_window

    def _salt(self, seq: Sequence) -> str | None:
        """The prefix-hash salt of ``seq``'s blocks: its tenant's, and the long-prompt mark."""
        limit = self.long_prompt_length
        if limit is None or seq.num_prompt_tokens <= limit:
            return seq.cache_salt
        return f"{seq.cache_salt or ''}\x00long-prompt"

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def attach_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        Returns the number of tokens whose KV is thereby already computed. At least one token is
        always left to compute, since its logits are needed to sample the next token.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self._salt(seq))
        max_cached_blocks = (seq.num_tokens - 1) // self.block_size
        for block_hash in seq.block_hashes[:max_cached_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            self.pool.incref(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks that no query of it will read again: those wholly before
        the attention window of its next token (its table keeps RELEASED in their place, so
        logical block indices stay put). Nothing without an attention window, nor for a
        prompt whose KV a decode worker will take (its hand-off moves the prompt's blocks from
        ``first_moved_block``)."""
        window = self.attention_window
        if window is None or seq.prefill_only:
            return
        first_visible = seq.num_computed_tokens - window + 1  # the next token's window start
        num_dead = min(max(first_visible, 0) // self.block_size, len(seq.block_table))
        for index in range(seq.num_released_blocks, num_dead):
            self.pool.free(seq.block_table[index])
            seq.block_table[index] = RELEASED
        seq.num_released_blocks = max(seq.num_released_blocks, num_dead)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to allocate so the next ``num_new_tokens`` have slots (incl. a CoW copy)."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = num_blocks_for(total, self.block_size) - len(seq.block_table)
        return max(needed, 0) + (1 if self._needs_copy_on_write(seq) else 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next ``num_new_tokens``; returns block copies (src, dst) to perform.

        A partially filled block shared with a sibling (after a fork) is copied before this
        sequence writes into it.
        """
        copies: list[tuple[int, int]] = []
        if self._needs_copy_on_write(seq):
            logical = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[logical]
            private = self.pool.allocate()
            self.pool.free(shared)
            seq.block_table[logical] = private
            copies.append((shared, private))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < num_blocks_for(total, self.block_size):
            seq.block_table.append(self.pool.allocate())
        return copies

    def commit_computed(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register newly filled blocks of ``seq`` in the prefix cache (call after a step, or
        once a step is launched: the device runs steps in order, so a later step reading the
        blocks runs after this one's writes): those within its first ``num_computed`` tokens
        (default: ``seq.num_computed_tokens``) whose token ids are known.

        Only blocks whose every slot is computed: ``block_hashes`` may already hold the hash of
        a block a chunked prefill has only half written (``attach_cached_prefix`` hashes the
        whole prompt), and a cache hit on it would read the unwritten slots. Blocks committed
        by an earlier step are not visited again, so a step costs what it filled, not the
        sequence's length.
        """
        if not self.enable_prefix_caching:
            return
        if num_computed is None or num_computed > seq.num_computed_tokens:  # (recomputing)
            num_computed = seq.num_computed_tokens
        num_computed = min(num_computed, seq.num_tokens)  # not a token still to be sampled
        num_full_blocks = num_computed // self.block_size
        if num_full_blocks <= seq.num_committed_blocks:
            return
        extend_block_hashes(
            seq.block_hashes, seq.token_ids, self.block_size, self._salt(seq), num_full_blocks
        )
        for index in range(seq.num_committed_blocks, num_full_blocks):
            self.pool.register(seq.block_table[index], seq.block_hashes[index])
        seq.num_committed_blocks = num_full_blocks

    def adopt(self, seq: Sequence, block_ids: list[int], *, share: bool) -> None:
        """Give a sequence with no blocks the blocks holding its prompt's KV, received from
        elsewhere (a prefill worker's hand-off: the prompt's blocks from
        ``first_moved_block`` on, the ones before it RELEASED); ``share``: they are another
        sample's too, so take another reference."""
        assert not seq.block_table
        num_left_behind = num_blocks_for(seq.num_prompt_tokens, self.block_size) - len(block_ids)
        assert num_left_behind == self.first_moved_block(seq.num_prompt_tokens)
        if share:
            for block_id in block_ids:
                self.pool.incref(block_id)
        seq.block_table = BlockTable([RELEASED] * num_left_behind + block_ids)
        seq.num_released_blocks = num_left_behind
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_committed_blocks = num_left_behind  # never here: nothing of them to cache
        self.commit_computed(seq)

    def blocks_to_hand_off(self, seq: Sequence) -> list[int]:
        """The blocks of a prefilled prompt its hand-off moves: from ``first_moved_block``."""
        return list(seq.block_table)[self.first_moved_block(seq.num_prompt_tokens) :]

    def first_moved_block(self, num_prompt_tokens: int) -> int:
        """The first of a prompt's blocks its hand-off moves: where every layer has an
        attention window, the blocks wholly before the window of the token after the prompt
        would be given back on arrival, so they stay behind; else 0, the whole prompt."""
        window = self.attention_window
        if window is None:
            return 0
        first_visible = max(num_prompt_tokens - window + 1, 0)
        return min(
            first_visible // self.block_size, num_blocks_for(num_prompt_tokens, self.block_size)
        )

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Fresh blocks for the KV a hand-off of a ``num_tokens``-token prompt moves (from
        ``first_moved_block``), or None when they do not fit now."""
        num_blocks = num_blocks_for(num_tokens, self.block_size) - self.first_moved_block(
            num_tokens
        )
        if num_blocks > self.pool.num_free_blocks:
            return None
        return [self.pool.allocate() for _ in range(num_blocks)]

    def release(self, block_ids: list[int]) -> None:
        """Give back blocks taken with ``reserve`` that no sequence adopted."""
        for block_id in block_ids:
            self.pool.free(block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (copy-on-write on the partial one)."""
        for block_id in parent.block_table[parent.num_released_blocks :]:
            self.pool.incref(block_id)
        child.block_table = BlockTable(parent.block_table)
        child.num_released_blocks = parent.num_released_blocks
        child.block_hashes = list(parent.block_hashes)
        child.num_committed_blocks = parent.num_committed_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (newest first, so older prefix blocks stay cached longer)."""
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self.pool.free(block_id)
        seq.block_table = BlockTable()
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_released_blocks = 0

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """The block the next token lands in is partially filled and shared."""
        offset = seq.num_computed_tokens % self.block_size
        if offset == 0:
            return False
        shared_block = seq.block_table[seq.num_computed_tokens // self.block_size]
        return self.pool.ref_count(shared_block) > 1
