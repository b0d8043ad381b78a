"""Setting up a `gloo` / `nccl` channel: listener (rank 0, sender) and connect (rank 1).

Lifecycle: handshake → the sender serves its `ServedStore` on the control connection in a
thread while both ends build the 2-rank group and exchange a warm-up message → the receiver
says "done" → the control connection is closed; from then on only the group carries data.
"""

from __future__ import annotations

import threading

import torch

from kv_transfer.deadline import Deadline
from kv_transfer.handshake import send_welcome, welcome_field
from kv_transfer.layout import KVCacheLayout
from kv_transfer.messages import ChannelRendezvous
from kv_transfer.store import RemoteStore, ServedStore
from kv_transfer.transports.base import Endpoint
from kv_transfer.transports.control import ControlListener, open_control
from kv_transfer.transports.process_group import GroupEndpoint, make_group
from kv_transfer.wire import FramedConnection


class GroupListener(ControlListener):
    def __init__(
        self,
        backend: str,
        layout: KVCacheLayout,
        host: str,
        channel_id: str,
        device: torch.device,
        chunk_bytes: int,
    ) -> None:
        super().__init__(backend, layout, host, channel_id)
        self._backend = backend
        self._device = device
        self._chunk_bytes = chunk_bytes

    def establish(self, conn: FramedConnection, deadline: Deadline) -> Endpoint:
        send_welcome(conn, self.layout, {"chunk_bytes": self._chunk_bytes}, deadline)
        store = ServedStore(deadline)
        errors: list[BaseException] = []
        server = threading.Thread(
            target=_serve,
            args=(store, conn, errors),
            daemon=True,
            name=f"kv-store-{self.rendezvous.channel_id}",
        )
        server.start()
        endpoint: GroupEndpoint | None = None
        try:
            group = make_group(self._backend, store, 0, self.host, self._device, deadline)
            endpoint = GroupEndpoint(self.layout, group, 0, self._device, self._chunk_bytes)
            endpoint.warm_up(deadline)
            server.join(deadline.remaining())
            if errors:
                raise errors[0]
            if server.is_alive():
                raise TimeoutError("the receiver did not finish the rendezvous in time")
            return endpoint
        except BaseException:
            if endpoint is not None:
                endpoint.close()
            raise
        finally:
            conn.close()  # unblocks the server thread if it is still waiting
            server.join()


def _serve(store: ServedStore, conn: FramedConnection, errors: list[BaseException]) -> None:
    try:
        store.serve(conn)
    except BaseException as exc:  # reported by the accepting thread
        errors.append(exc)
        store.fail(exc)


def connect_group(
    backend: str,
    rendezvous: ChannelRendezvous,
    layout: KVCacheLayout,
    device: torch.device,
    deadline: Deadline,
) -> Endpoint:
    conn, welcome = open_control(rendezvous, layout, deadline)
    try:
        chunk_bytes = welcome_field(welcome, "chunk_bytes", int)
        store = RemoteStore(conn, deadline)
        local_host = conn.local_host()  # our address on the sender's network
        group = make_group(backend, store, 1, local_host, device, deadline)
        endpoint = GroupEndpoint(layout, group, 1, device, chunk_bytes)
        try:
            endpoint.warm_up(deadline)
            store.finish()
        except BaseException:
            endpoint.close()
            raise
        return endpoint
    finally:
        conn.close()
