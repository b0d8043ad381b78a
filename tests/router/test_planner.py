"""``pdserve plan``: a model's costs from its config alone, the cluster simulation on the
workers' own scheduler, the search's choice, and the command's outputs."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from engine.step_timings import STEP_TIMINGS_KEPT
from router.cli import build_parser, main
from router.latency_model import StepShape
from router.planner.command import _with_overrides, serve_flags, shared_host_line
from router.planner.hardware import PRESETS, Hardware, StepTimeModel
from router.planner.model_costs import ModelCosts, eight_bit_matmul
from router.planner.plan import Layout, LayoutResult, Planner, Slo
from router.planner.shared_host import HostShare
from router.planner.simulator import (
    ClusterShape,
    Simulation,
    WorkerShape,
    WorkloadRequest,
)
from router.planner.workload import PlanWorkload

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-3-8B's config.json alone: the planner needs no weights."""
    directory = tmp_path_factory.mktemp("llama-3-8b")
    (directory / "config.json").write_text(json.dumps(LLAMA_3_8B))
    return directory


def test_a_models_costs_come_from_its_config(llama_8b: Path, tmp_path: Path) -> None:
    costs = ModelCosts.load(llama_8b)
    assert costs.weight_bytes == pytest.approx(16.06e9, rel=1e-3)  # 8.03 B parameters, bf16
    assert costs.kv_bytes_per_token == 128 * 1024  # DESIGN.md's 128 KiB
    assert costs.flops_per_token == pytest.approx(2 * 7.50e9, rel=1e-2)  # without the embedding
    assert costs.attention_flops_per_pair == 32 * 2 * 32 * 2 * 128
    moe = dict(
        LLAMA_3_8B,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    (tmp_path / "config.json").write_text(json.dumps(moe))
    mixtral = ModelCosts.load(tmp_path)
    expert = 3 * 4096 * 14336 * 32  # one expert's MLP over the layers
    assert mixtral.weight_bytes - costs.weight_bytes == pytest.approx(7 * expert * 2, rel=1e-6)
    assert mixtral.flops_per_token - costs.flops_per_token == pytest.approx(2 * expert, rel=1e-6)
    # a step reads the experts its tokens go to: one token, 2 of 8 (the other 6 unread);
    # many, nearly all; of the input embedding (untied: apart from the LM head, which is read
    # whole) its tokens' rows; a dense model, every other weight whatever the step
    embedding, row = 128256 * 4096 * 2, 4096 * 2
    assert costs.input_embedding_bytes == mixtral.input_embedding_bytes == embedding
    assert mixtral.routed_expert_bytes == 8 * expert * 2
    dense_part = mixtral.weight_bytes - mixtral.routed_expert_bytes - embedding
    assert mixtral.weight_bytes_read(1) == pytest.approx(dense_part + row + 2 * expert * 2)
    assert mixtral.weight_bytes_read(4) == pytest.approx(
        dense_part + 4 * row + 8 * expert * 2 * (1 - (6 / 8) ** 4)
    )
    assert mixtral.weight_bytes_read(4096) == pytest.approx(
        mixtral.weight_bytes - embedding + 4096 * row
    )
    assert costs.weight_bytes_read(1) == costs.weight_bytes - embedding + row
    assert costs.weight_bytes_read(10**6) == costs.weight_bytes  # every row: the whole table
    tied = ModelCosts.load(_config_dir(tmp_path / "tied", tie_word_embeddings=True))
    assert tied.input_embedding_bytes == 0 and tied.weight_bytes_read(1) == tied.weight_bytes
    # so a decode step of one sequence on an H100 reads about a third of Mixtral's bytes
    model = StepTimeModel(mixtral, PRESETS["h100"])
    one = StepShape(0, 0, 1, 100, decode_kv_tokens=100)
    memory_s = model(one) - PRESETS["h100"].step_overhead_s
    all_experts_s = mixtral.weight_bytes / PRESETS["h100"].memory_bytes_per_s
    assert memory_s == pytest.approx(
        (dense_part + row + 2 * expert * 2 + 100 * mixtral.kv_bytes_per_token)
        / PRESETS["h100"].memory_bytes_per_s
    )
    assert memory_s < 0.4 * all_experts_s


def _config_dir(directory: Path, **overrides: object) -> Path:
    """Llama-3-8B's config.json with ``overrides``, in ``directory``."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA_3_8B, **overrides}))
    return directory


def test_latent_attention_costs_are_the_absorbed_forms(tmp_path: Path) -> None:
    """DeepSeek-V3's attention as the engine runs it for every token: a (query, key) pair is a
    head scoring the cached latent and rotary key (kv_lora_rank + rope) and adding the latent
    (kv_lora_rank); the cache holds one entry of both per token and layer."""
    from tests.fixtures.tiny_models import tiny_hf_config

    (tmp_path / "config.json").write_text(
        json.dumps(tiny_hf_config("DeepseekV3ForCausalLM").to_dict())
    )
    costs = ModelCosts.load(tmp_path)
    raw = tiny_hf_config("DeepseekV3ForCausalLM").to_dict()
    heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
    rank, rope = raw["kv_lora_rank"], raw["qk_rope_head_dim"]
    assert costs.attention_flops_per_pair == layers * 2 * heads * (2 * rank + rope)
    assert costs.kv_bytes_per_token == layers * (rank + rope) * 2  # bf16
    assert costs.num_kv_heads == 1


def test_every_architecture_the_engine_serves_has_its_costs(tmp_path: Path) -> None:
    """The planner reads each tiny config the engine's tests serve: the mixtures of experts
    route their tokens to some experts of each sparse layer, the models of sliding layers keep
    their KV in groups (one with a window)."""
    from tests.fixtures.tiny_models import ARCH_OVERRIDES, tiny_hf_config

    sliding = {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM"}
    for architecture in ARCH_OVERRIDES:
        directory = tmp_path / architecture
        directory.mkdir()
        config = tiny_hf_config(architecture).to_dict()
        (directory / "config.json").write_text(json.dumps(config))
        costs = ModelCosts.load(directory)
        assert costs.weight_bytes > 0 and costs.kv_bytes_per_token > 0, architecture
        routed = (
            "num_local_experts" in config
            or "n_routed_experts" in config
            or ("num_experts" in config)
        )
        assert (costs.num_experts > costs.experts_per_token > 0) is routed, architecture
        # all but the input embedding's rows the token does not look up
        lookup = min(costs.input_embedding_bytes, costs.embedding_row_bytes)
        dense_read = costs.weight_bytes - costs.input_embedding_bytes + lookup
        assert (costs.weight_bytes_read(1) < dense_read) is routed, architecture
        windows = () if costs.cache_groups is None else costs.cache_groups.windows
        assert (None in windows and len(windows) > 1) is (architecture in sliding), architecture


AWQ_4BIT = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}


def test_a_quantized_checkpoint_and_kv_cache_cost_their_own_bytes(
    llama_8b: Path, tmp_path: Path
) -> None:
    bf16 = ModelCosts.load(llama_8b)
    (tmp_path / "config.json").write_text(
        json.dumps(dict(LLAMA_3_8B, quantization_config=AWQ_4BIT))
    )
    awq = ModelCosts.load(tmp_path)
    embeddings = 2 * 128256 * 4096  # embedding and LM head, untied: bf16 still
    linear = (bf16.weight_bytes - 2 * embeddings) / 2  # the decoder's linear layers' weights
    # 4 bits a weight, and each group of 128 shares a 16-bit scale and a 4-bit zero point
    assert awq.weight_bytes == pytest.approx(linear * (4 + 20 / 128) / 8 + 2 * embeddings)
    assert awq.weight_bytes == pytest.approx(5.73e9, rel=1e-3)  # published 8B AWQ: 5.7 GB
    assert awq.describe() == (
        "weights 5.3 GiB (awq w4a16 (group 128, asymmetric)), KV 128 KiB a token"
    )
    assert (awq.flops_per_token, awq.kv_bytes_per_token) == (
        bf16.flops_per_token,
        bf16.kv_bytes_per_token,
    )
    fp8_kv = ModelCosts.load(llama_8b, kv_cache_dtype="fp8_e4m3")
    assert fp8_kv.kv_bytes_per_token == bf16.kv_bytes_per_token // 2
    assert fp8_kv.weight_bytes == bf16.weight_bytes
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto"):
        ModelCosts.load(llama_8b, kv_cache_dtype="int4")
    # 16 GB of bf16 weights need 4 devices of 8 GB; the 4-bit checkpoint fits on one
    small = Hardware("8 GB", 1e14, 1e12, 8e9, 1e10)
    layouts = Planner(awq, small).layouts(max_devices=4, tp_sizes=(1, 2, 4))
    assert Layout(0, 1, 1, 1) in layouts
    # and a cache of a byte an element holds twice the blocks
    plain, halved = Planner(bf16, small), Planner(fp8_kv, small)
    assert halved.kv_blocks(4) == pytest.approx(2 * plain.kv_blocks(4), abs=1)


W8A8_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "type": "float", "num_bits": 8, "symmetric": True, "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "type": "float", "num_bits": 8, "symmetric": True, "strategy": "token",
                "dynamic": True,
            },
        }
    },
}  # fmt: skip


def _quantized(tmp_path: Path, name: str, quantization: dict[str, object]) -> ModelCosts:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(dict(LLAMA_3_8B, quantization_config=quantization))
    )
    return ModelCosts.load(directory)


def test_8_bit_matmuls_run_at_the_devices_8_bit_rate(llama_8b: Path, tmp_path: Path) -> None:
    """A W8A8 FP8 checkpoint's decoder layers compute at the device's float8 rate (an H100's
    is twice its bf16), its LM head at bf16's; an A100, with no float8 tensor cores, runs it at
    bf16's. Int8 W8A8 at the int8 rate; a weight-only (AWQ) checkpoint computes in bf16. A
    prefill of 4,096 tokens is compute-bound: its time is the FLOPs over the rates."""
    bf16 = ModelCosts.load(llama_8b)
    fp8 = _quantized(tmp_path, "fp8", W8A8_FP8)
    head = 2.0 * 128256 * 4096  # the LM head's FLOPs a token, in bf16 still
    assert fp8.eight_bit_matmul == "fp8"
    assert fp8.eight_bit_flops_per_token == pytest.approx(bf16.flops_per_token - head)
    assert fp8.describe().endswith("KV 128 KiB a token, 93% of its FLOPs in fp8 matmuls")
    int8_config = json.loads(json.dumps(W8A8_FP8).replace('"float"', '"int"'))
    int8_config["format"] = "int-quantized"
    int8 = _quantized(tmp_path, "int8", int8_config)
    awq = _quantized(tmp_path, "awq", AWQ_4BIT)
    assert (int8.eight_bit_matmul, awq.eight_bit_matmul) == ("int8", None)
    assert awq.eight_bit_flops_per_token == 0.0

    prefill = StepShape(4096, 0, 0, 0)  # (attention pairs left out: the matmuls alone)

    def compute_s(costs: ModelCosts, hardware: Hardware) -> float:
        """The matmuls' time: the step's less its overhead and its KV's write."""
        kv_write = costs.kv_bytes_per_token * 4096 / hardware.memory_bytes_per_s
        return StepTimeModel(costs, hardware)(prefill) - hardware.step_overhead_s - kv_write

    h100, a100 = PRESETS["h100"], PRESETS["a100"]
    eight_bit = fp8.eight_bit_flops_per_token * 4096
    assert compute_s(fp8, h100) == pytest.approx(
        head * 4096 / h100.flops_per_s + eight_bit / h100.fp8_flops_per_s
    )
    # 7 % of the FLOPs (the LM head) at bf16, 93 % at twice that: 0.07 + 0.93 / 2
    assert compute_s(fp8, h100) == pytest.approx(0.535 * compute_s(bf16, h100), rel=0.01)
    assert compute_s(fp8, a100) == pytest.approx(compute_s(bf16, a100))  # no float8 cores
    assert compute_s(int8, a100) == pytest.approx(
        head * 4096 / a100.flops_per_s + eight_bit / a100.int8_ops_per_s
    )
    assert compute_s(awq, h100) == pytest.approx(compute_s(bf16, h100))
    # a profile without 8-bit rates (0) runs them at its bf16 rate
    unmeasured = replace(h100, fp8_flops_per_s=0.0)
    assert compute_s(fp8, unmeasured) == pytest.approx(compute_s(bf16, unmeasured))
    with pytest.raises(ValueError, match="int8_ops_per_s and fp8_flops_per_s must be >= 0"):
        replace(h100, int8_ops_per_s=-1.0)
    saved = Hardware.from_json(json.loads(json.dumps(h100.to_json())))
    assert saved == h100


@pytest.mark.parametrize("block_cols", [16, 32, 48, 64, 96, 128, 256])
def test_the_planner_knows_which_fp8_blocks_the_gpu_kernels_take(block_cols: int) -> None:
    from engine.kernels.fp8_block_matmul import block_cols_supported
    from engine.quantization.config import Fp8BlockWeights

    expected = "fp8" if block_cols_supported(block_cols) else None
    assert eight_bit_matmul(Fp8BlockWeights(128, block_cols)) == expected


def _linear(seconds_per_step: float, per_token: float) -> WorkerShape:
    def step(shape: StepShape) -> float:
        return seconds_per_step + per_token * (shape.num_prefill_tokens + shape.num_decode_tokens)

    return WorkerShape(1, step, num_kv_blocks=1000, max_num_batched_tokens=256)


def test_a_colocated_worker_prefills_in_budget_chunks_then_decodes_step_by_step() -> None:
    """300 prompt tokens at 256 a step: two steps (10 ms + 0.1 ms a token each), the second
    sampling the first token; then one decode step per token."""
    cluster = ClusterShape(_linear(0.010, 1e-4))
    (run,) = Simulation(cluster, [WorkloadRequest(0.0, tuple(range(300)), 5)]).run()
    assert run.ttft_s == pytest.approx(0.020 + 300e-4)
    assert run.tpot_s == pytest.approx(0.010 + 1e-4)
    assert run.num_tokens == 5
    # where its first token's time went: computed from 0, sampled by the step ending at 50 ms
    assert (run.scheduled_s, run.prompt_done_s) == (0.0, pytest.approx(0.050))


def test_a_hand_off_delays_the_second_token_and_queued_prompts_wait() -> None:
    cluster = ClusterShape(
        _linear(0.010, 1e-4),
        prefill=_linear(0.010, 1e-4),
        transfer_seconds=lambda blocks: 0.001 * blocks,
        path_overhead_s=0.002,
    )
    requests = [
        WorkloadRequest(0.0, tuple(range(100)), 4),
        WorkloadRequest(0.001, tuple(range(1000, 1200)), 1),
    ]
    first, second = Simulation(cluster, requests).run()
    assert first.ttft_s == pytest.approx(0.020 + 0.002)
    # three gaps: the hand-off of 7 blocks (7 ms) and three decode steps
    assert first.tpot_s == pytest.approx((0.007 + 3 * 0.0101) / 3)
    # the second waits for the first's step (done at 20 ms), then its own 200 tokens
    assert second.ttft_s == pytest.approx(0.020 + 0.030 + 0.002 - 0.001)
    assert second.num_tokens == 1
    assert (second.scheduled_s, second.prompt_done_s) == pytest.approx((0.020, 0.050))


def test_on_a_shared_host_steps_and_streaming_share_its_cores() -> None:
    """Two colocated workers each prefilling 100 tokens at once: 20 ms each alone, 40 ms on
    one shared core. A token's streaming (10 ms of the host's CPU) shares the core with the
    next decode step (10.1 ms alone): both at half speed, so the first token, sampled at 20 ms,
    reaches its client at 40 ms, and each next one about 20 ms later. A prefill worker's
    hand-offs run in its own process, between its steps, and the KV moves after them."""
    prompts = [
        WorkloadRequest(0.0, tuple(range(100)), 1),
        WorkloadRequest(0.0, tuple(range(200, 300)), 1),
    ]
    two = replace(_linear(0.010, 1e-4), count=2)
    alone = Simulation(ClusterShape(two, router_policy="least_loaded"), prompts).run()
    assert [run.ttft_s for run in alone] == pytest.approx([0.020, 0.020])
    shared = ClusterShape(two, router_policy="least_loaded", host=HostShare(1))
    simulation = Simulation(shared, prompts)
    assert [run.ttft_s for run in simulation.run()] == pytest.approx([0.04, 0.04])
    # the steps' totals: 20 ms each alone, 40 ms each as they ran
    (totals,) = simulation.steps_by_role().values()
    assert (totals.num_steps, totals.alone_s, totals.wall_s) == (
        2,
        pytest.approx(0.04),
        pytest.approx(0.08),
    )
    streaming = ClusterShape(_linear(0.010, 1e-4), host=HostShare(1, seconds_per_token=0.010))
    (run,) = Simulation(streaming, [WorkloadRequest(0.0, tuple(range(100)), 5)]).run()
    assert run.ttft_s == pytest.approx(0.040)  # sampled at 20 ms, streamed beside a step
    # tokens 2-4 each 20.1 ms after the one before; the last streamed with no step beside it
    assert run.tpot_s == pytest.approx((3 * 0.0201 + 0.0101) / 4)
    # at 20 ms the first token is sampled; its 1 ms of streaming runs on one core, the
    # hand-off's 30 ms of copies and calls in the prefill worker's process on the other: the
    # token is delivered at 21 ms, the KV moves at 50 ms, the decode worker's step (10.1 ms)
    # samples the last token at 60.1 ms, streamed by 61.1 ms; a second prompt, arriving at
    # 30 ms, waits for the hand-off before its prefill (20 ms): its token at 71 ms
    handing_off = ClusterShape(
        _linear(0.010, 1e-4),
        prefill=_linear(0.010, 1e-4),
        host=HostShare(2, seconds_per_token=0.001, seconds_per_handoff=0.030),
    )
    prompts = [
        WorkloadRequest(0.0, tuple(range(100)), 2),
        WorkloadRequest(0.030, tuple(range(100, 200)), 2),
    ]
    first, second = Simulation(handing_off, prompts).run()
    assert first.ttft_s == pytest.approx(0.021)
    assert first.last_token_s == pytest.approx(0.0611)
    assert second.first_token_s == pytest.approx(0.071)


def test_on_a_shared_host_a_worker_makes_its_outputs_before_its_next_step() -> None:
    """A worker's own work per sampled token (3 ms: its output batches made and streamed
    out, in its process) runs after each step and before the next, then the token's
    streaming (1 ms): on two cores, each alone. 100 prompt tokens (20 ms): the first token
    at 20 + 3 + 1 = 24 ms; each next decode step (10.1 ms) starts 3 ms after the one before
    ended, so tokens come 13.1 ms apart."""
    cluster = ClusterShape(
        _linear(0.010, 1e-4),
        host=HostShare(2, seconds_per_token=0.001, worker_seconds_per_token=0.003),
    )
    (run,) = Simulation(cluster, [WorkloadRequest(0.0, tuple(range(100)), 4)]).run()
    assert run.ttft_s == pytest.approx(0.024)
    assert run.tpot_s == pytest.approx(0.0131)
    # sampled at 20 ms; the 4 ms after it are the outputs made and the token streamed
    assert run.prompt_done_s == pytest.approx(0.020)
    # a prefill worker's hand-off's work waits for the outputs of the step that finished the
    # prompt: 20 ms step + 3 ms of its token + 30 ms of the hand-off, then the KV moves
    handing_off = ClusterShape(
        _linear(0.010, 1e-4),
        prefill=_linear(0.010, 1e-4),
        host=HostShare(
            2, seconds_per_token=0.001, seconds_per_handoff=0.030, worker_seconds_per_token=0.003
        ),
    )
    (run,) = Simulation(handing_off, [WorkloadRequest(0.0, tuple(range(100)), 2)]).run()
    assert run.ttft_s == pytest.approx(0.024)
    # the KV moves at 53 ms; the decode step (10.1 ms), its outputs (3 ms), streaming (1 ms)
    assert run.last_token_s == pytest.approx(0.053 + 0.0101 + 0.003 + 0.001)


def test_on_a_shared_host_each_steps_batch_of_outputs_costs_beside_its_tokens() -> None:
    """A step's outputs leave as one batch: 2 ms of the worker's process a batch and 1 ms a
    token before its next step, then 4 ms of the front door's receipt a batch and 1 ms a
    token, on two cores (each alone). Two prompts of 100 tokens at once: the first prefills
    alone (20 ms), its batch of one token is made by 23 ms and streamed by 28 ms. The next
    step prefills the second and decodes the first (20.1 ms, to 43.1 ms); its batch of two
    tokens is made in 2 + 2 ms (47.1 ms) and received in 4 ms, the first's token streamed
    1 ms later (52.1 ms), the second's 1 ms after that (53.1 ms). With the same CPU time for
    a batch of one token all of it per token (3 ms in the worker, 5 ms streaming), the batch
    of two costs 6 ms to make and 10 ms to stream: the second's first token at 59.1 ms."""
    batched = HostShare(
        2,
        seconds_per_token=0.001,
        worker_seconds_per_token=0.001,
        worker_seconds_per_batch=0.002,
        seconds_per_batch=0.004,
    )
    cluster = ClusterShape(_linear(0.010, 1e-4), host=batched)
    prompts = [
        WorkloadRequest(0.0, tuple(range(100)), 2),
        WorkloadRequest(0.0, tuple(range(200, 300)), 2),
    ]
    first, second = Simulation(cluster, prompts).run()
    assert (first.ttft_s, first.last_token_s, second.ttft_s) == pytest.approx(
        (0.028, 0.0521, 0.0531)
    )
    per_token = HostShare(2, seconds_per_token=0.005, worker_seconds_per_token=0.003)
    first, second = Simulation(replace(cluster, host=per_token), prompts).run()
    assert (first.ttft_s, first.last_token_s, second.ttft_s) == pytest.approx(
        (0.028, 0.0541, 0.0591)
    )
    with pytest.raises(ValueError, match="seconds_per_batch >= 0"):
        HostShare(2, seconds_per_batch=-1.0)
    with pytest.raises(ValueError, match="host_worker_seconds_per_batch and host_seconds_per_b"):
        Hardware("box", 1e14, 1e12, 80e9, 1e10, host_worker_seconds_per_batch=-1e-4)


def test_a_cpu_profile_makes_the_planners_workers_share_its_cores(llama_8b: Path) -> None:
    costs = ModelCosts.load(llama_8b)
    box = Hardware(
        "box", 1e14, 1e12, 80e9, 1e10, host_cores=8, host_seconds_per_token=2e-4,
        host_seconds_per_handoff=3e-3, host_front_door_threads=2,
        host_worker_seconds_per_token=1e-4, host_worker_seconds_per_batch=5e-4,
        host_seconds_per_batch=6e-4,
    )  # fmt: skip
    planner = Planner(costs, replace(box, worker_threads=2))
    cluster = planner.cluster(Layout(1, 2, 1, 1))
    assert cluster.host == HostShare(8, 2e-4, 3e-3, 2, 1e-4, 5e-4, 6e-4)
    assert cluster.decode.threads == 2 and cluster.prefill is not None
    assert cluster.prefill.threads == 4  # TP 2: two ranks of two threads
    assert Planner(costs, PRESETS["h100"]).cluster(Layout(1, 1, 1, 1)).host is None
    assert Hardware.from_json(json.loads(json.dumps(box.to_json()))) == box
    with pytest.raises(ValueError, match="host_worker_seconds_per_token, host_worker_seconds_"):
        Hardware("box", 1e14, 1e12, 80e9, 1e10, host_worker_seconds_per_token=-1e-4)
    with pytest.raises(ValueError, match="host_front_door_threads >= 1"):
        Hardware("box", 1e14, 1e12, 80e9, 1e10, host_front_door_threads=0)


def test_a_decode_worker_short_of_blocks_makes_hand_offs_wait_and_every_request_ends() -> None:
    """16 requests of 160 + 40 tokens, a decode cache of 40 blocks of 16 (three requests at
    a time): the rest wait for blocks, or are preempted and recomputed, and all finish."""
    decode = WorkerShape(1, lambda shape: 0.005, num_kv_blocks=40, max_num_batched_tokens=256)
    cluster = ClusterShape(decode, prefill=_linear(0.002, 1e-5))
    requests = [WorkloadRequest(0.001 * i, tuple(range(i, i + 160)), 40) for i in range(16)]
    runs = Simulation(cluster, requests).run()
    assert all(run.done for run in runs)
    assert max(run.tpot_s or 0 for run in runs) > 0.005  # some waited for room mid-decode


def test_the_simulated_kv_aware_router_follows_the_cached_prefixes() -> None:
    """Two prefill workers, each with room for one 512-token prefix. Prompts on prefixes A and
    B arrive together (A first), then, once both are done, B's and A's again: kv_aware sends
    each to the worker that caches its prefix; least_loaded sends B to the idle first worker,
    whose A it evicts, and A to the other (B's): both compute everything again."""
    a, b = tuple(range(512)), tuple(range(10_000, 10_512))
    requests = [
        WorkloadRequest(0.0, a + (1, 2, 3), 2),
        WorkloadRequest(0.001, b + (1, 2, 3), 2),
        WorkloadRequest(5.0, b + (4, 5, 6), 2),
        WorkloadRequest(5.001, a + (4, 5, 6), 2),
    ]
    prefill = replace(_linear(0.010, 1e-4), count=2, num_kv_blocks=40)

    def simulate(policy: str) -> tuple[int, list[float]]:
        simulation = Simulation(
            ClusterShape(_linear(0.010, 1e-4), prefill=prefill, router_policy=policy), requests
        )
        runs = simulation.run()
        hit_blocks = sum(w.scheduler.block_manager.pool.num_cache_hits for w in simulation.prefill)
        return hit_blocks, [run.ttft_s or 0.0 for run in runs]

    kv_hits, kv_ttfts = simulate("kv_aware")
    least_hits, least_ttfts = simulate("least_loaded")
    assert (kv_hits, least_hits) == (2 * 32, 0)  # 32 full blocks a prefix
    assert kv_ttfts[:2] == pytest.approx(least_ttfts[:2])
    # the last two compute 3 tokens (one step each) instead of 515 (three)
    assert kv_ttfts[2] == pytest.approx(0.010 + 3e-4)
    assert least_ttfts[2] == pytest.approx(3 * 0.010 + 515e-4)
    with pytest.raises(ValueError, match="router_policy must be one of kv_aware, least_loaded"):
        ClusterShape(_linear(0.010, 1e-4), router_policy="round_robin")


def test_the_choice_follows_the_workload_prompt_heavy_to_prefill_output_heavy_to_decode(
    llama_8b: Path,
) -> None:
    """Four H100s split between the pools: long prompts and short outputs want three prefill
    workers; short prompts and long outputs, under a tight TPOT SLO, three decode workers."""
    planner = Planner(ModelCosts.load(llama_8b), PRESETS["h100"])
    layouts = [Layout(1, 1, 3, 1), Layout(2, 1, 2, 1), Layout(3, 1, 1, 1)]
    slo = Slo(ttft_s=0.5, tpot_s=0.012, attainment=0.5)
    prompts = PlanWorkload(rate=30, prompt_len=4096, output_len=32, num_requests=200)
    outputs = PlanWorkload(rate=40, prompt_len=512, output_len=1024, num_requests=200)
    best_for_prompts, by_prompts = planner.choose(layouts, prompts, slo)
    best_for_outputs, by_outputs = planner.choose(layouts, outputs, slo)
    assert best_for_prompts is not None and best_for_prompts.layout == Layout(3, 1, 1, 1)
    assert best_for_outputs is not None and best_for_outputs.layout == Layout(1, 1, 3, 1)
    assert by_prompts[0].attainment < 0.5  # 1P 3D cannot keep up with the prompts
    assert by_outputs[-1].attainment < 0.5  # 3P 1D cannot keep up with the decodes


def test_layouts_of_one_cost_and_goodput_go_to_the_one_with_more_headroom(llama_8b: Path) -> None:
    """Every request within its SLOs on three two-device layouts: the one whose p90 TTFT and
    TPOT stay furthest under the SLOs (the smaller of the two shares) is chosen, not the first
    simulated."""
    slo = Slo(ttft_s=0.5, tpot_s=0.040)
    ahead = {
        Layout(1, 1, 1, 1): ({"p90": 0.115}, {"p90": 0.025}),  # TPOT: 38 % under
        Layout(0, 2, 1, 2): ({"p90": 0.090}, {"p90": 0.011}),  # TPOT: 72.5 % under
        Layout(0, 1, 2, 1): ({"p90": 0.120}, {"p90": 0.017}),  # TPOT: 57.5 % under
    }

    class Scripted(Planner):
        def simulate(self, layout: Layout, workload: PlanWorkload, slo: Slo) -> LayoutResult:
            ttft, tpot = ahead[layout]
            return LayoutResult(layout, workload.rate, 1.0, workload.rate, ttft, tpot)

    planner = Scripted(ModelCosts.load(llama_8b), PRESETS["h100"])
    best, results = planner.choose(list(ahead), PlanWorkload(rate=20), slo)
    assert best is not None and best.layout == Layout(0, 2, 1, 2)
    assert [r.headroom(slo) for r in results] == pytest.approx([0.375, 0.725, 0.575])
    # past an SLO, headroom is below 0
    assert LayoutResult(Layout(0, 1, 1, 1), 1.0, 0.5, 0.5, {"p90": 0.6}, {}).headroom(
        slo
    ) == pytest.approx(-0.2)


def test_layouts_leave_out_what_does_not_fit_and_cost_what_they_hold(llama_8b: Path) -> None:
    small = Hardware("24 GB", 1e14, 1e12, 24e9, 1e10)
    planner = Planner(ModelCosts.load(llama_8b), small)
    assert planner.kv_blocks(1) > 0 and planner.kv_blocks(2) > planner.kv_blocks(1)
    tiny = Hardware("8 GB", 1e14, 1e12, 8e9, 1e10)
    planner = Planner(ModelCosts.load(llama_8b), tiny)
    layouts = planner.layouts(max_devices=4, tp_sizes=(1, 2, 4))
    assert layouts and all(
        min(x.prefill_tp, x.decode_tp) >= 4 or x.num_prefill == 0 for x in layouts
    )
    assert {x.decode_tp for x in layouts} == {4}  # 16 GB of weights need 4 devices of 8 GB
    assert Layout(1, 2, 3, 4).devices == 14
    assert Layout(0, 1, 2, 2).serve_flags() == [
        "--prefill",
        "0",
        "--decode",
        "2",
        "--tensor-parallel-size",
        "2",
    ]


def test_a_measured_profile_is_used_for_its_own_model_at_tp_1(llama_8b: Path) -> None:
    from router.latency_model import StepCost

    costs = ModelCosts.load(llama_8b)
    measured = StepCost(0.004, 1e-5, 0.0, 2e-4, 0.0, 100)
    hardware = Hardware("box", 1e14, 1e12, 80e9, 1e10, measured_model=costs.name, measured=measured)
    shape = StepShape(100, 0, 4, 0)
    assert StepTimeModel(costs, hardware)(shape) == pytest.approx(0.004 + 1e-3 + 8e-4)
    roofline = StepTimeModel(costs, hardware, tp=2)(shape)  # another size: the roofline
    assert roofline != pytest.approx(0.004 + 1e-3 + 8e-4)
    saved = Hardware.from_json(json.loads(json.dumps(hardware.to_json())))
    assert saved == hardware


def test_on_the_roofline_weights_are_read_at_their_own_rate(llama_8b: Path) -> None:
    """A profile's matmuls read weights at their own rate (``weight_bytes_per_s``) and the
    attention kernels the KV at the memory's; without it (the presets), both at the
    memory's. ``--memory-gbs`` sets the memory's for both."""
    costs = ModelCosts.load(llama_8b)
    shape = StepShape(0, 0, 1, 4000)
    base = Hardware("box", 1e15, 2e12, 80e9, 1e10, step_overhead_s=0.0)
    faster = replace(base, weight_bytes_per_s=4e12)
    weights, kv = costs.weight_bytes_read(1), 4000 * costs.kv_bytes_per_token
    assert StepTimeModel(costs, base)(shape) == pytest.approx((weights + kv) / 2e12)
    assert StepTimeModel(costs, faster)(shape) == pytest.approx(weights / 4e12 + kv / 2e12)
    assert StepTimeModel(costs, faster, tp=2)(shape) < StepTimeModel(costs, faster)(shape) / 1.9
    with pytest.raises(ValueError, match="weight_bytes_per_s must be >= 0"):
        replace(base, weight_bytes_per_s=-1.0)
    assert Hardware.from_json(json.loads(json.dumps(faster.to_json()))) == faster
    args = build_parser().parse_args(["plan", "--model", "m", "--rate", "1", "--memory-gbs", "1"])
    overridden = _with_overrides(faster, args)
    assert overridden.memory_bytes_per_s == overridden.weight_read_bytes_per_s == 1e9


def test_on_the_roofline_a_steps_matmuls_and_attention_add_each_at_its_own_bound(
    llama_8b: Path,
) -> None:
    """Llama-3-8B on an H100, 256 sequences of 512 tokens decoding: the matmuls are
    compute-bound (256 rows over the weights) while the attention reads 16 GiB of KV; the
    kernels run one after another, so the step is the matmuls' FLOPs plus the KV's read, more
    than the larger of the step's compute and its bytes."""
    costs = ModelCosts.load(llama_8b)
    h100 = PRESETS["h100"]
    shape = StepShape(0, 0, 256, 256 * 512)
    matmuls = costs.flops_per_token * 256 / h100.flops_per_s
    attention = costs.attention_flops_per_pair * 256 * 512 / h100.flops_per_s
    weights = costs.weight_bytes_read(256) / h100.weight_read_bytes_per_s
    kv = 256 * 512 * costs.kv_bytes_per_token / h100.memory_bytes_per_s
    assert matmuls > weights and kv > attention  # each kernel kind bound its own way
    step = StepTimeModel(costs, h100)(shape) - h100.step_overhead_s
    assert step == pytest.approx(matmuls + kv)
    assert step > 1.05 * max(matmuls + attention, weights + kv)


def test_on_the_roofline_a_sequences_drafts_read_its_kv_with_its_token(llama_8b: Path) -> None:
    """Speculative decoding on an H100: one sequence of 8000 tokens decoding with 4 drafts is
    5 rows attending to its context, but its KV is read once (the rows run like a prompt
    chunk); its step is memory-bound, so it takes what the step of its token alone takes."""
    costs = ModelCosts.load(llama_8b)
    model = StepTimeModel(costs, PRESETS["h100"])
    plain = StepShape(0, 0, 1, 8000, decode_kv_tokens=8000)
    drafts = StepShape(0, 0, 5, 5 * 8000, decode_kv_tokens=8004)
    kv_once = (costs.weight_bytes_read(5) + 8004 * costs.kv_bytes_per_token) / PRESETS[
        "h100"
    ].memory_bytes_per_s
    assert model(drafts) == pytest.approx(PRESETS["h100"].step_overhead_s + kv_once)
    assert model(drafts) == pytest.approx(model(plain), rel=1e-3)
    per_row = replace(drafts, decode_kv_tokens=drafts.decode_context_tokens)
    assert model(per_row) > 1.05 * model(drafts)


def test_on_a_busy_host_a_step_costs_its_measured_factor_of_the_profile(llama_8b: Path) -> None:
    """A profile is measured on a quiet machine; a CPU host's steps cost more beside the rest
    of the cluster: a step computing prompt tokens its prompt factor times the profiled time,
    a decode-only one its decode factor. Workers on devices of their own keep the profile."""
    from router.latency_model import StepCost

    costs = ModelCosts.load(llama_8b)
    measured = StepCost(0.004, 1e-5, 0.0, 2e-4, 0.0, 100)
    busy = Hardware(
        "box", 1e14, 1e12, 80e9, 1e10, measured_model=costs.name, measured=measured,
        host_cores=2, host_prompt_step_cpu_factor=1.3, host_decode_step_cpu_factor=1.1,
    )  # fmt: skip
    mixed, decode = StepShape(100, 0, 4, 0), StepShape(0, 0, 4, 0)
    assert StepTimeModel(costs, busy)(mixed) == pytest.approx(1.3 * (0.004 + 1e-3 + 8e-4))
    assert StepTimeModel(costs, busy)(decode) == pytest.approx(1.1 * (0.004 + 8e-4))
    on_devices = replace(busy, host_cores=0)
    assert StepTimeModel(costs, on_devices)(decode) == pytest.approx(0.004 + 8e-4)
    assert "a step takes 1.30x its profiled time with prompt tokens, 1.10x without" in (
        shared_host_line(busy)
    )
    quiet = replace(busy, host_prompt_step_cpu_factor=1.0, host_decode_step_cpu_factor=1.0)
    assert "profiled time" not in shared_host_line(quiet)
    with pytest.raises(ValueError, match="host_prompt_step_cpu_factor and host_decode_step"):
        replace(busy, host_decode_step_cpu_factor=0.0)


def test_pdserve_plan_prints_the_choice_and_writes_its_files(
    llama_8b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan"
    status = main(
        [
            "plan", "--model", str(llama_8b), "--hardware", "h100", "--rate", "4",
            "--num-requests", "60", "--max-devices", "2", "--tp-sizes", "1",
            "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--out", str(out),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "chosen: colocated x1 (1 devices)" in printed
    assert f"pdserve serve --model {llama_8b} --prefill 0 --decode 1" in printed
    document = json.loads((out / "plan.json").read_text())
    assert document["chosen"]["layout"]["name"] == "colocated x1"
    assert "replicas: 1" in (out / "deploy-values.yaml").read_text()
    assert (out / "goodput.png").stat().st_size > 0
    assert document["router_policy"] == "kv_aware"  # serve's default, so no flag for it
    least = tmp_path / "least"
    flags = ["--router-policy", "least_loaded", "--out", str(least), "--num-requests", "30"]
    assert (
        main(["plan", "--model", str(llama_8b), "--rate", "4", "--max-devices", "1", *flags]) == 0
    )
    printed = capsys.readouterr().out
    assert (
        f"pdserve serve --model {llama_8b} --prefill 0 --decode 1 --router-policy least_loaded"
        in printed
    )
    assert json.loads((least / "plan.json").read_text())["router_policy"] == "least_loaded"
    # a quantized KV cache's plan tells serve to quantize it too
    flags = ["--kv-cache-dtype", "fp8_e4m3", "--out", str(tmp_path / "fp8"), "--num-requests"]
    assert main(["plan", "--model", str(llama_8b), "--rate", "4", *flags, "30"]) == 0
    printed = capsys.readouterr().out
    assert f"--model {llama_8b} --prefill 0 --decode 1 --kv-cache-dtype fp8_e4m3" in printed
    assert "weights 15.0 GiB (bfloat16), KV 64 KiB a token" in printed
    # a CPU machine's profile: what the simulation assumes of its shared cores is said
    box = Hardware(
        "box", 6e14, 3e12, 80e9, 1e10, host_cores=2, host_seconds_per_token=4e-4,
        host_seconds_per_handoff=9e-3, host_front_door_threads=2,
        host_worker_seconds_per_token=1.5e-4, host_seconds_per_batch=6e-4,
        host_worker_seconds_per_batch=5e-4,
    )  # fmt: skip
    profile = box.save(tmp_path / "box.json")
    flags = [
        "--rate",
        "2",
        "--out",
        str(tmp_path / "box"),
        "--num-requests",
        "20",
        "--max-devices",
        "1",
    ]
    assert main(["plan", "--model", str(llama_8b), "--hardware", str(profile), *flags]) == 0
    assert (
        "the workers share this host's 2 cores (1 thread(s) a worker rank); its other work: "
        "0.40 ms a streamed token, 0.60 ms a batch of outputs and 9.0 ms a hand-off, on 2 "
        "thread(s), and 0.15 ms a token and 0.50 ms a batch in its worker"
    ) in capsys.readouterr().out


def test_pdserve_plan_refuses_bad_input_naming_the_flag(
    llama_8b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--model", str(llama_8b), "--out", str(tmp_path)]
    refusals = [
        (["--rate", "0"], "--rate must be > 0"),
        (["--hardware", "tpu9"], "--hardware must be one of h100"),
        (["--device-memory-gib", "4", "--max-devices", "2"], "no layout of at most 2 devices"),
        (["--turns", "0"], "--turns must be >= 1 and --think-s >= 0, got 0 and 5.0"),
        (["--max-local-prefill-length", "-1"], "--max-local-prefill-length must be >= 0, got -1"),
        (["--kv-offload-gb", "-1"], "--kv-offload-gb must be >= 0, got -1"),
        (["--host-link-gbs", "0"], "--host-link-gbs must be > 0, got 0"),
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be in [1, 16], got 0"),
        (["--num-speculative-tokens", "2", "--draft-rate", "2"], "--draft-rate must be in [0, 1]"),
        (["--fp8-flops", "-1"], "--fp8-flops must be >= 0, got -1"),
        (["--memory-gbs", "0"], "--memory-gbs must be > 0, got 0"),
    ]
    for flags, message in refusals:
        rate = [] if "--rate" in flags else ["--rate", "1"]
        assert main([*base, *rate, *flags]) == 2, flags
        assert message in capsys.readouterr().err


def test_the_plans_serve_flags_carry_the_routers_settings_it_simulated() -> None:
    """The router's conditional local prefills go with a disaggregated layout only (a
    colocated worker prefills every prompt anyway); serve's defaults are not repeated."""
    args = build_parser().parse_args(
        ["plan", "--model", "m", "--rate", "1", "--max-local-prefill-length", "64",
         "--max-prefill-queue-tokens", "4096", "--router-policy", "least_loaded"]
    )  # fmt: skip
    assert serve_flags(Layout(1, 1, 2, 1), args) == [
        "--prefill", "1", "--decode", "2", "--prefill-tp", "1", "--decode-tp", "1",
        "--router-policy", "least_loaded", "--max-local-prefill-length", "64",
        "--max-prefill-queue-tokens", "4096",
    ]  # fmt: skip
    assert serve_flags(Layout(0, 1, 2, 1), args) == [
        "--prefill", "0", "--decode", "2", "--router-policy", "least_loaded",
    ]  # fmt: skip
    defaults = build_parser().parse_args(["plan", "--model", "m", "--rate", "1"])
    assert serve_flags(Layout(1, 1, 1, 1), defaults) == Layout(1, 1, 1, 1).serve_flags()


def test_pdserve_profile_of_a_model_without_its_weights(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--load-format dummy``: the model's config.json alone (random weights, its shapes): a
    profile of an 8B model on a machine where its checkpoint is not (a lent GPU)."""
    config_only = tmp_path / "llama-config-only"
    config_only.mkdir()
    shutil.copy(llama_dir / "config.json", config_only)
    out = tmp_path / "shapes.json"
    argv = ["profile", "--model", str(config_only), "--num-kv-blocks", "256", "--out", str(out)]
    assert main(argv) != 0  # without --load-format dummy the weights are needed
    assert "no model.safetensors" in capsys.readouterr().err
    assert main([*argv, "--load-format", "dummy"]) == 0
    hardware = Hardware.load(out)
    assert hardware.measured is not None and hardware.measured.per_prefill_token_s > 0
    assert hardware.measured_model == "llama-config-only"


def test_pdserve_profile_measures_this_machine_and_records_its_shared_cores(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "this-machine.json"
    argv = ["profile", "--model", str(llama_dir), "--num-kv-blocks", "256", "--out", str(out)]
    assert main(argv) == 0
    hardware = Hardware.load(out)
    assert hardware.measured is not None and hardware.measured.overhead_s > 0
    # fitted on every step of its rounds, not only the latest a worker's step log keeps
    assert hardware.measured.num_samples > STEP_TIMINGS_KEPT
    assert hardware.measured_model == llama_dir.name
    assert hardware.host_cores == os.cpu_count() and hardware.worker_threads == 1
    # a CPU's host tier is its memory: copies to it at the memory's bandwidth
    assert hardware.host_link_bytes_per_s == 0.0
    assert hardware.host_copy_bytes_per_s == hardware.memory_bytes_per_s
    # on a CPU 8-bit layers dequantize: no 8-bit rate measured, planned at the profile's own
    assert hardware.int8_ops_per_s == hardware.fp8_flops_per_s == 0.0
    assert hardware.eight_bit_rate("fp8") == hardware.flops_per_s
    # the host's other work needs a served cluster to measure: none is assumed
    assert hardware.host_seconds_per_token == hardware.host_seconds_per_handoff == 0.0
    model = ModelCosts.load(llama_dir)
    # the weights' read is measured apart, and the roofline's step overhead is the fit's less
    # the model's read of its weights (the roofline counts that for any model)
    assert hardware.weight_bytes_per_s > 0
    weights_s = ModelCosts.load(llama_dir, "float32").weight_bytes_read(1) / (
        hardware.weight_bytes_per_s
    )  # (profiled in float32)
    assert hardware.step_overhead_s == pytest.approx(
        max(0.0, hardware.measured.overhead_s - weights_s)
    )
    assert Planner(model, hardware).cluster(Layout(0, 1, 2, 1)).host == HostShare(
        os.cpu_count() or 1
    )
