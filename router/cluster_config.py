"""What a pdserve cluster is made of: the pools, the model, routing and KV transfer settings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.kv_cache.budget import KVBudget
from engine.kv_cache.kv_quantization import KV_CACHE_DTYPES
from engine.model_config import load_model_config
from engine.parallel.shard import check_tensor_parallel_size
from engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig, SchedulingPolicy
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_checks import check_draft_model
from engine.speculative.prediction_checks import check_prediction_layer
from kv_transfer.policy import FailurePolicy, TransferConfig, describe_auto, transports_for
from router.kv_aware import KVAwareWeights
from router.local_prefill import LocalPrefillRule
from router.policies import POLICY_NAMES
from router.rebalance_policy import RebalanceConfig


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model_dir: str
    num_prefill: int = 1  # 0: colocated mode, decode workers run both phases
    num_decode: int = 1
    device: str = "cpu"  # cpu | cuda
    dtype: str = "auto"
    attention_backend: str = (
        "auto"  # auto | torch | triton | cpu (engine_config.ATTENTION_BACKENDS)
    )
    # what every worker's KV cache stores: auto (the model's dtype) | fp8_e4m3 | int8; a
    # quantized cache's scales are the checkpoint's, else the first worker calibrates them and
    # the others (and every restart) get the same (router/cluster.py)
    kv_cache_dtype: str = "auto"
    # GiB of host memory per worker rank for blocks its KV cache evicts (LRU), brought back on a
    # hit (docs/kv-offload.md); 0: none
    kv_offload_gb: float = 0.0
    enforce_eager: bool = False  # no CUDA graphs of decode steps (LoadConfig.enforce_eager)
    trust_remote_code: bool = False  # a tokenizer that ships as code may run it (vLLM's)
    address: str | None = None  # None: start a local Ray; "auto": join the running cluster
    # this node's address for Ray (router.local_ray): a local Ray's processes listen on it, on
    # 127.0.0.1 only when None; a joined cluster's, when None, is the one Ray finds
    node_ip: str | None = None
    # how prompts find their workers (router/policies.py); kv_aware follows the workers' KV
    # events and weighs cached prefixes against queues by ``kv_aware``'s weights
    router_policy: str = "kv_aware"
    kv_aware: KVAwareWeights = field(default_factory=KVAwareWeights)
    kv_transport: str = "auto"  # auto: per pair, kv_transfer.policy.transport_between
    data_plane_host: str = "auto"  # auto: each worker binds to its node's cluster address
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # the order each worker serves its requests in: "fcfs" (arrival) or "priority" (each
    # request's priority, lower first, then arrival; as vLLM's --scheduling-policy)
    scheduling_policy: SchedulingPolicy = "fcfs"
    # every worker schedules and launches each step before the one before it has given its
    # tokens, overlapping host work with the forward (vLLM's --async-scheduling); not with
    # speculative decoding
    async_scheduling: bool = False
    prefill_max_num_batched_tokens: int | None = None  # the prefill pool's; None: as above
    local_prefill: LocalPrefillRule = field(default_factory=LocalPrefillRule)  # disaggregated
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9  # cuda: of each GPU, for the workers sharing it together
    max_model_len: int | None = None
    # speculative decoding (prompt lookup or a draft model) on the decode (and colocated)
    # workers; None: off. Prefill workers sample only each prompt's first token, so they never
    # speculate (nor load a draft model).
    speculative: SpeculativeConfig | None = None
    # tensor parallelism: the ranks of each prefill (decode, colocated) worker, one Ray actor
    # each, placed together on one node; a rank holds 1/N of the weights and KV heads
    prefill_tp: int = 1
    decode_tp: int = 1
    # each worker's routed experts dealt out whole over its ranks (--enable-expert-parallel)
    expert_parallel: bool = False
    worker_num_cpus: float = 1.0  # Ray CPUs per worker rank (0 in tests)
    worker_num_gpus: float = 0.0  # GPUs per worker rank; fractions share a GPU
    bind_worker_cpus: bool = False  # local Ray only: each worker on cores of its own
    prefill_resources: dict[str, float] = field(default_factory=dict)  # e.g. {"prefill": 1}
    decode_resources: dict[str, float] = field(default_factory=dict)
    transfer_timeout_s: float = 30.0
    kv_transfer_checksum: bool = False  # receivers check a CRC32 of each transfer (TransferConfig)
    failure_policy: FailurePolicy = "recompute"
    report_interval_s: float = 0.5  # how often the router polls worker load
    # each worker runs a few synthetic requests at start-up (engine/latency_profile.py), so the
    # router's latency model has step times to predict from before any traffic
    latency_profile: bool = False
    # move workers between the prefill and decode pools as the traffic shifts (--rebalance,
    # router/rebalancer.py); None: the pools keep their sizes
    rebalance: RebalanceConfig | None = None
    # a worker whose latest load report is older is late: routed to only when its pool has no
    # worker that reported in time
    late_after_s: float = 2.0
    # a worker silent this long is out of rotation (its requests recovered elsewhere); one whose
    # process is gone is out at once
    dead_after_s: float = 30.0
    # requests held by the router while every live worker of a pool is late (more: 503)
    max_waiting_requests: int = 1024
    max_retries: int = 3  # re-routes per request after worker failures
    # times each worker slot gets a new worker after its worker's process died (0: never); the
    # first start waits restart_delay_s, each failed start doubles the wait (at most 60 s)
    max_worker_restarts: int = 10
    restart_delay_s: float = 1.0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("a cluster needs --decode >= 1 worker and --prefill >= 0")
        if (
            self.prefill_max_num_batched_tokens is not None
            and self.prefill_max_num_batched_tokens < 1
        ):
            raise ValueError(
                "--prefill-max-num-batched-tokens must be >= 1, "
                f"got {self.prefill_max_num_batched_tokens}"
            )
        if self.dead_after_s <= 0:
            raise ValueError(f"--worker-dead-after-s must be > 0, got {self.dead_after_s}")
        if self.max_worker_restarts < 0:
            raise ValueError(
                f"--max-worker-restarts must be >= 0 (0: never), got {self.max_worker_restarts}"
            )
        if self.restart_delay_s < 0:
            raise ValueError(f"restart_delay_s must be >= 0, got {self.restart_delay_s}")
        if self.bind_worker_cpus and self.address is not None:
            raise ValueError(
                "--bind-worker-cpus binds the workers of a Ray this command starts; "
                "a joined cluster (--address) divides its nodes' cores itself"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        usable = transports_for(self.device)
        if self.kv_transport != "auto" and self.kv_transport not in usable:
            raise ValueError(
                f"--kv-transport {self.kv_transport} cannot move {self.device} KV caches; "
                f"with --device {self.device} use auto, {', '.join(usable[:-1])}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.router_policy not in POLICY_NAMES:
            raise ValueError(
                f"router_policy must be one of {', '.join(POLICY_NAMES)}; "
                f"got {self.router_policy!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                f"got {self.scheduling_policy!r}"
            )
        if self.async_scheduling and self.speculative is not None:
            raise ValueError(
                "--async-scheduling does not combine with --speculative-config: drafts are "
                "proposed from the tokens of the step before, which async scheduling has not "
                "yet seen"
            )
        self._check_engine_configs()
        self._check_tensor_parallel()
        self._check_drafter()
        self._check_rebalance()

    def _check_rebalance(self) -> None:
        """A worker that changes role must fit where the other role's workers run."""
        if self.rebalance is None:
            return
        if self.colocated:
            raise ValueError(
                "--rebalance moves workers between the prefill and decode pools; with "
                "--prefill 0 every worker does both"
            )
        if self.prefill_resources != self.decode_resources:
            raise ValueError(
                "--rebalance needs both pools' workers to fit the same nodes: "
                "--prefill-resource and --decode-resource differ"
            )

    def _check_drafter(self) -> None:
        """A draft model (``--speculative-config`` of method draft_model) the decode workers
        can run beside the model, or a prediction layer (method mtp) every worker can hold:
        refused here, naming the field, not by each worker."""
        if self.speculative is None or self.speculative.method == "ngram":
            return
        target = load_model_config(self.model_dir)
        if self.speculative.method == "mtp":
            check_prediction_layer(target)
            return
        max_model_len = self.max_model_len or target.max_position_embeddings
        check_draft_model(self.speculative, target, max_model_len)

    def _check_tensor_parallel(self) -> None:
        """Refuse, naming the flag and the numbers, a TP size the model's heads cannot split or
        a layout that cannot run it."""
        for flag, size in (("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{flag} must be an int >= 1, got {size!r}")
        sizes = [("--decode-tp", self.decode_tp)]
        if not self.colocated:
            sizes.insert(0, ("--prefill-tp", self.prefill_tp))
        if all(size == 1 for _, size in sizes):
            return
        if self.bind_worker_cpus:
            flag, size = max(sizes, key=lambda named: named[1])
            raise ValueError(
                "--bind-worker-cpus gives each worker process cores of its own; a worker of "
                f"{flag} {size} is {size} processes: leave binding off"
            )
        model = load_model_config(self.model_dir)
        for flag, size in sizes:
            try:
                check_tensor_parallel_size(model, size, self.expert_parallel)
            except ValueError as error:  # "tensor_parallel_size 3 must ..." -> "--decode-tp 3"
                raise ValueError(str(error).replace("tensor_parallel_size", flag, 1)) from None

    def parallel_config(self, role: str) -> ParallelConfig:
        """The rank group of each worker of ``role`` ("prefill" | "decode"): its size (its rank
        0 picks the port of the group's store when it starts; the ranks share its node)."""
        size = self.prefill_tp if role == "prefill" else self.decode_tp
        return ParallelConfig(size, expert_parallel=self.expert_parallel)

    @property
    def num_worker_ranks(self) -> int:
        """Ray actors of all the workers' ranks together: what the pools reserve."""
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    def _check_engine_configs(self) -> None:
        """Build what every worker builds, so that a bad engine flag is refused here, naming
        the flag, rather than by each worker once Ray has started."""
        try:
            self.load_config()
            self.cache_config()
            self.scheduler_config()
            self.prefill_scheduler_config()
        except ValueError as error:  # "max_num_seqs must be >= 1" -> "--max-num-seqs must ..."
            message = re.sub(
                r"^(\w+) must", lambda m: f"--{m[1].replace('_', '-')} must", str(error)
            )
            raise ValueError(message) from None

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    def load_config(self) -> LoadConfig:
        return LoadConfig(
            self.model_dir,
            self.dtype,
            self.device,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            trust_remote_code=self.trust_remote_code,
        )

    def cache_config(self) -> CacheConfig:
        """Each worker's cache; on cuda its memory is its GPU share of the utilization (two
        workers of 0.5 GPU at 0.9 take 0.45 of the GPU each)."""
        gpu_share = min(1.0, self.worker_num_gpus) if self.worker_num_gpus > 0 else 1.0
        budget = KVBudget(
            num_blocks=self.num_kv_blocks,
            memory_fraction=self.gpu_memory_utilization * gpu_share,
        )
        return CacheConfig(
            self.block_size,
            budget=budget,
            attention_backend=self.attention_backend,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_offload_gb=self.kv_offload_gb,
        )

    def scheduler_config(self) -> SchedulerConfig:
        """The decode (and colocated) workers' scheduler settings."""
        return SchedulerConfig(
            self.max_num_seqs,
            self.max_num_batched_tokens,
            policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
        )

    def prefill_scheduler_config(self) -> SchedulerConfig:
        """The prefill workers' scheduler settings: their own step budget, if given."""
        budget = self.prefill_max_num_batched_tokens
        return SchedulerConfig(
            self.max_num_seqs,
            budget or self.max_num_batched_tokens,
            policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
        )

    @property
    def transport_in_words(self) -> str:
        """The KV transport the workers use: the one named, or auto's per-pair rule."""
        if self.kv_transport == "auto":
            return describe_auto(self.device)
        return self.kv_transport

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(
            transport=self.kv_transport,
            host=self.data_plane_host,
            timeout_s=self.transfer_timeout_s,
            failure_policy=self.failure_policy,
            checksum=self.kv_transfer_checksum,
        )
