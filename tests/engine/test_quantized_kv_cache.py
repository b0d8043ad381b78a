"""A quantized KV cache (``kv_cache_dtype`` fp8_e4m3 or int8): greedy tokens equal transformers
running the same weights with its K/V quantized the same way (the same per-head scales, stored
and read back by engine/kv_cache/kv_quantization.py's rules) in every mode (batched, chunked
prefill, prefix-cache hits, preemption, sliding and full cache groups); scales calibrated
alike on every start, or given; the cache's bytes; the demo model's held-out perplexity; and
the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.attention.layer import Attention, LatentCacheAttention
from engine.kv_cache.kv_quantization import KVCacheScales, storage_dtype
from tests.engine.quantized_kv_reference import transformers_quantized_kv_greedy
from tests.engine.quantized_runs import NUM_TOKENS, PROMPTS, engine_greedy, quantized_llm
from tests.fixtures.tiny_models import make_tiny_model

KV_CACHE_DTYPES = ["fp8_e4m3", "int8"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


@pytest.mark.parametrize("attention_backend", ["torch", "auto"])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_greedy_tokens_equal_transformers_quantizing_the_same_way(
    llama_dir: Path, kv_cache_dtype: str, attention_backend: str
) -> None:
    """Batched prompts through each CPU backend ("auto": the C kernels) with calibrated scales."""
    llm = quantized_llm(
        llama_dir, kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend
    )
    assert llm.engine.kv_cache.dtype == storage_dtype(kv_cache_dtype, torch.float32)
    scales = llm.engine.kv_cache_scales
    assert scales is not None and scales.kv_cache_dtype == kv_cache_dtype
    expected = transformers_quantized_kv_greedy(llama_dir, scales)
    assert engine_greedy(llm) == expected
    # the quantization is not a no-op: the float cache decodes otherwise
    assert engine_greedy(quantized_llm(llama_dir)) != expected


@pytest.mark.parametrize(
    "mode",
    [
        {"max_num_batched_tokens": 8},  # prompts in chunks of up to 8 tokens
        # the longest request holds 13 blocks of 4: the others are preempted for it
        {"num_kv_blocks": 14, "block_size": 4, "max_num_batched_tokens": 16},
    ],
    ids=["chunked-prefill", "preemption"],
)
def test_chunked_prefill_and_preemption_read_the_same_cache(
    llama_dir: Path, mode: dict[str, Any]
) -> None:
    scales = quantized_llm(llama_dir, kv_cache_dtype="int8").engine.kv_cache_scales
    assert scales is not None
    llm = quantized_llm(llama_dir, kv_cache_dtype="int8", kv_cache_scales=scales, **mode)
    assert engine_greedy(llm) == transformers_quantized_kv_greedy(llama_dir, scales)
    assert ("num_kv_blocks" in mode) == (llm.engine.num_preemptions > 0)


def test_prefix_cache_hits_read_the_quantized_blocks(llama_dir: Path) -> None:
    """A second run of prompts sharing a cached prefix reads the blocks the first one stored."""
    llm = quantized_llm(llama_dir, kv_cache_dtype="fp8_e4m3", block_size=4)
    scales = llm.engine.kv_cache_scales
    assert scales is not None
    first = engine_greedy(llm)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    again = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in again] == first
    assert first == transformers_quantized_kv_greedy(llama_dir, scales)
    assert all(o.num_cached_tokens > 0 for o in again[1:])


def test_sliding_and_full_cache_groups(tmp_path: Path) -> None:
    """Gemma 2: soft-capped logits, sliding and full layers in cache groups of their own, each
    layer reading its own scales from its group's blocks."""
    model_dir = make_tiny_model(tmp_path, "Gemma2ForCausalLM", sliding_window=8)
    llm = quantized_llm(model_dir, kv_cache_dtype="fp8_e4m3", block_size=4)
    assert llm.engine.model_config.cache_groups.num_groups > 1
    scales = llm.engine.kv_cache_scales
    assert scales is not None
    assert engine_greedy(llm) == transformers_quantized_kv_greedy(model_dir, scales)


def test_calibration_repeats_and_given_scales_are_used(llama_dir: Path) -> None:
    first = quantized_llm(llama_dir, kv_cache_dtype="fp8_e4m3").engine.kv_cache_scales
    again = quantized_llm(llama_dir, kv_cache_dtype="fp8_e4m3").engine.kv_cache_scales
    assert first is not None and first == again
    assert first.num_layers == 2 and first.num_kv_heads == 2
    given = KVCacheScales(
        "fp8_e4m3", tuple(((0.5, 0.25), (0.125, 1.0)) for _ in range(first.num_layers))
    )
    llm = quantized_llm(llama_dir, kv_cache_dtype="fp8_e4m3", kv_cache_scales=given)
    assert llm.engine.kv_cache_scales == given
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Attention)]
    assert all(torch.equal(m.kv_scales, torch.tensor([[0.5, 0.25], [0.125, 1.0]])) for m in layers)
    assert engine_greedy(llm) == transformers_quantized_kv_greedy(llama_dir, given)


def test_scales_round_trip_through_json() -> None:
    scales = KVCacheScales("int8", (((0.1, 0.2), (0.3, 0.4)), ((1.5, 2.0), (0.01, 3.0))))
    assert KVCacheScales.from_json(scales.to_json()) == scales
    latent = KVCacheScales("fp8_e4m3", (((0.5,),), ((0.25,),)))
    assert latent.kv_planes == 1 and KVCacheScales.from_json(latent.to_json()) == latent
    assert torch.equal(latent.layer(1, range(1), torch.device("cpu")), torch.tensor([[0.25]]))
    with pytest.raises(ValueError, match="layer 1 must be a latent scale for each of 1"):
        KVCacheScales("int8", (((0.5,),), ((0.5,), (0.5,))))
    with pytest.raises(ValueError, match="need 2 planes .* or 1 .* layer 0 has 3"):
        KVCacheScales("int8", (((0.5,), (0.5,), (0.5,)),))


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_a_quantized_cache_holds_four_times_the_float32_tokens(
    llama_dir: Path, kv_cache_dtype: str
) -> None:
    budget = 1 << 20
    float_cache = quantized_llm(llama_dir, kv_cache_memory_bytes=budget).engine.kv_cache
    cache = quantized_llm(
        llama_dir, kv_cache_memory_bytes=budget, kv_cache_dtype=kv_cache_dtype
    ).engine.kv_cache
    assert cache.element_size() == 1
    assert cache.shape[2] == 4 * float_cache.shape[2]
    assert cache.numel() * cache.element_size() <= budget


def test_bad_kv_cache_settings_are_refused(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8_e4m3, int8"):
        quantized_llm(llama_dir, kv_cache_dtype="fp4")
    two_layers = tuple(((1.0, 1.0), (1.0, 1.0)) for _ in range(2))
    with pytest.raises(ValueError, match="kv_cache_scales are for a int8 cache"):
        quantized_llm(
            llama_dir,
            kv_cache_dtype="fp8_e4m3",
            kv_cache_scales=KVCacheScales("int8", two_layers),
        )
    with pytest.raises(ValueError, match=r"kv_cache_scales cover 3 layers .* the model has 2"):
        quantized_llm(
            llama_dir,
            kv_cache_dtype="int8",
            kv_cache_scales=KVCacheScales("int8", two_layers + two_layers[:1]),
        )
    with pytest.raises(ValueError, match="must be finite floats > 0"):
        KVCacheScales("int8", (((1.0, 0.0), (1.0, 1.0)),))
    with pytest.raises(ValueError, match=r"kv_cache_scales have 2 planes per layer; .* has 1"):
        quantized_llm(
            make_tiny_model(tmp_path / "mla", "DeepseekV3ForCausalLM"),
            kv_cache_dtype="int8",
            kv_cache_scales=KVCacheScales("int8", two_layers),
        )


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mla"), "DeepseekV3ForCausalLM")


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_latent_cache_greedy_tokens_equal_transformers_quantizing_the_same_way(
    mla_dir: Path, kv_cache_dtype: str
) -> None:
    """DeepSeek-V3's latent cache: one scale per layer for its whole entries (the latent and
    the rotary key), calibrated; batched prompts with chunked prefill through the CPU
    backend's C kernels (its one plane read as keys and values)."""
    llm = quantized_llm(mla_dir, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16)
    assert llm.engine.kv_cache.dtype == storage_dtype(kv_cache_dtype, torch.float32)
    scales = llm.engine.kv_cache_scales
    assert scales is not None and (scales.kv_planes, scales.num_kv_heads) == (1, 1)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, LatentCacheAttention)]
    assert layers and all(m.kv_scales is not None and m.kv_scales.shape == (1, 1) for m in layers)
    expected = transformers_quantized_kv_greedy(mla_dir, scales)
    assert engine_greedy(llm) == expected
    if kv_cache_dtype == "int8":
        # the quantization is not a no-op: the float cache decodes otherwise
        assert engine_greedy(quantized_llm(mla_dir)) != expected
        # given scales (a cluster's) round-trip and are used as given
        again = KVCacheScales.from_json(scales.to_json())
        given = quantized_llm(mla_dir, kv_cache_dtype="int8", kv_cache_scales=again)
        assert given.engine.kv_cache_scales == scales and engine_greedy(given) == expected


def test_latent_cache_through_the_triton_kernels(mla_dir: Path) -> None:
    """The Triton latent kernels (Triton's interpreter on CPU) write and read the quantized
    latent cache: the same tokens as transformers quantizing the same way."""
    llm = quantized_llm(
        mla_dir, kv_cache_dtype="fp8_e4m3", attention_backend="triton", max_num_batched_tokens=16
    )
    assert llm.engine.runner.attn_backend.name == "triton"
    scales = llm.engine.kv_cache_scales
    assert scales is not None
    assert engine_greedy(llm) == transformers_quantized_kv_greedy(mla_dir, scales)


def test_latent_cache_holds_four_times_the_float32_tokens(mla_dir: Path) -> None:
    budget = 1 << 18
    float_cache = quantized_llm(mla_dir, kv_cache_memory_bytes=budget).engine.kv_cache
    cache = quantized_llm(
        mla_dir, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8_e4m3"
    ).engine.kv_cache
    assert cache.element_size() == 1 and cache.shape[1] == 1
    assert cache.shape[2] == 4 * float_cache.shape[2]


def test_latent_model_refuses_checkpoint_kv_scales(mla_dir: Path, tmp_path: Path) -> None:
    """A latent cache has one scale per layer; which of a checkpoint's k_scale and v_scale
    stands for it is not settled, so they are refused by name (calibration or given scales
    serve)."""
    scales = {
        f"model.layers.{layer}.self_attn.{plane}_scale": torch.tensor(0.01)
        for layer in range(2)
        for plane in "kv"
    }
    model_dir = _with_checkpoint_scales(mla_dir, tmp_path / "m", FP8_TENSOR_SCHEME, scales)
    with pytest.raises(ValueError, match=r"k_scale/v_scale\) are not supported for a latent"):
        quantized_llm(model_dir, kv_cache_dtype="fp8_e4m3")


def test_fp8_alias_is_fp8_e4m3(llama_dir: Path) -> None:
    llm = quantized_llm(llama_dir, kv_cache_dtype="fp8")
    assert llm.engine.kv_cache.dtype == torch.float8_e4m3fn


def test_demo_model_held_out_perplexity_within_two_percent() -> None:
    """The bundled demo model over its held-out docstrings (the windows it was evaluated on):
    each quantized cache's perplexity within 2 % of the float32 cache's."""
    from engine.demo_model import DEMO_MODEL_DIR
    from engine.demo_model.held_out import held_out_perplexity, held_out_windows

    prompts = held_out_windows()
    assert sum(len(p) - 1 for p in prompts) > 5000

    def perplexity(kv_cache_dtype: str) -> float:
        llm = LLM(str(DEMO_MODEL_DIR), device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype)
        return held_out_perplexity(llm, prompts)

    float_perplexity = perplexity("auto")
    for kv_cache_dtype in KV_CACHE_DTYPES:
        assert abs(perplexity(kv_cache_dtype) / float_perplexity - 1) < 0.02, kv_cache_dtype


def _with_checkpoint_scales(
    float_dir: Path, out_dir: Path, scheme: dict[str, Any] | None, scales: dict[str, torch.Tensor]
) -> Path:
    """``float_dir``'s model with KV cache scales beside its weights, and ``scheme`` as
    compressed-tensors' ``kv_cache_scheme`` (None: no quantization_config, as FP8 checkpoints
    of other tools carry their scales)."""
    shutil.copytree(float_dir, out_dir)
    weights = load_file(str(out_dir / "model.safetensors"))
    save_file({**weights, **scales}, str(out_dir / "model.safetensors"), {"format": "pt"})
    if scheme is not None:
        config = json.loads((out_dir / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "dense",
            "quantization_status": "compressed",
            "kv_cache_scheme": scheme,
        }
        (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


FP8_TENSOR_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_checkpoint_scales_per_layer_are_used(
    llama_dir: Path, tmp_path: Path, kv_cache_dtype: str
) -> None:
    """llm-compressor's FP8 KV scheme: a k_scale and a v_scale per layer, for float8; an int8
    cache takes them by the same largest magnitude (x 448 / 127)."""
    scales = {
        f"model.layers.{layer}.self_attn.{plane}_scale": torch.tensor(0.01 * (layer + 1) + bump)
        for layer in range(2)
        for plane, bump in (("k", 0.0), ("v", 0.005))
    }
    model_dir = _with_checkpoint_scales(llama_dir, tmp_path / "m", FP8_TENSOR_SCHEME, scales)
    llm = quantized_llm(model_dir, kv_cache_dtype=kv_cache_dtype)
    got = llm.engine.kv_cache_scales
    assert got is not None
    factor = 1.0 if kv_cache_dtype == "fp8_e4m3" else 448.0 / 127.0
    for layer in range(2):
        for plane, name in enumerate("kv"):
            expected = float(scales[f"model.layers.{layer}.self_attn.{name}_scale"]) * factor
            assert got.per_layer[layer][plane] == pytest.approx((expected, expected), rel=1e-6)
    assert engine_greedy(llm) == transformers_quantized_kv_greedy(llama_dir, got)


def test_checkpoint_scales_per_head_without_a_scheme(llama_dir: Path, tmp_path: Path) -> None:
    """Scales per KV head (strategy attn_head), and scales with no quantization_config at all
    (fp8 scales, as vLLM reads them)."""
    per_head = {
        f"model.layers.{layer}.self_attn.{plane}_scale": torch.tensor([0.02, 0.03 + layer / 100])
        for layer in range(2)
        for plane in "kv"
    }
    model_dir = _with_checkpoint_scales(llama_dir, tmp_path / "m", None, per_head)
    llm = quantized_llm(model_dir, kv_cache_dtype="fp8_e4m3")
    got = llm.engine.kv_cache_scales
    assert got is not None
    assert got.per_layer[1][0] == pytest.approx((0.02, 0.04))
    assert engine_greedy(llm) == transformers_quantized_kv_greedy(llama_dir, got)


def test_bad_checkpoint_kv_schemes_are_refused_naming_the_field(
    llama_dir: Path, tmp_path: Path
) -> None:
    one = {"model.layers.0.self_attn.k_scale": torch.tensor(0.01)}
    for index, (change, message) in enumerate(
        [
            ({"dynamic": True}, r"kv_cache_scheme.dynamic True is not supported"),
            ({"num_bits": 4}, r"kv_cache_scheme.num_bits 4 is not supported"),
            ({"strategy": "channel"}, r"kv_cache_scheme.strategy 'channel' is not supported"),
            ({"symmetric": False}, r"kv_cache_scheme.symmetric false is not supported"),
        ]
    ):
        model_dir = _with_checkpoint_scales(
            llama_dir, tmp_path / str(index), {**FP8_TENSOR_SCHEME, **change}, one
        )
        with pytest.raises(ValueError, match=message):
            quantized_llm(model_dir, kv_cache_dtype="fp8_e4m3")
    model_dir = _with_checkpoint_scales(llama_dir, tmp_path / "partial", FP8_TENSOR_SCHEME, one)
    with pytest.raises(ValueError, match="but not model.layers.0.self_attn.v_scale"):
        quantized_llm(model_dir, kv_cache_dtype="fp8_e4m3")


def test_two_tensor_parallel_ranks_gather_the_whole_models_scales(llama_dir: Path) -> None:
    """Each rank calibrates the KV heads it holds; the engine's scales are the whole model's,
    each rank's layers hold their heads' share, and greedy tokens equal transformers
    quantizing its K/V by those scales."""
    llm = quantized_llm(llama_dir, kv_cache_dtype="int8", tensor_parallel_size=2)
    scales = llm.engine.kv_cache_scales
    one_rank = quantized_llm(llama_dir, kv_cache_dtype="int8").engine.kv_cache_scales
    assert scales is not None and one_rank is not None
    assert scales.num_kv_heads == 2 and llm.engine.kv_cache.shape[4] == 1
    for layer in range(scales.num_layers):
        for plane in (0, 1):
            assert scales.per_layer[layer][plane] == pytest.approx(
                one_rank.per_layer[layer][plane], rel=1e-4
            )
    rank0 = [m for m in llm.engine.model.modules() if isinstance(m, Attention)]
    for module in rank0:
        expected = scales.layer(module.place.layer, range(0, 1), torch.device("cpu"))
        assert module.kv_scales is not None and torch.equal(module.kv_scales, expected)
    assert engine_greedy(llm) == transformers_quantized_kv_greedy(llama_dir, scales)
