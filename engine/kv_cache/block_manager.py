"""Maps sequences onto physical blocks: prefix-cache lookup, slot allocation, copy-on-write.

Verbs, in the order a sequence meets them:
  attach_cached_prefix (or adopt, for KV received) -> release_outside_window and can_allocate /
  allocate_slots (every step) -> fork (n > 1) -> free

They are the only writers of a sequence's block tables: one per KV cache group
(engine/kv_cache/cache_groups.py), all of one length, their blocks drawn from one pool. A group
whose layers see a sliding window gives back the blocks wholly before its next token's window
(RELEASED in their place), so its KV per sequence stays within the window; a group that sees the
whole context keeps every block. Blocks for KV that has yet to arrive (a decode worker's
hand-off) are taken with ``reserve`` and, unless a sequence adopts them, given back with
``release``. A hand-off moves, of each group, the prompt's blocks from the first one the next
token's window reaches (``blocks_to_hand_off``): the decode side reserves those alone, and
``adopt`` marks the ones before them RELEASED.

With a host-memory tier (``num_host_slots``; engine/kv_cache/host_tier.py), the cached blocks
the pool evicts are kept in host memory and a prefix lookup takes them back from there; the
copies each step owes between the tiers are drained with ``take_swaps`` by the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.cache_groups import CacheGroups
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.kv_events import KVEventRecorder
from engine.kv_cache.prefix_hash import (
    BlockHash,
    extend_block_hashes,
    num_servable_blocks,
    servable_block_hashes,
)
from engine.messages.kv_events import KVTier
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
        cache_groups: CacheGroups | None = None,
        kv_events: KVEventRecorder | None = None,  # told of blocks cached and evicted
        num_host_slots: int = 0,  # blocks the host-memory tier holds (0: no host tier)
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # evicted cached blocks go here (engine/kv_cache/host_tier.py); None: they are dropped
        self.host = HostTier(num_host_slots, kv_events) if num_host_slots > 0 else None
        self.pool = BlockPool(num_blocks, enable_prefix_caching, kv_events, self.host)
        # a model whose KV differs for prompts past this length (LongRoPE: their frequencies are
        # the long set): such prompts' blocks are salted apart from shorter prompts' (None: no
        # such length)
        self.long_prompt_length = long_prompt_length
        # each group's attention window (None: it sees the whole context); default: one group
        # that sees it all
        self.windows: tuple[int | None, ...] = (
            (None,) if cache_groups is None else cache_groups.windows
        )

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _salt(self, seq: Sequence) -> str | None:
        """The prefix-hash salt of ``seq``'s blocks: its tenant's, and the long-prompt mark."""
        return self.prompt_salt(seq.num_prompt_tokens, seq.cache_salt)

    def prompt_salt(self, num_prompt_tokens: int, cache_salt: str | None) -> str | None:
        """The prefix-hash salt of a prompt's blocks: its tenant's, and the long-prompt mark."""
        limit = self.long_prompt_length
        if limit is None or num_prompt_tokens <= limit:
            return cache_salt
        return f"{cache_salt or ''}\x00long-prompt"

    def servable_prompt_hashes(
        self, prompt_token_ids: SequenceOf[int], cache_salt: str | None
    ) -> list[BlockHash]:
        """The prefix hashes of the prompt's blocks a cache can serve: its full blocks but the
        one holding its last token (whose logits are computed)."""
        salt = self.prompt_salt(len(prompt_token_ids), cache_salt)
        return servable_block_hashes(prompt_token_ids, self.block_size, salt)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def cached_block_hashes(self) -> dict[tuple[KVTier, int], frozenset[BlockHash]]:
        """The prefix hashes cached, by (tier, cache group), the non-empty ones: what the KV
        events of this manager's pool and host tier add up to."""
        held: dict[tuple[KVTier, int], frozenset[BlockHash]] = {
            ("device", group): hashes for group, hashes in self.pool.cached_hashes().items()
        }
        if self.host is not None:
            held.update(
                (("host", group), hashes) for group, hashes in self.host.cached_hashes().items()
            )
        return held

    def take_swaps(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The host-tier copies the step being built owes (engine/kv_cache/host_tier.py):
        swap-outs (device block, host slot), then swap-ins (host slot, device block)."""
        if self.host is None:
            return (), ()
        return self.host.take_swaps()

    def attach_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix: in
        every group that sees the whole context, each of its blocks; in a windowed group, those
        the window of the first token left to compute reaches (the ones before are RELEASED).

        A block the device cache holds is shared. One only the host tier holds is brought back:
        a fresh device block, registered under its hash, that the step being built fills from
        the host before its forward (a swap-in). Copying a block back costs less than computing
        it again on every device this engine runs on, so a block the host tier holds is always
        taken (a preempted sequence's blocks come back so, instead of being recomputed).

        Returns the number of tokens whose KV is thereby already computed. At least one token is
        always left to compute, since its logits are needed to sample the next token. The lookup
        is counted by ``count_lookup``, once the sequence is admitted.
        """
        assert not seq.block_tables and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self._salt(seq))
        max_cached_blocks = num_servable_blocks(seq.num_tokens, self.block_size)
        hashes = seq.block_hashes[:max_cached_blocks]
        num_hit = self._longest_cached_prefix(hashes)
        seq.prefix_lookup = (min(num_hit + 1, max_cached_blocks), num_hit)
        if num_hit == 0:
            return 0
        self._give_tables(seq)
        num_tokens = num_hit * self.block_size
        loads: list[tuple[int, int, int]] = []  # (group, block index, host slot) to bring back
        for group, table in enumerate(seq.block_tables):
            first_kept = self._first_kept_block(group, num_tokens)
            for index, block_hash in enumerate(hashes[:num_hit]):
                if index < first_kept:
                    table.append(RELEASED)
                    continue
                block_id = self.pool.cached_block(block_hash, group)
                if block_id is None:  # only the host holds it: its device block comes below
                    assert self.host is not None
                    loads.append((group, index, self.host.pin(block_hash, group)))
                    block_id = RELEASED
                else:
                    self.pool.incref(block_id)
                table.append(block_id)
            seq.num_released_blocks[group] = first_kept
        # the shared blocks are held and the slots pinned: these allocations evict neither
        for group, index, slot in loads:
            assert self.host is not None
            block_id = self.pool.allocate()
            self.pool.register(block_id, hashes[index], group)
            self.host.swap_in(slot, block_id)
            seq.block_tables[group][index] = block_id
        if loads and self.host is not None:  # (copied back now, whether or not it is admitted)
            self.host.count_hits(len({index for _, index, _ in loads}))
        seq.num_computed_tokens = num_tokens
        return num_tokens

    def count_lookup(self, seq: Sequence) -> None:
        """Count the prefix lookup ``attach_cached_prefix`` made for ``seq`` (its queried and
        hit blocks), once: when the sequence is admitted with it. A queued head that did not
        fit gives its prefix back and looks it up again on its next try, which counted every
        try's hits (more hits than prompt tokens under memory pressure). (The host tier counts
        the blocks it copies back as it copies them.)"""
        if seq.prefix_lookup is not None:
            self.pool.count_lookups(*seq.prefix_lookup)
            seq.prefix_lookup = None

    def _longest_cached_prefix(self, hashes: list[BlockHash]) -> int:
        """How many of the leading blocks named by ``hashes`` a sequence can take from the
        cache's tiers: every one of them in each group that sees the whole context, and in each
        windowed group the ones the next token's window reaches; so many that the device has
        free blocks for those only the host tier holds."""
        num_hit = len(hashes)
        for group, window in enumerate(self.windows):
            if window is None:
                run = 0
                while run < num_hit and self._is_cached(hashes[run], group):
                    run += 1
                num_hit = run
        counts = [self._running_counts(hashes[:num_hit], g) for g in range(self.num_groups)]
        while num_hit > 0 and not self._can_take(counts, num_hit):
            num_hit -= 1
        return num_hit

    def _is_cached(self, block_hash: BlockHash, group: int) -> bool:
        """A tier (the device or the host) holds ``group``'s block named by ``block_hash``."""
        if self.pool.cached_block(block_hash, group) is not None:
            return True
        return self.host is not None and self.host.slot_of(block_hash, group) is not None

    def _running_counts(self, hashes: list[BlockHash], group: int) -> list[tuple[int, int, int]]:
        """For i = 0 .. len(hashes): of ``group``'s first i blocks named by ``hashes``, how many
        no tier holds, how many the host tier alone holds (to bring back), and how many the
        device holds unreferenced (taking them leaves fewer free blocks)."""
        running = [(0, 0, 0)]
        for block_hash in hashes:
            missing, loads, revived = running[-1]
            block_id = self.pool.cached_block(block_hash, group)
            if block_id is not None:
                revived += int(self.pool.ref_count(block_id) == 0)
            elif self.host is not None and self.host.slot_of(block_hash, group) is not None:
                loads += 1
            else:
                missing += 1
            running.append((missing, loads, revived))
        return running

    def _can_take(self, counts: list[list[tuple[int, int, int]]], num_blocks: int) -> bool:
        """Whether a sequence can take ``num_blocks`` leading blocks (``counts``: each group's
        ``_running_counts``): every group's blocks the next token sees are held, and those to
        bring back from the host have free device blocks to land in."""
        num_loads = num_revived = 0
        for group, running in enumerate(counts):
            first = self._first_kept_block(group, num_blocks * self.block_size)
            (missing, loads, revived), before = running[num_blocks], running[first]
            if missing != before[0]:
                return False
            num_loads += loads - before[1]
            num_revived += revived - before[2]
        return num_loads == 0 or num_loads + num_revived <= self.pool.num_free_blocks

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back ``seq``'s blocks, in each windowed group, that no query of it will read
        again: those wholly before the window of its next token (the table keeps RELEASED in
        their place, so logical block indices stay put). Nothing for a prompt whose KV a
        decode worker will take (its hand-off moves the prompt's blocks from the window on)."""
        if seq.prefill_only or not seq.block_tables:
            return
        for group, table in enumerate(seq.block_tables):
            if self.windows[group] is None:
                continue
            num_dead = min(self._first_kept_block(group, seq.num_computed_tokens), len(table))
            for index in range(seq.num_released_blocks[group], num_dead):
                self.pool.free(table[index])
                table[index] = RELEASED
            seq.num_released_blocks[group] = max(seq.num_released_blocks[group], num_dead)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to allocate so the next ``num_new_tokens`` have slots in every group (incl.
        copy-on-write copies)."""
        total = seq.num_computed_tokens + num_new_tokens
        num_new = max(num_blocks_for(total, self.block_size) - self._num_logical_blocks(seq), 0)
        num_copies = sum(1 for _ in self._blocks_to_copy(seq))
        return num_new * self.num_groups + num_copies

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.pool.num_free_blocks

    def max_blocks_held(self, num_tokens: int, step_tokens: int | None) -> int:
        """The most blocks a sequence of up to ``num_tokens`` tokens holds at once: every block
        of each group that sees the whole context and, where ``step_tokens`` is given (chunked
        prefill: no step computes more of it), a windowed group's window and a step's
        tokens."""
        num_blocks = num_blocks_for(num_tokens, self.block_size)
        held = 0
        for window in self.windows:
            if window is None or step_tokens is None:
                held += num_blocks
            else:
                window_and_step = num_blocks_for(window - 1 + step_tokens, self.block_size) + 1
                held += min(num_blocks, window_and_step)
        return held

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next ``num_new_tokens``; returns block copies (src, dst) to perform.

        A partially filled block shared with a sibling (after a fork) is copied before this
        sequence writes into it.
        """
        copies: list[tuple[int, int]] = []
        for group, shared in list(self._blocks_to_copy(seq)):
            logical = seq.num_computed_tokens // self.block_size
            private = self.pool.allocate()
            self.pool.free(shared)
            seq.block_tables[group][logical] = private
            copies.append((shared, private))
        self._give_tables(seq)
        num_blocks = num_blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        for table in seq.block_tables:
            while len(table) < num_blocks:
                table.append(self.pool.allocate())
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
        for group, table in enumerate(seq.block_tables):
            for index in range(seq.num_committed_blocks, num_full_blocks):
                if table[index] != RELEASED:
                    self.pool.register(table[index], seq.block_hashes[index], group)
        seq.num_committed_blocks = num_full_blocks

    def adopt(self, seq: Sequence, block_ids: list[int], *, share: bool) -> None:
        """Give a sequence with no blocks the blocks holding its prompt's KV, received from
        elsewhere (a prefill worker's hand-off, in ``blocks_to_hand_off``'s order: each
        group's blocks from its window on, the ones before it RELEASED); ``share``: they are
        another sample's too, so take another reference."""
        assert not seq.block_tables
        num_prompt_blocks = num_blocks_for(seq.num_prompt_tokens, self.block_size)
        assert len(block_ids) == self.num_blocks_to_hand_off(seq.num_prompt_tokens)
        if share:
            for block_id in block_ids:
                self.pool.incref(block_id)
        start = 0
        for group in range(self.num_groups):
            num_left_behind = self._first_kept_block(group, seq.num_prompt_tokens)
            end = start + num_prompt_blocks - num_left_behind
            seq.block_tables.append(BlockTable([RELEASED] * num_left_behind + block_ids[start:end]))
            seq.num_released_blocks.append(num_left_behind)
            start = end
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_committed_blocks = 0
        self.commit_computed(seq)

    def blocks_to_hand_off(self, seq: Sequence) -> list[int]:
        """The blocks of a prefilled prompt its hand-off moves, group after group: each
        group's from the first one the window of the token after the prompt reaches (all of
        them where the group sees the whole context)."""
        return [
            block_id
            for group, table in enumerate(seq.block_tables)
            for block_id in table[self._first_kept_block(group, seq.num_prompt_tokens) :]
        ]

    def num_blocks_to_hand_off(self, num_prompt_tokens: int) -> int:
        """How many blocks a hand-off of a ``num_prompt_tokens``-token prompt moves."""
        num_blocks = num_blocks_for(num_prompt_tokens, self.block_size)
        return sum(
            num_blocks - self._first_kept_block(group, num_prompt_tokens)
            for group in range(self.num_groups)
        )

    def _first_kept_block(self, group: int, num_tokens: int) -> int:
        """The first of ``group``'s blocks the token after ``num_tokens`` tokens sees: those
        before it are wholly outside its window (0 where the group sees the whole context)."""
        window = self.windows[group]
        if window is None:
            return 0
        first_visible = max(num_tokens - window + 1, 0)
        return min(first_visible // self.block_size, num_blocks_for(num_tokens, self.block_size))

    def reserve(self, num_tokens: int, shared: list[int] | None = None) -> list[int] | None:
        """Blocks for the KV a hand-off of a ``num_tokens``-token prompt moves
        (``blocks_to_hand_off``), or None when they do not fit now: ``shared`` (the prompt's
        leading blocks this cache holds already, from ``share_cached_prefix``), then fresh ones
        for the rest."""
        shared = shared or []
        num_fresh = self.num_blocks_to_hand_off(num_tokens) - len(shared)
        if num_fresh > self.pool.num_free_blocks:
            return None
        # the KV lands in them outside any step: the caller makes the swap-outs of the cached
        # blocks they evict at once (LLMEngine.reserve_blocks), before the KV can arrive
        return shared + [self.pool.allocate() for _ in range(num_fresh)]

    def share_cached_prefix(self, hashes: SequenceOf[BlockHash]) -> list[int]:
        """The device blocks caching the leading run of the blocks named by ``hashes``, each
        taken with a reference (give them back with ``release``): a prefix whose KV need not
        move between workers, since this cache holds it. Only for a model whose one cache group
        sees the whole context (a windowed group's blocks move from the window on, and several
        groups' blocks interleave in a hand-off): [] otherwise, and without prefix caching."""
        if not self.enable_prefix_caching or self.windows != (None,):
            return []
        held: list[int] = []
        for block_hash in hashes:
            block_id = self.pool.cached_block(block_hash, 0)
            if block_id is None:
                break
            self.pool.incref(block_id)
            held.append(block_id)
        return held

    def take_fresh(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` blocks for KV that arrives from elsewhere (a prefix fetched from
        another worker), or None when they do not fit now; ``register_received`` names the
        ones that arrived, ``release`` gives them back."""
        if num_blocks > self.pool.num_free_blocks:
            return None
        return [self.pool.allocate() for _ in range(num_blocks)]

    def register_received(self, block_ids: list[int], hashes: SequenceOf[BlockHash]) -> None:
        """The blocks hold the full blocks named by ``hashes`` (received from another worker
        into blocks of ``take_fresh``): a prefix lookup finds them from now on."""
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            self.pool.register(block_id, block_hash, 0)

    def release(self, block_ids: list[int]) -> None:
        """Give back blocks taken with ``reserve`` that no sequence adopted."""
        for block_id in block_ids:
            self.pool.free(block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (copy-on-write on the partial one)."""
        for group, table in enumerate(parent.block_tables):
            for block_id in table[parent.num_released_blocks[group] :]:
                self.pool.incref(block_id)
        child.block_tables = [BlockTable(table) for table in parent.block_tables]
        child.num_released_blocks = list(parent.num_released_blocks)
        child.block_hashes = list(parent.block_hashes)
        child.num_committed_blocks = parent.num_committed_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (newest first, so older prefix blocks stay cached longer)."""
        for group, table in enumerate(seq.block_tables):
            for block_id in reversed(table[seq.num_released_blocks[group] :]):
                self.pool.free(block_id)
        seq.block_tables = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_released_blocks = []

    def _give_tables(self, seq: Sequence) -> None:
        """Empty tables, one per group, for a sequence that holds no blocks."""
        if not seq.block_tables:
            seq.block_tables = [BlockTable() for _ in range(self.num_groups)]
            seq.num_released_blocks = [0] * self.num_groups

    def _num_logical_blocks(self, seq: Sequence) -> int:
        return len(seq.block_tables[0]) if seq.block_tables else 0

    def _blocks_to_copy(self, seq: Sequence) -> Iterator[tuple[int, int]]:
        """(group, block) of each group whose block the next token lands in is partially
        filled and shared."""
        offset = seq.num_computed_tokens % self.block_size
        if offset == 0 or not seq.block_tables:
            return
        logical = seq.num_computed_tokens // self.block_size
        for group, table in enumerate(seq.block_tables):
            if self.pool.ref_count(table[logical]) > 1:
                yield group, table[logical]
