"""Small frozen messages that cross the kv_transfer boundary.

Lifecycle of a transfer as the caller sees it: the prefill side builds a `ChannelRendezvous`
when it listens and hands it to the decode side (through Ray); both sides then run one
`TransferTicket` per request (same ticket on both ends) and get back `TransferStats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

SUPPORTED_TRANSPORTS: tuple[str, ...] = ("gloo", "shm", "nccl", "cuda_ipc", "fake")

Role = Literal["sender", "receiver"]


@dataclass(frozen=True, slots=True)
class TransferTicket:
    """One request's KV move; both ends pass an equal ticket for the same transfer."""

    transfer_id: int  # increases per channel; both ends must agree on it
    request_id: str  # for error messages and logs only
    num_blocks: int  # blocks moved; must equal len(block_ids) on both ends
    timeout_s: float  # deadline of the whole transfer, counted from the call
    checksum: bool = False  # receiver verifies a CRC32 of the data it wrote

    def __post_init__(self) -> None:
        if self.transfer_id < 0:
            raise ValueError(f"transfer_id must be >= 0, got {self.transfer_id}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s must be positive and finite, got {self.timeout_s}")

    @property
    def label(self) -> str:
        return f"transfer {self.transfer_id} (request {self.request_id!r})"


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one side of one transfer measured. Phases may overlap (chunks are pipelined)."""

    transfer_id: int  # the ticket's transfer id
    nbytes: int  # payload bytes moved: num_blocks * layout.moved_block_nbytes
    num_chunks: int  # pieces the payload was staged in (cuda_ipc: 1, it stages nothing)
    gather_s: float  # sender: copying blocks into staging (0.0 on the receiver, and cuda_ipc)
    wire_s: float  # blocked on the transport or the peer (send or receive)
    scatter_s: float  # receiver: copying into its blocks, from staging or (cuda_ipc) the sender's
    # cache (0.0 on the sender)
    checksum_s: float  # computing checksums (0.0 unless ticket.checksum)
    total_s: float  # wall time of the whole call

    @property
    def gb_per_s(self) -> float:
        """End-to-end bandwidth of this side, in 1e9 bytes per second."""
        return self.nbytes / self.total_s / 1e9 if self.total_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class ChannelRendezvous:
    """How the receiver reaches a listening sender: plain data, safe to pass through Ray."""

    transport: str  # one of SUPPORTED_TRANSPORTS
    channel_id: str  # names the pair, e.g. "prefill-0->decode-3"
    host: str  # address the sender's control socket is bound to
    port: int  # its port (0 for the in-process fake)
    extra: tuple[tuple[str, str], ...] = ()  # transport options, e.g. (("token", "…"),)

    def option(self, name: str) -> str | None:
        """The value of `name` in `extra`, or None."""
        return next((value for key, value in self.extra if key == name), None)


@dataclass(frozen=True, slots=True)
class PairRendezvous:
    """One rank pair's channel of a hand-off between workers of several tensor-parallel ranks:
    which prefill rank listens, which decode rank joins, and the KV heads it moves."""

    prefill_rank: int  # the rank of the prefill worker that sends
    decode_rank: int  # the rank of the decode worker that receives
    heads: range  # the model's KV heads the pair moves, consecutive
    rendezvous: ChannelRendezvous  # how the decode rank reaches the listening prefill rank
