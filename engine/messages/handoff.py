"""The hand-off protocol: what a prefill worker and a decode worker send each other to move one
request from the first to the second.

Every call goes from the prefill actor straight to the decode actor (one Ray actor call each;
the router sees none of them), in this order:
  GetLocality        -- where the decode worker's cache lives (``--kv-transport auto``), once
                        before the pair's first channel
  ReserveBlocks      -- blocks for the prompt's KV; None while they do not fit (asked again
                        until a deadline)
  JoinChannel        -- when no channel to the decode worker is open: it joins the one the
    or PinChannel       prefill worker listens on (one rank each: one channel; else one per
                        rank pair, kv_transfer/ranked_channel.py), or keeps the open one for
                        this transfer
  ReceiveKV          -- receive the KV into the reserved blocks and admit the request; sent as
                        the prefill worker starts sending
  CancelReservation  -- in place of ReceiveKV, when the hand-off failed before its transfer
  AdmitWithoutKV     -- in place of all the above, when no blocks could be reserved: the
                        decode worker runs the prompt again
Before a prompt is prefilled, the prefill worker may copy the prefix of it that the decode
worker caches (a conversation's earlier turns), so that it computes the rest only:
  LendPrefix         -- hold the leading blocks it caches of those named
  OpenLendChannel    -- when no channel from the decode worker is open: listen for one (the
                        decode worker sends, the prefill worker receives)
  SendLentBlocks     -- send them, then stop holding them
  ReturnLent         -- in place of SendLentBlocks, when the copy failed before its transfer
Each hand-off (one try at moving one request) has its own ``handoff_id``, which its calls
carry, so a late call of a failed try never touches a later try of the same request.

``HandoffReceiver`` is the decode side: one verb per call, each taking its message.
``DecodePeer`` is the prefill side's way to send a call to one decode worker (a Ray actor's
handle, or a local object in tests); each answer comes back as a future.
Torch-free: the router imports this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from engine.sampling.messages import TokenLogprobs
from engine.sampling.params import SamplingParams
from kv_transfer.messages import ChannelRendezvous, PairRendezvous, TransferTicket
from kv_transfer.policy import FailurePolicy, Locality

Answer = TypeVar("Answer", covariant=True)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SampleStart:
    index: int  # which of the request's n samples
    first_token_id: int  # the token the prefill side sampled
    logprobs: TokenLogprobs | None  # its logprobs, when asked
    finish_reason: str | None  # set when the first token already ended this sample
    generator_state: bytes | None  # seeded samples: RNG state after the first draw


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill engine hands a decode engine: the prompt, each sample's first token, and
    where the prompt's KV waits on the prefill side (its blocks, under a lease)."""

    request_id: str  # the request (its placement's id)
    prompt_token_ids: list[int]  # the prompt, as the prefill side ran it
    params: SamplingParams  # the request's sampling, continued on the decode side
    cache_salt: str | None  # tenant salt, so the decode side's prefix hashes match
    samples: tuple[SampleStart, ...]  # one per sample, in index order
    # prefill-side blocks holding the prompt's KV, under lease: all of them, or where every
    # layer has an attention window those from the first the next token's window reaches
    block_ids: list[int]
    num_cached_tokens: int  # prompt tokens the prefill side served from its prefix cache
    priority: int = 0  # the request's scheduling priority, kept on the decode side
    # the prefix hashes of the prompt's blocks a cache can serve (all full blocks but the one
    # holding the last token), as the prefill side named them; empty without prefix caching.
    # The decode side reserves the leading ones it caches already, and their KV does not move
    prompt_block_hashes: tuple[bytes, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def unfinished_samples(self) -> tuple[SampleStart, ...]:
        return tuple(s for s in self.samples if s.finish_reason is None)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A decode worker's answer to ``ReserveBlocks``: blocks for the prompt's KV, and the KV
    channel it keeps open for their transfer."""

    block_ids: list[int]  # decode-side blocks the KV goes into
    # the channel the prefill worker asked for, pinned open on the decode side until the
    # receive ends; None when the decode side has no such channel open (it closed it)
    channel_id: str | None
    # how many leading blocks of ``block_ids`` the decode side caches already (the prompt's
    # prefix it holds): the transfer moves the blocks after them only
    num_shared_blocks: int = 0


class HandoffCall(ABC, Generic[Answer]):
    """A call a prefill worker makes on a decode worker; ``Answer`` is what it answers."""

    __slots__ = ()

    @abstractmethod
    def run_on(self, decode: HandoffReceiver) -> Answer:
        """Answers this call on the decode side: its verb of ``decode``."""


@dataclass(frozen=True, slots=True)
class GetLocality(HandoffCall[Locality]):
    """Asks where the decode worker's KV cache lives (the transport is picked by it)."""

    def run_on(self, decode: HandoffReceiver) -> Locality:
        return decode.locality()


@dataclass(frozen=True, slots=True)
class ReserveBlocks(HandoffCall[Reservation | None]):
    """Asks for blocks for a prompt's KV; answered None when they do not fit now."""

    request_id: str  # the request whose KV comes
    handoff_id: str  # the hand-off that will send it
    num_tokens: int  # the prompt's length: the blocks hold that many tokens
    # the channel the prefill worker means to send on, to pin open (None: it has none open)
    channel_id: str | None
    # the prompt's block hashes (``PrefillResult.prompt_block_hashes``): the leading blocks
    # the decode side caches already are reserved shared, and not moved
    prefix_hashes: tuple[bytes, ...] = ()

    def run_on(self, decode: HandoffReceiver) -> Reservation | None:
        return decode.reserve(self)


@dataclass(frozen=True, slots=True)
class PinChannel(HandoffCall[bool]):
    """Asks the decode worker to keep an open channel open for a hand-off's transfer; answered
    False when the channel is not open there, or the hand-off's reservation is gone."""

    request_id: str  # the request whose KV comes on the channel
    handoff_id: str  # the hand-off holding the reservation
    channel_id: str  # the channel to pin

    def run_on(self, decode: HandoffReceiver) -> bool:
        return decode.pin_channel(self)


@dataclass(frozen=True, slots=True)
class JoinChannel(HandoffCall[bool]):
    """Asks the decode worker to join the channel the prefill worker listens on (the handshake
    checks the KV layouts), pinned for a hand-off; answered False when that hand-off's
    reservation is gone (the channel is open all the same)."""

    rendezvous: ChannelRendezvous  # how to reach the listening prefill worker
    request_id: str  # the request whose KV comes on the channel ("" for none)
    handoff_id: str  # the hand-off holding the reservation ("" for none)
    # the rank pairs' channels, when either worker has several ranks (the rendezvous then
    # names the whole channel); empty: one channel between the two rank 0s, at the rendezvous
    pairs: tuple[PairRendezvous, ...] = ()

    def run_on(self, decode: HandoffReceiver) -> bool:
        return decode.connect_channel(self)


@dataclass(frozen=True, slots=True)
class ReceiveKV(HandoffCall[bool]):
    """Tells the decode worker to receive a request's KV into its reserved blocks and admit it;
    answered False when the request does not run there (the transfer failed, the reservation
    was gone, or the decode worker cannot hold it)."""

    channel_id: str  # the channel the KV comes on
    handoff_id: str  # the hand-off holding the reservation
    result: PrefillResult  # the prefilled request
    ticket: TransferTicket  # the transfer, as the sender runs it
    block_ids: list[int]  # the reserved blocks (``Reservation.block_ids``)
    gateway_id: str  # where the request's tokens go
    policy: FailurePolicy  # what the decode worker does when the KV does not arrive

    def run_on(self, decode: HandoffReceiver) -> bool:
        return decode.receive(self)


@dataclass(frozen=True, slots=True)
class CancelReservation(HandoffCall[None]):
    """Gives back the blocks reserved for a hand-off whose KV will not come (it failed before
    its transfer began); a cancel that comes before its reserve refuses that reserve."""

    request_id: str  # the request the blocks were reserved for
    handoff_id: str  # the hand-off that failed

    def run_on(self, decode: HandoffReceiver) -> None:
        decode.cancel_reservation(self)


@dataclass(frozen=True, slots=True)
class AdmitWithoutKV(HandoffCall[None]):
    """Hands a prefilled request over without its KV (no blocks could be reserved): the decode
    worker runs its prompt again, keeping the first tokens."""

    result: PrefillResult  # the prefilled request
    gateway_id: str  # where the request's tokens go

    def run_on(self, decode: HandoffReceiver) -> None:
        decode.admit_without_kv(self)


# ---- the other way: a prefix the decode worker caches, copied to the prefill worker --------
@dataclass(frozen=True, slots=True)
class LendPrefix(HandoffCall[int]):
    """Asks the decode worker to hold the leading run of the named blocks its cache holds (a
    prompt's prefix, after the ones the prefill worker holds), for the prefill worker to copy
    (``SendLentBlocks``); answered how many it holds, 0 for none. Held until sent, returned
    (``ReturnLent``) or expired."""

    lend_id: str  # names the lend in the calls after it
    block_hashes: tuple[bytes, ...]  # the blocks wanted, in the prompt's order

    def run_on(self, decode: HandoffReceiver) -> int:
        return decode.lend_prefix(self)


@dataclass(frozen=True, slots=True)
class OpenLendChannel(HandoffCall[ChannelRendezvous]):
    """Asks the decode worker to listen for a channel from it to the prefill worker (the other
    way from a hand-off's) for lent blocks; answered its rendezvous, which the prefill worker
    joins (the handshake checks the layouts). One per prefill worker: it replaces the one
    before."""

    prefill_worker_id: str  # who joins it
    channel_id: str  # names it
    transport: str  # one of kv_transfer's SUPPORTED_TRANSPORTS

    def run_on(self, decode: HandoffReceiver) -> ChannelRendezvous:
        return decode.open_lend_channel(self)


@dataclass(frozen=True, slots=True)
class SendLentBlocks(HandoffCall[bool]):
    """Tells the decode worker to send the first ``ticket.num_blocks`` lent blocks of a lend on
    its lend channel (the prefill worker receives them meanwhile), then to stop holding them;
    answered False when it could not (the lend expired, the channel is gone or broke)."""

    lend_id: str  # the lend
    channel_id: str  # the lend channel (``OpenLendChannel``)
    ticket: TransferTicket  # the transfer, as the receiver runs it

    def run_on(self, decode: HandoffReceiver) -> bool:
        return decode.send_lent(self)


@dataclass(frozen=True, slots=True)
class ReturnLent(HandoffCall[None]):
    """The prefill worker will not copy a lend's blocks (it failed before): stop holding them."""

    lend_id: str

    def run_on(self, decode: HandoffReceiver) -> None:
        decode.return_lent(self)


class HandoffReceiver(Protocol):
    """A decode worker's side of the hand-off: one verb per call."""

    def locality(self) -> Locality: ...

    def reserve(self, call: ReserveBlocks) -> Reservation | None: ...

    def pin_channel(self, call: PinChannel) -> bool: ...

    def connect_channel(self, call: JoinChannel) -> bool: ...

    def receive(self, call: ReceiveKV) -> bool: ...

    def cancel_reservation(self, call: CancelReservation) -> None: ...

    def admit_without_kv(self, call: AdmitWithoutKV) -> None: ...

    def lend_prefix(self, call: LendPrefix) -> int: ...

    def open_lend_channel(self, call: OpenLendChannel) -> ChannelRendezvous: ...

    def send_lent(self, call: SendLentBlocks) -> bool: ...

    def return_lent(self, call: ReturnLent) -> None: ...


class DecodePeer(Protocol):
    """How a prefill worker reaches one decode worker: a Ray actor's handle or a local object."""

    def send(self, call: HandoffCall[T]) -> Future[T]:
        """Sends ``call`` to the decode worker; its answer comes in the future."""
        ...
