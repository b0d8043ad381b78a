"""The prefill worker: computes prompts' KV and first tokens, hands the KV to decode workers.

Lifecycle of a request here (queue names are the request's states):
  queued       -- submitted by the router with the decode worker chosen for it
  prefilling   -- batched with other prompts under the step's token budget (long prompts are
                  chunked; cached prefix blocks are reused)
  first token  -- sampled and streamed to the request's gateway at once (that is TTFT)
  handing off  -- the prompt's KV waits under a lease while the decode worker reserves blocks
                  and the pairwise channel moves it (gather -> one send -> scatter)
  released     -- the decode worker confirmed (or gave up): blocks freed, full ones stay cached
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from engine.engine_config import CacheConfig, LoadConfig
from engine.engine_loop import EngineLoop
from engine.handoff import PrefillResult
from engine.llm_engine import LLMEngine
from engine.messages import GenerateRequest, OutputBatch, WorkerLoad
from engine.scheduler import SchedulerConfig
from kv_transfer import (
    ChannelRendezvous,
    KVCacheLayout,
    KVChannel,
    TransferError,
    TransferTicket,
)
from kv_transfer.policy import FailurePolicy, TransferConfig

logger = logging.getLogger(__name__)
_RESERVE_RETRY_S = 0.01


class DecodePeer(Protocol):
    """How a prefill worker reaches one decode worker: a Ray actor handle or a local object."""

    def reserve(self, request_id: str, num_tokens: int) -> Future[list[int] | None]: ...

    def connect_channel(self, rendezvous: ChannelRendezvous) -> Future[None]: ...

    def receive(
        self,
        channel_id: str,
        result: PrefillResult,
        ticket: TransferTicket,
        block_ids: list[int],
        gateway_id: str,
        policy: FailurePolicy,
    ) -> Future[bool]: ...

    def admit_without_kv(self, result: PrefillResult, gateway_id: str) -> Future[None]: ...


@dataclass(frozen=True, slots=True)
class _Target:
    decode_worker_id: str  # where the request decodes
    gateway_id: str  # where its tokens go


class PrefillWorker:
    role = "prefill"

    def __init__(
        self,
        worker_id: str,
        load: LoadConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        transfer: TransferConfig,
        decode_peers: Mapping[str, DecodePeer],
    ) -> None:
        self.worker_id = worker_id
        self.transfer = transfer
        self.engine = LLMEngine(load, cache, scheduler)
        self.layout = KVCacheLayout.from_cache(self.engine.kv_cache)
        self._peers = dict(decode_peers)
        self._targets: dict[str, _Target] = {}  # request id -> where it goes after prefill
        self._targets_lock = threading.Lock()
        self._channels: dict[str, tuple[str, KVChannel]] = {}  # decode worker -> (id, channel)
        self._handoffs: queue.Queue[PrefillResult | None] = queue.Queue()
        self._transfer_ids = itertools.count()
        self.loop = EngineLoop(self.engine, worker_id, on_handed_off=self._handoffs.put)
        self._handoff_thread = threading.Thread(
            target=self._run_handoffs, name=f"handoff-{worker_id}", daemon=True
        )
        self.loop.start()
        self._handoff_thread.start()

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request: GenerateRequest, decode_worker_id: str) -> None:
        """Queue a prompt; its decode continues on ``decode_worker_id``."""
        if decode_worker_id not in self._peers:
            raise ValueError(f"unknown decode worker {decode_worker_id!r}")
        with self._targets_lock:
            self._targets[request.request_id] = _Target(decode_worker_id, request.gateway_id)
        try:
            self.loop.submit(request, prefill_only=True)
        except ValueError:
            with self._targets_lock:
                self._targets.pop(request.request_id, None)
            raise

    def retarget(self, request_id: str, decode_worker_id: str) -> bool:
        """Send a not-yet-handed-off request to another decode worker; False if too late."""
        if decode_worker_id not in self._peers:
            raise ValueError(f"unknown decode worker {decode_worker_id!r}")
        with self._targets_lock:
            target = self._targets.get(request_id)
            if target is None:
                return False
            self._targets[request_id] = _Target(decode_worker_id, target.gateway_id)
            return True

    def abort(self, request_id: str) -> None:
        with self._targets_lock:
            self._targets.pop(request_id, None)
        self.loop.abort(request_id)

    def add_decode_peer(self, worker_id: str, peer: DecodePeer) -> None:
        self._peers[worker_id] = peer

    # ---- outputs and load ---------------------------------------------------------------
    def stream(self, gateway_id: str) -> Iterator[OutputBatch]:
        """Output batches for one gateway, as steps produce them, until shutdown."""
        return self.loop.stream(gateway_id)

    def next_batch(self, gateway_id: str, timeout_s: float) -> OutputBatch | None:
        return self.loop.next_batch(gateway_id, timeout_s)

    def load(self) -> WorkerLoad:
        return self.loop.load(self.role)

    def shutdown(self) -> None:
        self._handoffs.put(None)
        self.loop.stop()
        self._handoff_thread.join(timeout=10)
        for _, channel in self._channels.values():
            channel.close()
        self._channels.clear()

    # ---- hand-off -----------------------------------------------------------------------
    def _run_handoffs(self) -> None:
        while (result := self._handoffs.get()) is not None:
            with self._targets_lock:
                target = self._targets.pop(result.request_id, None)
            if target is None:  # aborted meanwhile
                self.loop.release(result.request_id)
                continue
            try:
                self._hand_off(result, target)
            except Exception as error:  # the peer is gone or broken: the request fails
                logger.exception("hand-off of %s failed", result.request_id)
                self.loop.fail(result.request_id, f"hand-off failed: {error}", target.gateway_id)
            finally:
                self.loop.release(result.request_id)

    def _hand_off(self, result: PrefillResult, target: _Target) -> None:
        peer = self._peers[target.decode_worker_id]
        block_ids = self._reserve(peer, result)
        if block_ids is None:  # the decode worker stayed full: it recomputes the prompt later
            peer.admit_without_kv(result, target.gateway_id).result()
            return
        channel_id, channel = self._channel_to(target.decode_worker_id, peer)
        ticket = TransferTicket(
            transfer_id=next(self._transfer_ids),
            request_id=result.request_id,
            num_blocks=len(result.block_ids),
            timeout_s=self.transfer.timeout_s,
        )
        receipt = peer.receive(
            channel_id,
            result,
            ticket,
            block_ids,
            target.gateway_id,
            self.transfer.failure_policy,
        )
        try:
            channel.send_blocks(self.engine.kv_cache, result.block_ids, ticket)
        except TransferError:
            logger.warning("KV transfer of %s failed; channel rebuilt on next use", ticket)
            self._channels.pop(target.decode_worker_id, None)
            channel.close()
        receipt.result(timeout=2 * self.transfer.timeout_s)

    def _reserve(self, peer: DecodePeer, result: PrefillResult) -> list[int] | None:
        deadline = time.monotonic() + self.transfer.reserve_timeout_s
        while True:
            block_ids = peer.reserve(result.request_id, result.num_prompt_tokens).result()
            if block_ids is not None or time.monotonic() >= deadline:
                return block_ids
            time.sleep(_RESERVE_RETRY_S)

    def _channel_to(self, decode_worker_id: str, peer: DecodePeer) -> tuple[str, KVChannel]:
        """The open channel to a decode worker, built (listen, join, handshake) on first use."""
        existing = self._channels.get(decode_worker_id)
        if existing is not None and not existing[1].broken:
            return existing
        channel_id = f"{self.worker_id}->{decode_worker_id}/{next(self._transfer_ids)}"
        listener = KVChannel.listen(
            self.transfer.transport, self.layout, self.transfer.host, channel_id, self.engine.device
        )
        try:
            joined = peer.connect_channel(listener.rendezvous)
            channel = listener.accept(self.transfer.timeout_s)
            joined.result(timeout=self.transfer.timeout_s)
        except BaseException:
            listener.close()
            raise
        self._channels[decode_worker_id] = (channel_id, channel)
        return channel_id, channel
