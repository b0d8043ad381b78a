"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix.

hash(block i) = H(hash(block i-1), token ids of block i, cache salt). Two sequences share a
physical block only when they agree on every token up to the end of that block and on the salt
(the tenant), so one tenant's prefixes can never serve another's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 16-byte digest

_NO_PARENT = b"\x00" * 16


def hash_block(
    parent_hash: BlockHash | None, block_token_ids: Sequence[int], cache_salt: str | None
) -> BlockHash:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or _NO_PARENT)
    digest.update(array("q", block_token_ids).tobytes())
    if cache_salt:
        digest.update(b"\x01salt:" + cache_salt.encode("utf-8"))
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    num_blocks: int | None = None,
) -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``block_hashes``, or
    of its first ``num_blocks`` blocks only."""
    num_full_blocks = len(token_ids) // block_size
    if num_blocks is not None:
        num_full_blocks = min(num_full_blocks, num_blocks)
    for block_index in range(len(block_hashes), num_full_blocks):
        start = block_index * block_size
        parent = block_hashes[-1] if block_hashes else None
        block_hashes.append(hash_block(parent, token_ids[start : start + block_size], cache_salt))


def num_servable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a ``num_tokens``-token prompt a prefix cache can serve: its
    full blocks but the one holding its last token (whose logits are always computed)."""
    return (num_tokens - 1) // block_size


def servable_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> list[BlockHash]:
    """The prefix hashes of a prompt's blocks a prefix cache can serve (``num_servable_blocks``)."""
    hashes: list[BlockHash] = []
    num_servable = num_servable_blocks(len(token_ids), block_size)
    extend_block_hashes(hashes, token_ids, block_size, cache_salt, num_servable)
    return hashes
