"""`KVChannel`: one prefill → decode pair's link for KV blocks, whatever the transport.

Lifecycle (states): the sender `KVChannel.listen(...)` → `ChannelListener` (Bootstrapping) →
the receiver `KVChannel.connect(listener.rendezvous, ...)` while the sender `accept`s; the
handshake checks both layouts → one `KVChannel` per side → for each request, the same
`TransferTicket` on both ends: `send_blocks` ∥ `recv_blocks` (Transferring) → stats
(Success) | `TransferError` / `TransferTimeoutError` (Failed: the channel is `broken`, already
torn down; build a new one) → `close`.

The listening side sends and the connecting side receives. One transfer at a time per
channel: concurrent calls queue on a lock, and the wait counts against their deadline.
Every failure during a transfer breaks the channel (a timeout fails every request on it).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from types import TracebackType

import torch

from kv_transfer.chunking import BlockIds
from kv_transfer.deadline import Deadline
from kv_transfer.errors import LayoutMismatchError, TransferError, TransferTimeoutError
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import ChannelRendezvous, Role, TransferStats, TransferTicket
from kv_transfer.transports import connect_endpoint, make_listener
from kv_transfer.transports.base import Endpoint, ListenerBackend, Move

_FAKE_PAIRS = itertools.count()  # names the channels of make_fake_channel_pair


def _normalize(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _setup_error(what: str, exc: BaseException, timeout_s: float) -> TransferError:
    if isinstance(exc, TimeoutError):
        return TransferTimeoutError(f"{what} timed out after {timeout_s:g} s: {exc}")
    return TransferError(f"{what} failed: {exc}")


class KVChannel:
    """One end of an established channel. Build with `listen` + `accept` or `connect`."""

    def __init__(
        self, endpoint: Endpoint, role: Role, device: torch.device, rendezvous: ChannelRendezvous
    ) -> None:
        self._endpoint = endpoint
        self.role: Role = role
        self.device = device
        self.rendezvous = rendezvous
        self._lock = threading.Lock()  # one transfer at a time
        self._state = threading.Lock()  # guards the three flags below
        self._busy = False  # a transfer holds `_lock` and uses the endpoint
        self._broken = False
        self._torn_down = False

    @staticmethod
    def listen(
        transport: str,
        layout: KVCacheLayout,
        host: str,
        channel_id: str,
        device: torch.device,
        *,
        chunk_bytes: int | None = None,
    ) -> ChannelListener:
        """Start the sending end: bind a control socket on `host` (never a wildcard).
        `chunk_bytes`: staging unit (default per transport, `DEFAULT_CHUNK_BYTES`)."""
        device = _normalize(device)
        backend = make_listener(transport, layout, host, channel_id, device, chunk_bytes)
        return ChannelListener(backend, device)

    @staticmethod
    def connect(
        rendezvous: ChannelRendezvous, layout: KVCacheLayout, device: torch.device, timeout_s: float
    ) -> KVChannel:
        """The receiving end: connect, handshake (`LayoutMismatchError`), set the transport up."""
        device = _normalize(device)
        what = f"connecting {rendezvous.transport} channel {rendezvous.channel_id!r}"
        try:
            endpoint = connect_endpoint(rendezvous, layout, device, Deadline.after(timeout_s))
        except LayoutMismatchError:
            raise
        except (OSError, RuntimeError) as exc:
            raise _setup_error(what, exc, timeout_s) from exc
        return KVChannel(endpoint, "receiver", device, rendezvous)

    @property
    def broken(self) -> bool:
        """True after a failed transfer or `close`: build a new channel."""
        return self._broken

    def send_blocks(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int], ticket: TransferTicket
    ) -> TransferStats:
        """Gather `block_ids` of `kv_cache` and deliver them; returns once the receiver has them."""
        return self._transfer("sender", kv_cache, block_ids, ticket)

    def recv_blocks(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int], ticket: TransferTicket
    ) -> TransferStats:
        """Receive the transfer of `ticket` into `block_ids` of `kv_cache`."""
        return self._transfer("receiver", kv_cache, block_ids, ticket)

    def discard(self, like: torch.Tensor, ticket: TransferTicket) -> TransferStats:
        """Receive the transfer of ``ticket`` into scratch blocks and drop it.

        For a transfer whose request went away (aborted) after the sender was told to send:
        receiving it anyway keeps both ends in step, so the next transfer on the channel works
        instead of the sender waiting out its deadline. ``like`` is the KV cache (for shape).
        """
        shape = list(like.shape)
        shape[2] = (
            ticket.num_blocks
        )  # [num_layers, kv_planes, num_blocks, block_size, heads, head_dim]
        scratch = like.new_empty(shape)
        return self.recv_blocks(scratch, list(range(ticket.num_blocks)), ticket)

    def _transfer(
        self, role: Role, kv_cache: torch.Tensor, block_ids: Sequence[int], ticket: TransferTicket
    ) -> TransferStats:
        if role != self.role:
            raise RuntimeError(
                f"this end of channel {self.rendezvous.channel_id!r} is the "
                f"{self.role}; channels move KV one way, listener to connector"
            )
        move = self._check(kv_cache, block_ids, ticket)
        if not self._lock.acquire(timeout=ticket.timeout_s):
            self.close()  # aborts the transfer that holds the lock; it tears the channel down
            raise TransferTimeoutError(
                f"{ticket.label} timed out after {ticket.timeout_s:g} s waiting for another "
                f"transfer on channel {self.rendezvous.channel_id!r}; the channel is broken"
            )
        try:
            with self._state:
                self._busy = True
                broken = self._broken
            if broken:
                raise TransferError(
                    f"{ticket.label}: channel {self.rendezvous.channel_id!r} is broken; "
                    "build a new one"
                )
            return self._run(move)
        finally:
            with self._state:
                self._busy = False
                if self._broken:
                    self._tear_down()
            self._lock.release()

    def _check(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int], ticket: TransferTicket
    ) -> Move:
        """Validate the caller's arguments; nothing has touched the wire yet."""
        if len(block_ids) != ticket.num_blocks:
            raise ValueError(
                f"{ticket.label} is for {ticket.num_blocks} blocks, "
                f"but {len(block_ids)} block ids were given"
            )
        num_cache_blocks = self._endpoint.layout.check_cache(kv_cache, self.device)
        ids = BlockIds.build(block_ids, num_cache_blocks, self.device)
        return Move(kv_cache, ids, ticket, Deadline.after(ticket.timeout_s))

    def _run(self, move: Move) -> TransferStats:
        label, channel_id = move.ticket.label, self.rendezvous.channel_id
        try:
            if self.role == "sender":
                return self._endpoint.send(move)
            return self._endpoint.recv(move)
        except TimeoutError as exc:
            self._broken = True
            raise TransferTimeoutError(
                f"{label} timed out after {move.ticket.timeout_s:g} s on channel "
                f"{channel_id!r} ({exc}); the channel is torn down"
            ) from exc
        except (OSError, RuntimeError) as exc:
            self._broken = True
            raise TransferError(f"{label} failed on channel {channel_id!r}: {exc}") from exc
        except BaseException:  # a bug or an interrupt mid-transfer: the stream is out of step
            self._broken = True
            raise

    def _tear_down(self) -> None:
        """Release the endpoint; called with `_state` held and no transfer running."""
        if not self._torn_down:
            self._torn_down = True
            self._endpoint.close()

    def close(self) -> None:
        """Break the channel and release its resources: now, or (a transfer running in another
        thread is aborted) as soon as that transfer returns. Idempotent, from any thread."""
        with self._state:
            self._broken = True
            if not self._busy:
                self._tear_down()
                return
        self._endpoint.abort()

    def __enter__(self) -> KVChannel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ChannelListener:
    """The sending end before the receiver arrived. Hand `rendezvous` to the receiver."""

    def __init__(self, backend: ListenerBackend, device: torch.device) -> None:
        self._backend = backend
        self.device = device
        self.rendezvous: ChannelRendezvous = backend.rendezvous

    def accept(self, timeout_s: float) -> KVChannel:
        """Block until the receiver connected and the handshake passed."""
        what = f"accepting {self.rendezvous.transport} channel {self.rendezvous.channel_id!r}"
        try:
            endpoint = self._backend.accept(Deadline.after(timeout_s))
        except LayoutMismatchError:
            raise
        except (OSError, RuntimeError) as exc:
            raise _setup_error(what, exc, timeout_s) from exc
        return KVChannel(endpoint, "sender", self.device, self.rendezvous)

    def close(self) -> None:
        """Stop listening; channels already accepted stay open."""
        self._backend.close()

    def __enter__(self) -> ChannelListener:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def make_fake_channel_pair(
    layout: KVCacheLayout,
    device: torch.device | str = "cpu",
    *,
    receiver_layout: KVCacheLayout | None = None,
    channel_id: str | None = None,
) -> tuple[KVChannel, KVChannel]:
    """An in-process (sender, receiver) pair on the `fake` transport, for tests of callers.
    `receiver_layout` (default: `layout`) lets a test provoke a `LayoutMismatchError`."""
    device = _normalize(device)
    name = channel_id or f"fake-pair-{next(_FAKE_PAIRS)}"
    with KVChannel.listen("fake", layout, "127.0.0.1", name, device) as listener:
        receiver = KVChannel.connect(listener.rendezvous, receiver_layout or layout, device, 1.0)
        sender = listener.accept(1.0)
    return sender, receiver
