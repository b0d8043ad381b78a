"""The engine's narrow configs: what to load, how to cache, where, and over how many ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.cpu_features import cpu_flags, has_native_bfloat16
from engine.kv_cache.budget import KVBudget
from engine.kv_cache.kv_quantization import KV_CACHE_DTYPES, KVCacheScales, is_quantized

if TYPE_CHECKING:  # torch-free at import: the router builds these configs on a CPU head node
    import torch

_DTYPE_NAMES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
LoadFormat = Literal["auto", "safetensors", "dummy"]
LINEAR_BACKENDS = ("auto", "torch", "onednn")  # engine/kernels/linear.py
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")  # engine/attention/selector.py


@dataclass(frozen=True, slots=True)
class LoadConfig:
    model_dir: str  # Hugging Face model directory
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (checkpoint's, else float32)
    device: str | None = None  # cpu | cuda[:N]; None picks cuda when present
    load_format: LoadFormat = "auto"  # dummy: random weights from config.json alone
    seed: int = 0  # dummy weights and the unseeded sampling RNG
    max_model_len: int | None = None  # cap on prompt + output tokens (default: the model's)
    linear_backend: str = "auto"  # torch | onednn | auto (onednn on CPU where it runs)
    # How the loaded model runs, beside device, dtype and linear_backend (vLLM keeps
    # enforce_eager in its ModelConfig with the same fields); the cluster hands it to every
    # worker through ClusterConfig.load_config(). Graphs need CUDA and the Triton attention
    # backend: elsewhere every step is eager anyway (engine/decode_graphs.py).
    enforce_eager: bool = False  # never capture CUDA graphs of decode steps
    # largest decode batch captured, in sequences (also <= max_num_seqs); with speculative
    # decoding its graph has a row per draft besides (engine/decode_graphs.py)
    max_capture_batch_size: int = 256
    # where the tokenizer is, when not in model_dir (vLLM's ``tokenizer``); the engine reads it
    # only to compile structured outputs against the vocabulary
    tokenizer: str | None = None
    # vLLM's trust_remote_code: a tokenizer that ships as code in its directory may run it
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be one of auto, safetensors, dummy; got {self.load_format!r}"
            )
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; "
                f"got {self.linear_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_capture_batch_size < 1:
            raise ValueError(
                f"max_capture_batch_size must be >= 1, got {self.max_capture_batch_size}"
            )

    def torch_device(self) -> torch.device:
        import torch

        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        import torch

        name = self.dtype_name(checkpoint_dtype, self.torch_device().type)
        dtype: torch.dtype = getattr(torch, name)
        return dtype

    def dtype_name(self, checkpoint_dtype: str | None, device_type: str) -> str:
        """The model's dtype on a ``device_type`` ("cpu", "cuda") device, e.g. "bfloat16": the
        configured one, else the checkpoint's; but a float16 checkpoint under "auto" runs on
        a CPU in bfloat16 where the CPU has native bfloat16 dot products, else in float32
        (engine/cpu_features.py: float16 has no fast path on a CPU here)."""
        name = self.dtype
        if name == "auto":
            name = checkpoint_dtype if checkpoint_dtype in _DTYPE_NAMES else "float32"
            if name == "float16" and device_type == "cpu":
                name = "bfloat16" if has_native_bfloat16(cpu_flags()) else "float32"
        name = _DTYPE_ALIASES.get(name, name)
        if name not in _DTYPE_NAMES:
            names = ", ".join(_DTYPE_NAMES)
            raise ValueError(f"dtype must be one of auto, {names}; got {self.dtype!r}")
        return name


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    budget: KVBudget = field(default_factory=KVBudget)
    attention_backend: str = "auto"  # torch | triton | cpu | auto (engine/attention/selector.py)
    # what the cache stores: auto (the model's dtype) | fp8_e4m3 | int8
    # (engine/kv_cache/kv_quantization.py; parse_kv_cache_dtype reads the aliases)
    kv_cache_dtype: str = "auto"
    # a quantized cache's scales, when given (the cluster hands every worker the same ones);
    # None: the checkpoint's, else calibrated at start-up
    kv_cache_scales: KVCacheScales | None = None
    # GiB of host memory per rank for a tier that keeps the blocks the KV cache evicts, LRU
    # (docs/kv-offload.md; engine/kv_cache/host_tier.py); 0: none. Needs prefix caching.
    kv_offload_gb: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        scales = self.kv_cache_scales
        if scales is not None and scales.kv_cache_dtype != self.kv_cache_dtype:
            raise ValueError(
                f"kv_cache_scales are for a {scales.kv_cache_dtype} cache, kv_cache_dtype is "
                f"{self.kv_cache_dtype}"
            )

        if not self.kv_offload_gb >= 0:
            raise ValueError(f"kv_offload_gb must be >= 0, got {self.kv_offload_gb}")
        if self.kv_offload_gb > 0 and not self.enable_prefix_caching:
            raise ValueError(
                f"kv_offload_gb ({self.kv_offload_gb}) needs enable_prefix_caching: the host "
                "tier keeps cached blocks by their prefix hashes"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                f"got {self.attention_backend!r}"
            )

    @property
    def quantized_kv(self) -> bool:
        return is_quantized(self.kv_cache_dtype)


TENSOR_PARALLEL_BACKENDS = ("auto", "gloo", "nccl")  # engine/parallel/group.py


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many ranks one worker runs on and how they meet (engine/parallel/)."""

    tensor_parallel_size: int = 1  # ranks holding 1/N of the weights and KV heads each
    # a mixture-of-experts model's routed experts dealt out whole over the ranks rather than
    # each split by columns (engine/parallel/shard.py); vLLM's --enable-expert-parallel
    expert_parallel: bool = False
    backend: str = "auto"  # gloo | nccl | auto (nccl on CUDA, gloo on CPU)
    host: str = "127.0.0.1"  # where rank 0 hosts the group's store; the ranks share a machine
    port: int = 0  # the store's port; 0: not chosen yet (a worker of one rank needs none)
    # rank 0 waits at most this long in each collective: a follower that died or hangs fails
    # the step within it (followers wait for rank 0's next step without a practical bound)
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
        if self.backend not in TENSOR_PARALLEL_BACKENDS:
            raise ValueError(
                f"tensor-parallel backend must be one of {', '.join(TENSOR_PARALLEL_BACKENDS)}; "
                f"got {self.backend!r}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0 .. 65535, got {self.port}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"expert_parallel must be a bool, got {self.expert_parallel!r}")

    def resolved_backend(self, device: torch.device) -> str:
        """The collective backend for ranks on ``device``."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.type == "cuda" else "gloo"
