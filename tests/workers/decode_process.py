"""A decode worker in a process of its own, for tests where Ray is not there (the GPU machine).

In the cluster a decode worker is a Ray actor: its own process, typed method calls from the
prefill worker and the gateway. This gives a test the same shape without Ray: the child process
builds a real ``DecodeWorker`` and answers calls over ``multiprocessing.connection`` (one
connection per call, each answered on its own thread, as a threaded actor would), and
``DecodeProcess`` is the prefill worker's ``DecodePeer`` and the test gateway's output source.
Two processes on one GPU is what the ``cuda_ipc`` transport is for (CUDA IPC cannot open a
handle in the process that made it).
"""

from __future__ import annotations

import multiprocessing
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from engine.engine_config import CacheConfig, LoadConfig
from engine.handoff import PrefillResult
from engine.messages import OutputBatch
from engine.scheduler import SchedulerConfig
from kv_transfer import ChannelRendezvous, TransferTicket
from kv_transfer.policy import FailurePolicy, TransferConfig

# what the parent may call; each is a method of DecodeWorker
_METHODS = frozenset(
    {"reserve", "connect_channel", "receive", "admit_without_kv", "next_batch", "load"}
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


class DecodeProcess:
    """The parent's handle: a ``DecodePeer`` (futures) plus ``next_batch`` and ``load``."""

    def __init__(
        self,
        worker_id: str,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.worker_id = worker_id
        self._authkey = secrets.token_bytes(16)
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        ready = context.Queue()
        self._process = context.Process(
            target=_serve,
            args=(ready, self._authkey, worker_id, load, cache, scheduler, transfer),
            daemon=True,
        )
        self._process.start()
        self._address = ready.get(timeout=start_timeout_s)
        self._executor = ThreadPoolExecutor(8, thread_name_prefix=f"peer-{worker_id}")

    def _call(self, name: str, *args: Any) -> Any:
        with Client(self._address, authkey=self._authkey) as connection:
            connection.send((name, args))
            status, value = connection.recv()
        if status != "ok":
            raise RuntimeError(f"{self.worker_id}.{name}: {value}")
        return value

    # ---- DecodePeer ---------------------------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int) -> Future[list[int] | None]:
        return self._executor.submit(self._call, "reserve", request_id, num_tokens)

    def connect_channel(self, rendezvous: ChannelRendezvous) -> Future[None]:
        return self._executor.submit(self._call, "connect_channel", rendezvous)

    def receive(
        self,
        channel_id: str,
        result: PrefillResult,
        ticket: TransferTicket,
        block_ids: list[int],
        gateway_id: str,
        policy: FailurePolicy,
    ) -> Future[bool]:
        args = (channel_id, result, ticket, block_ids, gateway_id, policy)
        return self._executor.submit(self._call, "receive", *args)

    def admit_without_kv(self, result: PrefillResult, gateway_id: str) -> Future[None]:
        return self._executor.submit(self._call, "admit_without_kv", result, gateway_id)

    # ---- the gateway's side -------------------------------------------------------------
    def next_batch(self, gateway_id: str, timeout_s: float) -> OutputBatch | None:
        batch: OutputBatch | None = self._call("next_batch", gateway_id, timeout_s)
        return batch

    def load(self) -> Any:
        return self._call("load")

    def close(self) -> None:
        if self._process.is_alive():
            self._call("shutdown")
            self._process.join(30)
        self._executor.shutdown(wait=False, cancel_futures=True)
