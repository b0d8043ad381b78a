"""The cluster: the router's front over the worker pools, the placements and the output pump.

Life of a request through ``Cluster``:
  generate() -> held while every live worker of a role it needs is late (a bounded wait) ->
  placed (``router.placements``: the policy over the workers' loads, then submitted to a
  prefill worker, or a decode worker in colocated mode) -> token events stream back from the
  workers' per-gateway output streams, one batch per engine step (``router.output_pump``) ->
  the request's tracker orders and de-duplicates them -> the client's async iterator. The first
  token's trace (``engine.messages.FirstTokenTrace``) gets the router's stamps on the way:
  the placement's (``RequestTracker.stamps``), the pump's, and its entry and yield here.
The load monitor polls the pools (``router.worker_pool``) every ``report_interval_s``; a worker
it takes out of rotation has its requests re-routed (nothing generated yet) or resumed on a
live decode worker after the tokens the client already has, so every token arrives once.

Parts and their locks, in the one order they are taken: ``Placements._lock`` ->
``WorkerPool._membership`` -> ``WorkerPool._lock``. The front holds no lock of its own but the
count of requests waiting for a worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from engine.kv_cache.prefix_hash import servable_block_hashes
from engine.messages import FirstTokenTrace, GenerateRequest, RequestFailure, TokenEvent
from engine.sampling.params import SamplingParams
from router.cluster_config import ClusterConfig
from router.cpu_binding import bind_this_process, plan_cpu_binding, threads_per_worker
from router.kv_aware import PrefixHitStats
from router.latency_forecast import (
    AllowedWorkers,
    Forecast,
    LatencyForecaster,
    PromptToPlace,
    StepBudgets,
)
from router.latency_model import StepRatios
from router.local_ray import start_ray
from router.output_pump import OutputPump
from router.placements import Placements, RequestFailedError
from router.ray_capacity import cpus_shortfall, gpus_shortfall, resources_shortfall
from router.rebalancer import Rebalancer
from router.request_tracker import ClientItem, RequestTracker
from router.worker_pool import SlotRestarts, WorkerHandle, WorkerPool, WorkerStatus
from router.worker_slots import WorkerLauncher, WorkerSlot, plan_slots

__all__ = [
    "Cluster",
    "RequestFailedError",
    "SlotRestarts",
    "WorkerHandle",
    "WorkerStatus",
]

logger = logging.getLogger(__name__)
# Requests being placed at once: each waits in a thread until its worker accepts it, which a
# worker does between engine steps (up to a few hundred ms on CPU). asyncio's default executor
# has os.cpu_count() + 4 threads, 6 on a 2-core node, so bursts queued behind each other there.
_MAX_PLACEMENTS_IN_FLIGHT = 64


class Cluster:
    def __init__(
        self,
        config: ClusterConfig,
        workers: Sequence[WorkerHandle],
        launcher: WorkerLauncher | None = None,
        slots: Sequence[WorkerSlot] = (),
    ) -> None:
        """``launcher`` starts a worker in the slot of one whose process died (None: never);
        ``slots`` are the workers' (default: a slot named after each, bound to no cores)."""
        self.config = config
        self.gateway_id = f"gateway-{uuid.uuid4().hex[:8]}"
        self.pool = WorkerPool(config, workers, launcher, slots)
        self.placements = Placements(config, self.pool)
        self.pump = OutputPump(self.gateway_id, self.pool, self.placements)
        self.forecaster = LatencyForecaster(
            self.pool.latency_model,
            StepBudgets(
                prefill=config.prefill_max_num_batched_tokens or config.max_num_batched_tokens,
                decode=config.max_num_batched_tokens,
            ),
            config.block_size,
            colocated=config.colocated,
            by_priority=config.scheduling_policy == "priority",
        )
        self.rebalancer = None
        if config.rebalance is not None:
            self.rebalancer = Rebalancer(
                config.rebalance,
                self.pool,
                self.forecast,
                self.placements.num_placed_on,
                self.placements.recover,
            )
        self._placing = ThreadPoolExecutor(
            _MAX_PLACEMENTS_IN_FLIGHT, thread_name_prefix="placement"
        )
        self._waiting_lock = threading.Lock()
        self._num_waiting = 0  # requests held in ``_wait_for_workers`` (under _waiting_lock)

    # ---- start and stop -----------------------------------------------------------------
    @classmethod
    def start(cls, config: ClusterConfig) -> Cluster:
        """Start (or join, with ``address``) Ray, place the worker actors, wait until ready."""
        binding = None
        if config.bind_worker_cpus:
            num_workers = config.num_prefill + config.num_decode
            threads = threads_per_worker(config.worker_num_cpus)
            binding = plan_cpu_binding(os.sched_getaffinity(0), num_workers, threads)
        if not ray.is_initialized():
            _unnice_local_workers()
            if binding is not None:  # before Ray starts: its processes inherit the binding
                bind_this_process(binding.other_cpus)
            start_ray(config.address, config.node_ip)  # a local Ray: on loopback by default
        if config.address is None:  # a joined cluster may still grow: Ray waits for it
            resources = ray.cluster_resources()
            num_ranks = config.num_worker_ranks  # a tensor-parallel worker: an actor per rank
            unit = (
                "workers" if num_ranks == config.num_prefill + config.num_decode else "worker ranks"
            )
            num_cpus, num_gpus = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
            shortfall = (
                cpus_shortfall(num_ranks, config.worker_num_cpus, num_cpus, unit)
                or gpus_shortfall(num_ranks, config.worker_num_gpus, num_gpus, unit)
                or resources_shortfall(config, resources)
            )
            if shortfall is not None:
                raise ValueError(shortfall)
        launcher = WorkerLauncher(config)
        slots = plan_slots(config, binding)
        decode_handles: dict[str, Any] = {}
        workers = []
        for slot in slots:  # decode workers first: the prefill ones are given their handles
            actor = launcher.launch(slot, slot.name, decode_handles)
            if slot.role == "decode":
                decode_handles[slot.name] = actor
            if launcher.needs_kv_cache_scales:  # the first worker calibrates for all
                launcher.use_kv_cache_scales(ray.get(actor.kv_cache_scales.remote()))
            workers.append(WorkerHandle(slot.name, slot.role, actor, slot=slot.name))
        ray.get([w.actor.ready.remote() for w in workers])
        if config.latency_profile:  # its steps go in each worker's first load report
            ray.get([w.actor.profile_latency.remote() for w in workers])
        workers.sort(key=lambda w: w.role != "prefill")  # listed prefill first
        cluster = cls(config, workers, launcher, slots)
        cluster.poll_until_reported()
        cluster.start_threads()
        return cluster

    def start_threads(self) -> None:
        """Start reading every worker's outputs, and the load monitor."""
        for worker in self.pool.workers.values():
            self.pump.start(worker)
        self.pool.spawn(self._monitor, name="load-monitor")
        if self.rebalancer is not None:
            self.pool.spawn(self.rebalancer.run, self.config.report_interval_s, name="rebalancer")

    def shutdown(self) -> None:
        self.pool.stop_workers()
        self._placing.shutdown(wait=False, cancel_futures=True)

    # ---- requests -----------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        allowed: AllowedWorkers | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """Token events of every sample, in order per sample, each exactly once.

        ``priority`` orders the request on its workers under ``scheduling_policy`` "priority"
        (lower first, then arrival; kept when it is resumed elsewhere); "fcfs" takes only 0.
        ``allowed``: the workers it is first placed among (``Placements.submit``).
        Raises ValueError for an invalid request and RequestFailedError when the cluster
        cannot complete it. Leaving the iterator early aborts the request everywhere.
        """
        entered_at = time.time()  # for the first token's trace
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[ClientItem] = asyncio.Queue()
        request = GenerateRequest(
            request_id or uuid.uuid4().hex,
            list(prompt_token_ids),
            params,
            self.gateway_id,
            cache_salt,
            priority=priority,
        )

        def sink(item: ClientItem) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        if self.rebalancer is not None:  # what a typical request is, for its signals
            self.rebalancer.note_request(len(request.prompt_token_ids), params.max_tokens or 1)

        await self._wait_for_workers()
        # Routing makes blocking Ray calls: keep them off the event loop that serves clients.
        submitted = loop.run_in_executor(self._placing, self.submit, request, sink, allowed)
        try:
            tracker = await asyncio.shield(submitted)
        except asyncio.CancelledError:  # the client left while routing: abort once it is placed

            def abort_once_placed(done: asyncio.Future[RequestTracker]) -> None:
                if not done.cancelled() and done.exception() is None:  # (cancelled: shut down)
                    self.abort(request.request_id)

            submitted.add_done_callback(abort_once_placed)
            raise
        try:
            while True:
                item = await items.get()
                if isinstance(item, TokenEvent):
                    if item.first_token_trace is not None:
                        item = _with_router_stamps(
                            item, item.first_token_trace, tracker, entered_at
                        )
                    yield item
                elif isinstance(item, RequestFailure):
                    raise RequestFailedError(item.message)
                else:
                    return
        finally:
            if not tracker.closed:
                self.abort(request.request_id)

    async def _wait_for_workers(self) -> None:
        """Hold a request while every live worker of a role it needs is late, until one
        reports in time or ``dead_after_s`` passes (by then each late worker answered or was
        taken out); then it is placed as routing allows. Raises RequestFailedError when
        ``max_waiting_requests`` wait already."""
        roles = ("decode",) if self.config.colocated else ("prefill", "decode")

        def must_wait() -> bool:
            return any(self.pool.every_worker_late(role) for role in roles)

        if not must_wait():
            return
        with self._waiting_lock:
            if self._num_waiting >= self.config.max_waiting_requests:
                raise RequestFailedError(
                    f"{self._num_waiting} requests are already waiting for a worker to answer "
                    "(every worker of a pool is late); retry later"
                )
            self._num_waiting += 1
        try:
            give_up_at = time.monotonic() + self.config.dead_after_s
            while must_wait() and time.monotonic() < give_up_at:
                await asyncio.sleep(self.config.report_interval_s)
        finally:
            with self._waiting_lock:
                self._num_waiting -= 1

    def submit(
        self,
        request: GenerateRequest,
        sink: Callable[[ClientItem], None],
        allowed: AllowedWorkers | None = None,
    ) -> RequestTracker:
        """Route and submit a request (among ``allowed``, see ``Placements.submit``); its
        events go to ``sink`` (from other threads)."""
        return self.placements.submit(request, sink, allowed)

    def abort(self, request_id: str) -> None:
        self.placements.abort(request_id)

    def forecast(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Forecast | None:
        """A prompt's predicted TTFT and TPOT on its best placement now (router/latency_forecast
        .py); None until the workers' step timings fit the latency model."""
        cached: dict[str, int] = {}
        index = self.pool.kv_index
        roles = ("decode",) if self.config.colocated else ("prefill",)
        prompt_loads = [load for role in roles for load in self.pool.routable_loads(role)]
        if index is not None:
            block_size = self.config.block_size
            hashes = servable_block_hashes(prompt_token_ids, block_size, cache_salt)
            hits = index.prefix_hits([load.worker_id for load in prompt_loads], hashes)
            cached = {w: h.num_device_blocks * block_size for w, h in hits.items()}
        prompt = PromptToPlace(len(prompt_token_ids), max_tokens, priority, cached)
        return self.forecaster.forecast(
            prompt,
            [] if self.config.colocated else prompt_loads,
            self.pool.routable_loads("decode"),
            self.placements.queued_prompts() if self.forecaster.by_priority else {},
        )

    def hold_placement(
        self, request_id: str, forecast: Forecast, num_prompt_tokens: int, num_sequences: int
    ) -> None:
        """Count an admitted prompt towards its forecast's best placement now, until it is
        routed (which replaces the charge) or the next load report finds it was not (a client
        gone first): the prompts admitted next, before it is routed, are predicted behind it."""
        prefill_id = None if self.config.colocated else forecast.prefill_worker_id
        self.pool.charge(
            request_id, prefill_id, forecast.decode_worker_id, num_prompt_tokens, num_sequences
        )

    def observe_latencies(
        self,
        forecast: Forecast,
        ttft_s: float,
        first_gap_s: float | None,
        later_gap_s: float | None,
    ) -> None:
        """A finished prompt's latencies as its client saw them against its ``forecast``: its
        TTFT, the gap between its first two tokens (None: one token; disaggregated, across
        the hand-off) and the mean of its gaps after that (None: fewer than three tokens).
        The latency model learns what the workers' steps do not show: for TTFT, and for the
        gaps of a decode, and how much longer the first gap is than those."""
        decode_residual = first_gap_excess = None
        if later_gap_s is not None:
            decode_residual = later_gap_s - forecast.steps_tpot_s
            if first_gap_s is not None:
                first_gap_excess = first_gap_s - later_gap_s
        self.pool.latency_model.observe_request(
            ttft_s - forecast.steps_ttft_s, decode_residual, first_gap_excess
        )

    # ---- statuses -----------------------------------------------------------------------
    def worker_statuses(self) -> list[WorkerStatus]:
        """The workers in the pools: in rotation or not, leaving out those whose slot has a
        newer worker."""
        return self.pool.statuses()

    def worker_restarts(self) -> list[SlotRestarts]:
        """Each slot's restarts so far (``--max-worker-restarts`` bounds them)."""
        return self.pool.restarts()

    def role_switches(self) -> dict[tuple[str, str], int]:
        """Workers moved between the pools by ``--rebalance`` so far, by (from, to) role."""
        return {} if self.rebalancer is None else self.rebalancer.switch_counts()

    def step_prediction_ratios(self) -> dict[str, StepRatios]:
        """The workers' reported steps' time over the latency model's predictions, by role."""
        return self.pool.latency_model.step_ratios()

    def prefix_hit_stats(self) -> PrefixHitStats | None:
        """The cached tokens found for the prompts kv_aware routed (None: another policy)."""
        return self.placements.prefix_hit_stats()

    def local_prefills(self) -> dict[str, int]:
        """Prompts routed to be prefilled on their decode worker so far, by reason."""
        return self.placements.local_prefills()

    def is_ready(self) -> bool:
        """At least one live worker can prefill and one can decode (a colocated one does both)."""
        alive_roles = {s.role for s in self.worker_statuses() if s.alive}
        can_prefill = "prefill" in alive_roles or (
            self.config.colocated and "decode" in alive_roles
        )
        return can_prefill and "decode" in alive_roles

    def queue_is_full(self) -> bool:
        """``max_waiting_requests`` wait for a worker already (every worker of a pool is late):
        the front doors refuse new requests with 503 before they start."""
        with self._waiting_lock:
            return self._num_waiting >= self.config.max_waiting_requests

    # ---- health -------------------------------------------------------------------------
    def poll(self) -> None:
        """One round of the load monitor: poll the pools, recover the requests of workers
        taken out of rotation, read the outputs of workers that joined, probe stalled ones."""
        changes = self.pool.poll(self.placements.is_open)
        for worker in changes.joined:  # first: a joined worker is routed to at once
            self.pump.start(worker)
        self.placements.recover(changes.lost)
        # after the recovery: a stalled worker comes back with none of its requests
        self.pool.probe_stalled(self.placements.is_open)

    def poll_until_reported(self, asked_after: float = float("-inf")) -> None:
        """Poll until every worker in rotation has reported in a report asked for at
        ``asked_after`` or later (default: any report). A worker that stays silent is taken
        out after ``dead_after_s``, which ends the wait too."""
        while True:
            self.poll()
            if self.pool.reported_since(asked_after):
                return
            time.sleep(0.01)

    def _monitor(self) -> None:
        while not self.pool.stopping.wait(self.config.report_interval_s):
            try:
                self.poll()
            except Exception:  # a bug: keep watching the workers all the same
                logger.exception("polling the workers' loads failed")


def _with_router_stamps(
    event: TokenEvent, trace: FirstTokenTrace, tracker: RequestTracker, entered_at: float
) -> TokenEvent:
    """A first token's event as ``generate`` yields it: its trace with the request's entry into
    the cluster, its placement's stamps and the time it is yielded (now)."""
    stamps = tracker.stamps
    trace = dataclasses.replace(
        trace,
        entered_at=entered_at,
        placing_at=stamps.placing_at,
        routed_at=stamps.routed_at,
        submit_sent_at=stamps.submit_sent_at,
        submit_returned_at=stamps.submit_returned_at,
        yielded_at=time.time(),
        decode_worker_id=tracker.decode_worker,
    )
    return dataclasses.replace(event, first_token_trace=trace)


def _unnice_local_workers() -> None:
    """Worker processes of a Ray this process starts run at niceness 0, unless the operator
    set ``RAY_worker_niceness`` (a running cluster keeps its own: deploy/ sets it on its nodes).

    Ray starts workers at niceness 15 so that busy tasks leave its driver and raylet room, but
    our workers run the engines, the critical path: on a CPU node shared with the gateway, a
    niced engine lost its core to it.
    """
    os.environ.setdefault("RAY_worker_niceness", "0")
