"""A decode worker in a process of its own, for tests where Ray is not there (the GPU machine).

In the cluster a decode worker is a Ray actor: its own process, typed method calls from the
prefill worker and the gateway. This gives a test the same shape without Ray: the child process
builds a real ``DecodeWorker`` and answers calls over ``multiprocessing.connection`` (one
connection per call, each answered on its own thread, as a threaded actor would), and
``DecodeProcess`` is ``LocalDecodePeer`` over a stand-in that makes those calls: the prefill
worker's ``DecodePeer``, and through ``remote`` the test gateway's output source.
Two processes on one GPU is what the ``cuda_ipc`` transport is for (CUDA IPC cannot open a
handle in the process that made it).
"""

from __future__ import annotations

import functools
import multiprocessing
import secrets
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from engine.engine_config import CacheConfig, LoadConfig
from engine.scheduler import SchedulerConfig
from kv_transfer.policy import TransferConfig
from tests.workers.local_peer import LocalDecodePeer

# what the parent may call; each is a method of DecodeWorker
_METHODS = frozenset(
    {
        "reserve",
        "pin_channel",
        "cancel_reservation",
        "connect_channel",
        "locality",
        "receive",
        "admit_without_kv",
        "next_batch",
        "load",
    }
)


def _serve(
    ready: Any,  # multiprocessing queue: the listener's address goes back on it
    authkey: bytes,
    worker_id: str,
    load: LoadConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    transfer: TransferConfig,
) -> None:
    """The child process: one DecodeWorker, answering calls until asked to shut down."""
    from decode_worker.worker import DecodeWorker

    worker = DecodeWorker(worker_id, load, cache, scheduler, transfer)
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        ready.put(listener.address)
        while True:
            connection = listener.accept()
            name, args = connection.recv()
            if name == "shutdown":
                break
            threading.Thread(
                target=_answer, args=(worker, connection, name, args), daemon=True
            ).start()
    worker.shutdown()
    connection.send(("ok", None))
    connection.close()


def _answer(worker: Any, connection: Connection, name: str, args: tuple[Any, ...]) -> None:
    with connection:
        if name not in _METHODS:
            connection.send(("error", f"no such method {name!r}"))
            return
        try:
            connection.send(("ok", getattr(worker, name)(*args)))
        except Exception as error:  # the parent raises it where the call was made
            connection.send(("error", f"{type(error).__name__}: {error}"))


class _RemoteDecodeWorker:
    """The child's DecodeWorker as the parent sees it: each method of ``_METHODS`` is a call
    over a connection of its own, raising RuntimeError where the child's call raised."""

    def __init__(self, worker_id: str, address: Any, authkey: bytes) -> None:
        self.worker_id = worker_id
        self._address, self._authkey = address, authkey

    def call(self, name: str, *args: Any) -> Any:
        with Client(self._address, authkey=self._authkey) as connection:
            connection.send((name, args))
            status, value = connection.recv()
        if status != "ok":
            raise RuntimeError(f"{self.worker_id}.{name}: {value}")
        return value

    def __getattr__(self, name: str) -> Any:
        if name not in _METHODS:
            raise AttributeError(name)
        return functools.partial(self.call, name)


class DecodeProcess(LocalDecodePeer):
    """The parent's handle: ``LocalDecodePeer``'s futures over the child's worker, which
    ``worker`` also gives the test gateway (``next_batch``) and the test (``load``)."""

    def __init__(
        self,
        worker_id: str,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        start_timeout_s: float = 120.0,
    ) -> None:
        authkey = secrets.token_bytes(16)
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        ready = context.Queue()
        self._process = context.Process(
            target=_serve,
            args=(ready, authkey, worker_id, load, cache, scheduler, transfer),
            daemon=True,
        )
        self._process.start()
        remote = _RemoteDecodeWorker(worker_id, ready.get(timeout=start_timeout_s), authkey)
        super().__init__(remote)  # type: ignore[arg-type]  # a DecodeWorker's calls, remotely
        self.remote = remote

    def close(self) -> None:
        if self._process.is_alive():
            self.remote.call("shutdown")
            self._process.join(30)
        super().close()
