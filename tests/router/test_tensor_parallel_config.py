"""Tensor-parallel workers as ``serve`` configures them: the sizes a model's heads can split,
the layouts that can run them, and where each rank's actor is placed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.cli import build_parser
from router.rank_placement import MIN_BUNDLE_CPUS, RankPlacement, rank_bundle
from router.serve_defaults import pick_layout
from tests.fixtures.local_cluster import local_cluster_config
from tests.fixtures.tiny_models import make_tiny_model


def test_a_size_the_heads_cannot_split_is_refused_naming_the_flag(llama_dir: Path) -> None:
    # the tiny Llama: 4 query heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match="--decode-tp 3 must divide num_attention_heads 4"):
        local_cluster_config(llama_dir, num_prefill=0, decode_tp=3)
    with pytest.raises(ValueError, match="--decode-tp must be an int >= 1, got 0"):
        local_cluster_config(llama_dir, num_prefill=0, decode_tp=0)
    config = local_cluster_config(llama_dir, num_prefill=0, num_decode=2, decode_tp=2)
    assert config.parallel_config("decode").tensor_parallel_size == 2
    assert config.num_worker_ranks == 4  # what the pools reserve: an actor per rank


def test_a_prefill_pool_takes_workers_of_any_size_the_heads_split(llama_dir: Path) -> None:
    for prefill_tp, decode_tp in ((2, 1), (1, 2), (2, 2), (4, 2)):
        config = local_cluster_config(
            llama_dir, num_prefill=1, prefill_tp=prefill_tp, decode_tp=decode_tp
        )
        assert config.num_worker_ranks == prefill_tp + decode_tp
    with pytest.raises(ValueError, match="--prefill-tp 3 must divide num_attention_heads 4"):
        local_cluster_config(llama_dir, num_prefill=1, prefill_tp=3)
    with pytest.raises(ValueError, match="--bind-worker-cpus .* --prefill-tp 2 is 2 processes"):
        local_cluster_config(llama_dir, num_prefill=1, prefill_tp=2, bind_worker_cpus=True)


def test_binding_cores_per_worker_process_is_refused_with_several_ranks(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--bind-worker-cpus .* --decode-tp 2 is 2 processes"):
        local_cluster_config(llama_dir, num_prefill=0, decode_tp=2, bind_worker_cpus=True)


def test_the_tp_flags_set_both_pools_or_one() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "-tp", "2"])
    assert (args.tensor_parallel_size, args.prefill_tp, args.decode_tp) == (2, None, None)
    args = parser.parse_args(["serve", "--model", "m", "--prefill-tp", "1", "--decode-tp", "4"])
    assert (args.tensor_parallel_size, args.prefill_tp, args.decode_tp) == (1, 1, 4)


def test_serve_disaggregates_tensor_parallel_workers_where_it_would_one_rank_ones() -> None:
    common: dict[str, Any] = {"device": "cpu", "joins_cluster": False, "worker_num_cpus": None}
    layout = pick_layout(
        None, None, num_cores=4, bind_worker_cpus=False, tensor_parallel=True, **common
    )
    assert (layout.num_prefill, layout.num_decode, layout.reason) == (1, 1, "")
    # too few cores for two workers and the gateway: one colocated worker, its ranks unbound
    layout = pick_layout(
        None, None, num_cores=2, bind_worker_cpus=False, tensor_parallel=True, **common
    )
    assert (layout.num_prefill, layout.num_decode, layout.bind_worker_cpus) == (0, 1, False)
    assert "disaggregate with --prefill 1 --decode 1" in layout.reason
    # flags run what they name
    layout = pick_layout(1, 1, num_cores=2, bind_worker_cpus=False, tensor_parallel=True, **common)
    assert (layout.num_prefill, layout.num_decode) == (1, 1)


def test_each_rank_reserves_its_bundle_and_one_rank_needs_no_group() -> None:
    assert rank_bundle(2.0, 1.0, {"decode": 1.0}) == {"CPU": 2.0, "GPU": 1.0, "decode": 1.0}
    # Ray refuses a bundle of nothing: a worker that reserves no CPU reserves a sliver
    assert rank_bundle(0.0, 0.0, {}) == {"CPU": MIN_BUNDLE_CPUS}
    single = RankPlacement.create("pdserve-decode-0", 1, rank_bundle(1.0, 0.0, {}))
    assert single.group is None and single.options(0) == {}


def test_expert_parallelism_is_checked_for_each_pool_naming_the_flag(tmp_path: Path) -> None:
    """Qwen3-MoE of 4 query heads and 4 experts 6 wide: four ranks cannot split an expert's
    columns, but can each hold a whole expert."""
    model_dir = make_tiny_model(
        tmp_path, "Qwen3MoeForCausalLM", seed=2, num_experts=4, moe_intermediate_size=6
    )
    with pytest.raises(ValueError, match="--decode-tp 4 must divide moe_intermediate_size 6"):
        local_cluster_config(model_dir, num_prefill=1, decode_tp=4)
    config = local_cluster_config(model_dir, num_prefill=1, decode_tp=4, expert_parallel=True)
    assert config.parallel_config("decode").expert_parallel
    assert config.parallel_config("prefill").expert_parallel
    args = build_parser().parse_args(["serve", "--model", "m", "--enable-expert-parallel"])
    assert args.enable_expert_parallel
    assert not build_parser().parse_args(["serve", "--model", "m"]).enable_expert_parallel
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "a", "-tp", "2", "--enable-expert-parallel"]
    )
    assert args.enable_expert_parallel
