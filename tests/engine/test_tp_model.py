"""The sharded model against the one-rank model: ranks of a real gloo group (this process is
rank 0, spawned workers the others) each load their shard of a tiny checkpoint, run a prefill
and a decode step of a batch through the paged attention path, and every rank's logits must
equal the one-rank model's. Each rank's parameter bytes, and the bytes it reads from the
checkpoint, must be its share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from unittest.mock import patch

import pytest
import torch
from safetensors import safe_open

import engine.model_loader
from engine.attention.layer import Attention, LatentCacheAttention
from engine.model_config import ModelConfig, load_model_config
from engine.model_loader import load_model
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import CausalLM
from engine.parallel.group import TensorParallelGroup
from engine.parallel.shard import TensorParallelShard
from tests.conftest import ARCHITECTURES
from tests.engine.paged_runner import PagedRunner
from tests.engine.tp_ranks import RankPool

ATOL = 1e-4
CPU = torch.device("cpu")
PROMPT_LENGTHS = (17, 9, 23)
ROW_PARALLEL = ("o_proj", "down_proj")
# besides norms, whole on every rank: routers, and latent attention's down projections
REPLICATED = (
    ".mlp.gate.weight",
    ".mlp.gate.e_score_correction_bias",
    ".mlp.gate.bias",
    ".shared_expert_gate.weight",
    ".q_a_proj.weight",
    ".kv_a_proj_with_mqa.weight",
)
Backend = Literal["torch", "onednn"]


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    ranks = RankPool(num_workers=3)  # TP 4 at most
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints beyond the default tiny ones: MQA (one KV head) and row-parallel biases, both
    with a vocabulary that the ranks do not divide; and three configs for dummy weights."""
    from tests.fixtures.tiny_models import make_tiny_model, tiny_hf_config

    root = tmp_path_factory.mktemp("tp-variants")
    dirs = {
        "mqa": make_tiny_model(
            root / "mqa", "MistralForCausalLM", seed=7, num_key_value_heads=1, vocab_size=1001
        ),
        "biases": make_tiny_model(
            root / "biases",
            "LlamaForCausalLM",
            seed=8,
            attention_bias=True,
            mlp_bias=True,
            vocab_size=1001,
        ),
    }
    for name, arch, overrides in (
        ("dummy-qwen2", "Qwen2ForCausalLM", {}),
        ("dummy-biases", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
        ("dummy-qwen2-moe", "Qwen2MoeForCausalLM", {}),
    ):
        (root / name).mkdir()
        tiny_hf_config(arch, **overrides).save_pretrained(str(root / name))
        dirs[name] = root / name
    return dirs


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [
        torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]


def _run_batch(model: CausalLM, config: ModelConfig, num_kv_heads: int) -> torch.Tensor:
    """Logits of every prompt token: one prefill of all but the last token of each, then one
    decode step of the batch. [sum(PROMPT_LENGTHS), vocab_size]"""
    cache_config = dataclasses.replace(config, num_kv_heads=num_kv_heads)
    runner = PagedRunner(model, cache_config, num_blocks=96)  # 32 for each of 3 cache groups
    seqs = [runner.new_seq(prompt) for prompt in _prompts(config.vocab_size)]
    runner.step([(seq, len(seq.token_ids) - 1) for seq in seqs])
    runner.step([(seq, 1) for seq in seqs])
    return torch.cat([torch.stack(seq.logits) for seq in seqs])


class _ReadCounter:
    """Wraps safetensors' safe_open for the loader and counts the bytes of each tensor read."""

    def __init__(self) -> None:
        self.num_bytes = 0

    def __call__(self, *args: Any, **kwargs: Any) -> _CountingFile:
        return _CountingFile(self, safe_open(*args, **kwargs))


class _CountingFile:
    def __init__(self, counter: _ReadCounter, file: Any) -> None:
        self._counter, self._file = counter, file

    def __enter__(self) -> _CountingFile:
        self._file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._counted(self._file.get_tensor(name))

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self, self._file.get_slice(name))

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self._counter.num_bytes += tensor.numel() * tensor.element_size()
        return tensor


class _CountingSlice:
    def __init__(self, file: _CountingFile, tensor_slice: Any) -> None:
        self._file, self._slice = file, tensor_slice

    def get_shape(self) -> list[int]:
        return list(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._file._counted(self._slice[index])


def _load_counting(model_dir: Path, **kwargs: Any) -> tuple[LlamaForCausalLM, int]:
    """The model and the checkpoint bytes its loading read."""
    counter = _ReadCounter()
    with patch.object(engine.model_loader, "safe_open", counter):
        model = load_model(model_dir, load_model_config(model_dir), torch.float32, CPU, **kwargs)
    return model, counter.num_bytes


def _rank_case(
    group: TensorParallelGroup,
    model_dir: Path,
    load_format: str,
    backend: Backend,
    expert_parallel: bool = False,
) -> dict[str, Any]:
    """One rank: load its shard, run the batch; its logits, parameter bytes and bytes read."""
    config = load_model_config(model_dir)
    shard = TensorParallelShard.of(config, group.rank, group.size, expert_parallel)
    model, bytes_read = _load_counting(
        model_dir, shard=shard, group=group, load_format=load_format, linear_backend=backend
    )
    logits = _run_batch(model, model.config, model.shard.num_kv_heads)
    return {
        "logits": logits,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bytes_read": bytes_read,
        "shard": model.shard,
        "kv_heads_in_attention": [
            m.num_kv_heads
            for m in model.modules()
            if isinstance(m, (Attention, LatentCacheAttention))
        ],
    }


def _expected_bytes(whole: LlamaForCausalLM, shard: TensorParallelShard) -> tuple[int, int]:
    """What a rank holds and what it reads of ``whole``'s tensors: 1/N of each sharded one;
    norms (but MiniMax-M2's over all heads: its heads' slice) and MoE routers whole (each
    expert's columns split like a dense MLP's); row-parallel
    biases whole (zeros off rank 0, not read there); its KV heads'
    rows (one head each where heads are replicated); its vocab rows, padding not read. Latent
    attention's down projections are whole on every rank (the latent cache is replicated).
    Under expert parallelism a rank holds and reads its run of whole experts, biases too."""
    config = whole.config
    held = read = 0
    for name, param in whole.named_parameters():
        num_bytes = param.numel() * param.element_size()
        row_bytes = num_bytes // param.shape[0]
        if shard.expert_parallel and ".experts." in name:  # [experts, ...]
            held, read = (
                held + len(shard.experts) * row_bytes,
                read + len(shard.experts) * row_bytes,
            )
        elif config.qk_norm_across_heads and name.endswith(("q_norm.weight", "k_norm.weight")):
            # MiniMax-M2's norms over all heads: the rank's heads' slice
            heads = len(shard.q_heads) if "q_norm" in name else shard.num_kv_heads
            num = heads * config.head_dim * param.element_size()
            held, read = held + num, read + num
        elif "norm" in name or name.endswith(REPLICATED):
            held, read = held + num_bytes, read + num_bytes  # norms, routers, MLA's down proj.
        elif name.endswith(".experts.down_proj_bias") or (
            name.endswith(".bias") and any(f".{m}." in name for m in ROW_PARALLEL)
        ):
            held, read = held + num_bytes, read + (num_bytes if shard.rank == 0 else 0)
        elif "embed_tokens" in name or "lm_head" in name:
            num_real = len(range(shard.vocab.start, min(shard.vocab.stop, config.vocab_size)))
            held, read = held + shard.vocab_rows * row_bytes, read + num_real * row_bytes
        elif "qkv_proj" in name:
            rows = (len(shard.q_heads) + 2 * shard.num_kv_heads) * config.head_dim
            held, read = held + rows * row_bytes, read + rows * row_bytes
        else:
            held, read = held + num_bytes // shard.size, read + num_bytes // shard.size
    return held, read


def _check_ranks(
    pool: RankPool,
    model_dir: Path,
    size: int,
    load_format: str = "auto",
    backend: Backend = "torch",
    expert_parallel: bool = False,
) -> list[dict[str, Any]]:
    whole, whole_read = _load_counting(model_dir, load_format=load_format, linear_backend=backend)
    reference = _run_batch(whole, whole.config, whole.config.num_kv_heads)
    unpacked = (
        whole if backend == "torch" else _load_counting(model_dir, load_format=load_format)[0]
    )
    results = pool.run(_rank_case, model_dir, load_format, backend, expert_parallel, size=size)
    for rank, result in enumerate(results):
        shard = result["shard"]
        assert shard == TensorParallelShard.of(whole.config, rank, size, expert_parallel)
        assert result["kv_heads_in_attention"] == [shard.num_kv_heads] * whole.config.num_layers
        torch.testing.assert_close(result["logits"], reference, atol=ATOL, rtol=0)
        assert torch.equal(result["logits"], results[0]["logits"]), f"rank {rank} differs"
        if backend == "torch":
            held, read = _expected_bytes(unpacked, shard)
            assert result["param_bytes"] == held, f"rank {rank}"
            assert result["bytes_read"] == (read if load_format != "dummy" else 0), f"rank {rank}"
            assert result["bytes_read"] < whole_read or load_format == "dummy"
    return results


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_two_ranks_match_one(
    pool: RankPool, model_dirs: dict[str, Path], architecture: str
) -> None:
    _check_ranks(pool, model_dirs[architecture], size=2)


@pytest.mark.parametrize("size", [2, 4])
def test_mqa_replicates_the_kv_head_on_every_rank(
    pool: RankPool, variant_dirs: dict[str, Path], size: int
) -> None:
    results = _check_ranks(pool, variant_dirs["mqa"], size=size)
    assert [r["shard"].kv_heads for r in results] == [range(0, 1)] * size
    assert results[-1]["shard"].vocab.stop > 1001  # padding rows past the vocabulary


def test_row_parallel_biases_are_added_once(pool: RankPool, variant_dirs: dict[str, Path]) -> None:
    _check_ranks(pool, variant_dirs["biases"], size=2)


def test_tied_logits_through_onednn(pool: RankPool, model_dirs: dict[str, Path]) -> None:
    _check_ranks(pool, model_dirs["MistralForCausalLM"], size=2, backend="onednn")


@pytest.mark.parametrize("name", ["dummy-qwen2", "dummy-biases", "dummy-qwen2-moe"])
def test_dummy_weights_are_slices_of_the_one_rank_dummy_model(
    pool: RankPool, variant_dirs: dict[str, Path], name: str
) -> None:
    _check_ranks(pool, variant_dirs[name], size=2, load_format="dummy")


MOE_ARCHITECTURES = [
    arch
    for arch in ARCHITECTURES
    if arch.startswith(("Mixtral", "Qwen2Moe", "Qwen3Moe", "Deepseek", "GptOss"))
]


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_expert_parallel_ranks_match_one(
    pool: RankPool, model_dirs: dict[str, Path], architecture: str
) -> None:
    """Each rank holds (and reads) its run of whole experts alone; the logits are the one
    rank's."""
    results = _check_ranks(pool, model_dirs[architecture], size=2, expert_parallel=True)
    num_experts = results[0]["shard"].experts.stop + len(results[1]["shard"].experts)
    assert [r["shard"].experts for r in results] == [
        range(0, num_experts // 2),
        range(num_experts // 2, num_experts),
    ]


def test_expert_parallel_ranks_of_uneven_runs(pool: RankPool, model_dirs: dict[str, Path]) -> None:
    """Six experts over four ranks: two, two, one and one."""
    results = _check_ranks(pool, model_dirs["Qwen3MoeForCausalLM"], size=4, expert_parallel=True)
    assert [r["shard"].experts for r in results] == [
        range(0, 2),
        range(2, 4),
        range(4, 5),
        range(5, 6),
    ]


def test_expert_parallel_dummy_weights_are_slices_of_the_one_rank_dummy_model(
    pool: RankPool, variant_dirs: dict[str, Path]
) -> None:
    _check_ranks(
        pool, variant_dirs["dummy-qwen2-moe"], size=2, load_format="dummy", expert_parallel=True
    )


def test_a_group_of_another_rank_is_refused(model_dirs: dict[str, Path]) -> None:
    config = load_model_config(model_dirs["LlamaForCausalLM"])
    shard = TensorParallelShard.of(config, 1, 2)
    with pytest.raises(ValueError, match="shard of rank 1 of 2 given a group where this process"):
        LlamaForCausalLM(config, shard)
