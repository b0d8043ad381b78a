"""A channel between two workers of several tensor-parallel ranks: one pair channel per move of
``plan_head_moves``, driven by each worker's rank 0 through its ranks' ports.

Lifecycle, as ``KVChannel``'s: the prefill side's rank 0 builds a `RankedListener` (every
prefill rank of a move listens for its pair, with the heads it moves) → the decode side's rank
0 `RankedChannel.connect`s (each decode rank joins its pairs; the handshake of each pair
checks the moved heads) while the listener `accept`s → per request, the same ticket on both
ends: `send_blocks` sends on every pair at once, `recv_blocks` receives on every pair at once,
and each returns when all its pairs have → `close`. A failed pair fails the transfer and breaks
the whole channel (every pair is closed; a new one is built), as a failed `KVChannel` does.

Torch-free: every rank's cache stays in its own process; the ``kv_cache`` handed to the
transfer verbs is rank 0's, which its own port holds already.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Literal

from kv_transfer.errors import TransferError, TransferTimeoutError
from kv_transfer.head_plan import HeadMove
from kv_transfer.messages import ChannelRendezvous, PairRendezvous, TransferStats, TransferTicket
from kv_transfer.rank_calls import (
    AcceptPair,
    ClosePair,
    ConnectPair,
    DiscardPair,
    ListenPair,
    RankCall,
    RankPeer,
    RecvPair,
    SendPair,
)

_ANSWER_SLACK_S = 5.0  # beyond a ticket's deadline, for a rank's answer to come back


class RankedChannel:
    """One end of an established channel of rank pairs."""

    def __init__(
        self,
        role: Literal["sender", "receiver"],
        links: Sequence[tuple[RankPeer, str]],  # (this side's rank, pair channel id) per pair
        rendezvous: ChannelRendezvous,  # names the whole channel
    ) -> None:
        self.role = role
        self.rendezvous = rendezvous
        self._links = list(links)
        self._lock = threading.Lock()  # one transfer at a time
        self._broken = False

    @property
    def broken(self) -> bool:
        """True after a failed transfer or `close`: build a new channel."""
        return self._broken

    @property
    def num_pairs(self) -> int:
        return len(self._links)

    @classmethod
    def connect(
        cls,
        rendezvous: ChannelRendezvous,
        pairs: Sequence[PairRendezvous],
        ranks: Sequence[RankPeer],
        timeout_s: float,
    ) -> RankedChannel:
        """The receiving end: each decode rank of a pair joins it, all at once. Raises
        ValueError naming the rank when a pair names a rank this worker does not have."""
        for pair in pairs:
            if not 0 <= pair.decode_rank < len(ranks):
                raise ValueError(
                    f"decode_rank {pair.decode_rank} of channel {rendezvous.channel_id!r} must be "
                    f"below this worker's tensor_parallel_size {len(ranks)}"
                )
        links = [(ranks[p.decode_rank], p.rendezvous.channel_id) for p in pairs]
        calls = [ConnectPair(p.rendezvous, p.heads, timeout_s) for p in pairs]
        _all_or_close(links, calls, timeout_s, f"joining channel {rendezvous.channel_id!r}")
        return cls("receiver", links, rendezvous)

    def send_blocks(
        self, kv_cache: Any, block_ids: Sequence[int], ticket: TransferTicket
    ) -> TransferStats:
        """Send every pair's heads of ``block_ids`` (the same ids on every rank)."""
        return self._transfer("sender", lambda id_: SendPair(id_, list(block_ids), ticket), ticket)

    def recv_blocks(
        self, kv_cache: Any, block_ids: Sequence[int], ticket: TransferTicket
    ) -> TransferStats:
        """Receive every pair's heads into ``block_ids``; returns once every rank has them."""
        return self._transfer(
            "receiver", lambda id_: RecvPair(id_, list(block_ids), ticket), ticket
        )

    def discard(self, like: Any, ticket: TransferTicket) -> TransferStats:
        """Receive the transfer of ``ticket`` on every pair into scratch and drop it."""
        return self._transfer("receiver", lambda id_: DiscardPair(id_, ticket), ticket)

    def close(self) -> None:
        """Break the channel and close every pair's ends (without waiting). Idempotent."""
        self._broken = True
        _close_links(self._links)

    def _transfer(
        self, role: str, call: Callable[[str], RankCall[TransferStats]], ticket: TransferTicket
    ) -> TransferStats:
        if role != self.role:
            raise RuntimeError(
                f"this end of channel {self.rendezvous.channel_id!r} is the {self.role}"
            )
        if not self._lock.acquire(timeout=ticket.timeout_s):
            self.close()
            raise TransferTimeoutError(
                f"{ticket.label} timed out after {ticket.timeout_s:g} s waiting for another "
                f"transfer on channel {self.rendezvous.channel_id!r}; the channel is broken"
            )
        try:
            if self._broken:
                raise TransferError(
                    f"{ticket.label}: channel {self.rendezvous.channel_id!r} is broken; "
                    "build a new one"
                )
            futures = [peer.send(call(id_)) for peer, id_ in self._links]
            stats = _answers(self._links, futures, ticket.timeout_s, ticket.label)
            return _sum_stats(ticket.transfer_id, stats)
        except TransferError:
            self.close()
            raise
        finally:
            self._lock.release()


class RankedListener:
    """The sending end before the decode worker joined: every move's prefill rank listens."""

    def __init__(
        self,
        transport: str,
        channel_id: str,
        moves: Sequence[HeadMove],
        ranks: Sequence[RankPeer],  # this (prefill) worker's ranks, rank 0 first
        timeout_s: float,
    ) -> None:
        self.rendezvous = ChannelRendezvous(transport, channel_id, "", 0)
        ids = [f"{channel_id}#p{m.prefill_rank}d{m.decode_rank}h{m.heads.start}" for m in moves]
        self._links = [(ranks[m.prefill_rank], id_) for m, id_ in zip(moves, ids, strict=True)]
        calls = [ListenPair(transport, id_, m.heads) for m, id_ in zip(moves, ids, strict=True)]
        answers = _all_or_close(self._links, calls, timeout_s, f"listening on {channel_id!r}")
        self.pairs = tuple(
            PairRendezvous(m.prefill_rank, m.decode_rank, m.heads, rendezvous)
            for m, rendezvous in zip(moves, answers, strict=True)
        )
        self._accepted = False

    def accept(self, timeout_s: float) -> RankedChannel:
        """Block until every pair's decode rank joined and its handshake passed."""
        calls = [AcceptPair(id_, timeout_s) for _, id_ in self._links]
        what = f"accepting channel {self.rendezvous.channel_id!r}"
        _all_or_close(self._links, calls, timeout_s, what)
        self._accepted = True
        return RankedChannel("sender", self._links, self.rendezvous)

    def close(self) -> None:
        """Stop listening (waking an accept); channels already accepted stay open."""
        if not self._accepted:
            _close_links(self._links)


def _all_or_close(
    links: Sequence[tuple[RankPeer, str]],
    calls: Sequence[RankCall[Any]],
    timeout_s: float,
    what: str,
) -> list[Any]:
    """Send each link its call at once and wait for every answer; when one fails, every link's
    pair is closed and the first failure is raised as a TransferError."""
    futures = [peer.send(call) for (peer, _), call in zip(links, calls, strict=True)]
    try:
        return _answers(links, futures, timeout_s, what)
    except TransferError:
        _close_links(links)
        raise


def _answers(
    links: Sequence[tuple[RankPeer, str]],
    futures: Sequence[Future[Any]],
    timeout_s: float,
    what: str,
) -> list[Any]:
    """Every future's answer, all waited for up to ``timeout_s`` and some slack; all are
    waited for before the first failure (a TransferError naming the pair) is raised."""
    answers: list[Any] = []
    failure: BaseException | None = None
    failed_id = ""
    deadline = time.monotonic() + timeout_s + _ANSWER_SLACK_S
    for (_, channel_id), future in zip(links, futures, strict=True):
        try:
            answers.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except Exception as error:  # a rank's error, a rank gone, or no answer in time
            if failure is None:
                failure, failed_id = error, channel_id
            answers.append(None)
    if failure is not None:
        reason = str(failure) or type(failure).__name__
        raise TransferError(f"{what} failed on rank pair {failed_id!r}: {reason}") from failure
    return answers


def _close_links(links: Sequence[tuple[RankPeer, str]]) -> None:
    for peer, channel_id in links:
        with contextlib.suppress(RuntimeError):  # a rank shut down has nothing left open
            peer.send(ClosePair(channel_id))


def _sum_stats(transfer_id: int, stats: Sequence[TransferStats]) -> TransferStats:
    """One transfer's stats over its pairs: bytes and chunks add up, phases ran side by side."""
    return TransferStats(
        transfer_id=transfer_id,
        nbytes=sum(s.nbytes for s in stats),
        num_chunks=sum(s.num_chunks for s in stats),
        gather_s=max(s.gather_s for s in stats),
        wire_s=max(s.wire_s for s in stats),
        scatter_s=max(s.scatter_s for s in stats),
        checksum_s=max(s.checksum_s for s in stats),
        total_s=max(s.total_s for s in stats),
    )
