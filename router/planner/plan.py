"""The planner's search: every layout that fits the devices, simulated at the target rate; the
cheapest (fewest devices) whose SLO attainment reaches the target wins, ties going to the higher
goodput, then to the more headroom under the SLOs (p90 TTFT and TPOT). Each layout is also
swept over rates for the goodput-vs-rate plot.

A layout is colocated xN (N workers that both prefill and decode) or xPyD (P prefill workers of
tensor-parallel size a, D decode workers of size b). A worker's KV cache is what its devices'
memory holds after its share of the weights (``memory_fraction`` of it, as
``--gpu-memory-utilization``); a size whose weights do not fit, or that does not divide the
model's attention heads, is left out.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from router.local_prefill import LocalPrefillRule
from router.planner.hardware import Hardware, StepTimeModel, transfer_seconds
from router.planner.model_costs import ModelCosts
from router.planner.shared_host import HostShare
from router.planner.simulator import (
    ClusterShape,
    SimulatedRequest,
    Simulation,
    WorkerShape,
    WorkloadRequest,
)
from router.planner.speculation import Speculation
from router.planner.workload import PlanWorkload

MAX_KV_BLOCKS = 1 << 16  # a worker's simulated cache is capped here (more never binds)


@dataclass(frozen=True, slots=True)
class Layout:
    num_prefill: int  # 0: colocated
    prefill_tp: int
    num_decode: int
    decode_tp: int

    @property
    def devices(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def name(self) -> str:
        tp = lambda size: f" tp{size}" if size > 1 else ""  # noqa: E731
        if not self.num_prefill:
            return f"colocated x{self.num_decode}{tp(self.decode_tp)}"
        return f"{self.num_prefill}P{tp(self.prefill_tp)} {self.num_decode}D{tp(self.decode_tp)}"

    def serve_flags(self) -> list[str]:
        """The ``pdserve serve`` flags of this layout."""
        flags = ["--prefill", str(self.num_prefill), "--decode", str(self.num_decode)]
        if self.num_prefill:
            flags += ["--prefill-tp", str(self.prefill_tp), "--decode-tp", str(self.decode_tp)]
        elif self.decode_tp > 1:
            flags += ["--tensor-parallel-size", str(self.decode_tp)]
        return flags


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # the share of requests that must meet both

    def met_by(self, request: SimulatedRequest) -> bool:
        ttft, tpot = request.ttft_s, request.tpot_s
        return ttft is not None and ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


@dataclass(frozen=True, slots=True)
class LayoutResult:
    layout: Layout
    rate: float
    attainment: float  # requests meeting both SLOs / requests
    goodput: float  # of the offered requests per second, those meeting both SLOs
    ttft_s: dict[str, float]  # p50, p90, p99
    tpot_s: dict[str, float]
    # kv_aware, disaggregated: the share of requests prefilled by their decode worker (whose
    # cache held their prefix), and of those whose prefill worker fetched a prefix from one
    local_prefill_share: float = 0.0
    fetch_share: float = 0.0
    # the host tiers (--kv-offload-gb): prefix blocks copied back from them, a request
    host_blocks_per_request: float = 0.0

    def meets(self, slo: Slo) -> bool:
        return self.attainment >= slo.attainment

    def headroom(self, slo: Slo) -> float:
        """How far its p90 TTFT and TPOT stay below the SLOs, as a share of them (the smaller
        of the two; 0 at an SLO, below 0 past it)."""
        ttft, tpot = self.ttft_s.get("p90"), self.tpot_s.get("p90")
        return min(
            1.0 if ttft is None else 1.0 - ttft / slo.ttft_s,
            1.0 if tpot is None else 1.0 - tpot / slo.tpot_s,
        )


@dataclass(frozen=True, slots=True)
class Planner:
    model: ModelCosts
    hardware: Hardware
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    prefill_max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    memory_fraction: float = 0.9
    num_kv_blocks: int | None = None  # per worker, instead of what its memory holds
    router_policy: str = "kv_aware"  # the router's, simulated (simulator.ROUTER_POLICIES)
    local_prefill: LocalPrefillRule = LocalPrefillRule()  # the router's conditional rule
    speculation: Speculation | None = None  # the decoding workers' speculative decoding
    kv_offload_gb: float = 0.0  # each worker rank's host tier of the prefix cache

    def layouts(self, max_devices: int, tp_sizes: Sequence[int]) -> list[Layout]:
        sizes = [tp for tp in tp_sizes if self.kv_blocks(tp) > 0 and self._divides(tp)]
        found = []
        for tp in sizes:
            for n in range(1, max_devices // tp + 1):
                found.append(Layout(0, 1, n, tp))
        for prefill_tp in sizes:
            for decode_tp in sizes:
                for p in range(1, max_devices // prefill_tp + 1):
                    for d in range(1, (max_devices - p * prefill_tp) // decode_tp + 1):
                        found.append(Layout(p, prefill_tp, d, decode_tp))
        return sorted(found, key=lambda layout: (layout.devices, layout.name))

    def _divides(self, tp: int) -> bool:
        heads = self.model.num_kv_heads
        return heads % tp == 0 or tp % heads == 0

    def kv_blocks(self, tp: int) -> int:
        """KV blocks of a worker of ``tp`` devices (0: its weights do not fit)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        free = (
            tp * self.hardware.device_memory_bytes * self.memory_fraction - self.model.weight_bytes
        )
        block_bytes = self.model.kv_bytes_per_block(self.block_size)
        return max(0, min(MAX_KV_BLOCKS, int(free // block_bytes)))

    def cluster(self, layout: Layout) -> ClusterShape:
        decode = self._workers(layout.num_decode, layout.decode_tp, self.max_num_batched_tokens)
        prefill = None
        if layout.num_prefill:
            budget = self.prefill_max_num_batched_tokens or self.max_num_batched_tokens
            prefill = self._workers(layout.num_prefill, layout.prefill_tp, budget)
        return ClusterShape(
            decode,
            prefill,
            self.block_size,
            lambda blocks: transfer_seconds(self.hardware, self.model, self.block_size, blocks),
            self.hardware.path_overhead_s,
            self.router_policy,
            self._host(),
            prefix_fetch=layout.prefill_tp == 1 and layout.decode_tp == 1,
            local_prefill=self.local_prefill,
            speculation=self.speculation,
            cache_groups=self.model.cache_groups,
        )

    def _host(self) -> HostShare | None:
        """The cores the workers share, on a CPU machine."""
        hardware = self.hardware
        if not hardware.host_cores:
            return None
        return HostShare(
            hardware.host_cores,
            hardware.host_seconds_per_token,
            hardware.host_seconds_per_handoff,
            hardware.host_front_door_threads,
            hardware.host_worker_seconds_per_token,
            hardware.host_worker_seconds_per_batch,
            hardware.host_seconds_per_batch,
        )

    def _workers(self, count: int, tp: int, budget: int) -> WorkerShape:
        # a rank's share of a block: its KV heads' (split up to the heads, replicated beyond)
        rank_block_bytes = self.model.kv_bytes_per_block(self.block_size) / min(
            tp, self.model.num_kv_heads
        )
        return WorkerShape(
            count,
            StepTimeModel(self.model, self.hardware, tp),
            self.kv_blocks(tp),
            budget,
            self.max_num_seqs,
            tp * self.hardware.worker_threads,
            # as serve sizes it: a rank's GiB over its share of a block; the ranks copy at once
            num_host_slots=int(self.kv_offload_gb * 2**30 // rank_block_bytes),
            seconds_per_swapped_block=rank_block_bytes / self.hardware.host_copy_bytes_per_s,
        )

    def simulate(self, layout: Layout, workload: PlanWorkload, slo: Slo) -> LayoutResult:
        capped = fitting(workload.requests(), self.model.max_model_len)
        simulation = Simulation(self.cluster(layout), capped)
        simulated = simulation.run()
        attainment = sum(slo.met_by(s) for s in simulated) / len(simulated)
        return LayoutResult(
            layout,
            workload.rate,
            attainment,
            attainment * workload.rate,
            _percentiles([s.ttft_s for s in simulated]),
            _percentiles([s.tpot_s for s in simulated]),
            simulation.num_local_prefills / len(simulated),
            simulation.num_fetches / len(simulated),
            simulation.num_blocks_from_host / len(simulated),
        )

    def choose(
        self, layouts: Sequence[Layout], workload: PlanWorkload, slo: Slo
    ) -> tuple[LayoutResult | None, list[LayoutResult]]:
        """The cheapest layout meeting ``slo`` at the workload's rate (None: none does), and the
        results of the layouts simulated, cheapest first: every one up to the first device
        count at which one meets the SLO (those costing more are not simulated)."""
        results: list[LayoutResult] = []
        for layout in sorted(layouts, key=lambda layout: layout.devices):
            meeting = [r for r in results if r.meets(slo)]
            if meeting and layout.devices > meeting[0].layout.devices:
                break
            results.append(self.simulate(layout, workload, slo))
        meeting = [r for r in results if r.meets(slo)]
        if not meeting:
            return None, results
        return max(meeting, key=lambda r: (r.goodput, r.headroom(slo))), results

    def sweep(
        self, layout: Layout, workload: PlanWorkload, slo: Slo, rates: Sequence[float]
    ) -> list[LayoutResult]:
        return [self.simulate(layout, workload.at_rate(rate), slo) for rate in rates]


def fitting(requests: Sequence[WorkloadRequest], max_model_len: int) -> list[WorkloadRequest]:
    """The requests whose prompt and output fit the model, less the later turns of a
    conversation whose earlier turn does not."""
    kept: list[WorkloadRequest] = []
    kept_ids: set[int] = set()
    for request in requests:
        earlier = request.follows
        if len(request.prompt_token_ids) + request.output_len <= max_model_len and (
            earlier is None or id(earlier) in kept_ids
        ):
            kept.append(request)
            kept_ids.add(id(request))
    return kept


def _percentiles(values: Sequence[float | None]) -> dict[str, float]:
    known = sorted(v for v in values if v is not None)
    if not known:
        return {}
    if len(known) == 1:
        return {"p50": known[0], "p90": known[0], "p99": known[0]}
    cuts = statistics.quantiles(known, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def rates_around(rate: float, num: int = 8) -> list[float]:
    """Rates for the goodput plot: from a quarter of the target to twice it."""
    return [rate * (0.25 + 1.75 * i / (num - 1)) for i in range(num)]
