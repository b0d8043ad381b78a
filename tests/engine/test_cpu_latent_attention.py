"""A latent cache (multi-head latent attention) through the CPU backend's C kernels: its one
plane read as both keys and values, against the torch reference, ``engine.attention.latent_ref``
(float32 and quantized caches), and a tiny DeepSeek-V3 token for token with transformers with
the reference out of the way.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import latent_ref
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.torch_ref import TorchAttentionBackend
from engine.kernels.cpu.paged_decode_attention import paged_decode_attention_cpu
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_triton_latent_attention import FLOAT32, _make_batch, _quantized


@pytest.mark.parametrize(("width", "value_dim"), [(72, 64), (96, 64), (40, 32)])
def test_mixed_batch_equals_the_reference(width: int, value_dim: int) -> None:
    """Two prefill sequences (one after a cached prefix) and three decode rows; widths whose
    value loops run vectorised (a multiple of 32) and not."""
    batch = _make_batch([(18, 18), (29, 5)], [1, 26, 11], width=width, value_dim=value_dim)
    metadata = batch.metadata
    cache = batch.cache_layer.clone()
    cache.view(-1, width)[metadata.slot_mapping] = 0  # the new tokens' entries not yet written
    backend = CpuAttentionBackend()
    backend.write_latent(cache, batch.new_entries, metadata.slot_mapping)
    assert torch.equal(cache, batch.cache_layer)
    out = backend.forward_latent(batch.query, cache, metadata, batch.scale, value_dim)
    assert out.dtype == torch.float32 and out.shape == (26, 4, value_dim)
    torch.testing.assert_close(out, batch.reference(), **FLOAT32)


@pytest.mark.parametrize(("num_heads", "width", "value_dim"), [(7, 96, 64), (16, 288, 256)])
def test_decode_rows_over_wide_entries_read_the_cache_in_place(
    num_heads: int, width: int, value_dim: int
) -> None:
    """A decode row's query heads, fewer than the kernel's IN_PLACE_ROWS, over entries a
    multiple of 16 wide: their scores are products with the cache's entries where they lie
    (four heads at a time, the rest one by one); the prompt's many rows through the transposed
    tiles over entries of 96, in place over entries of 288 (past IN_PLACE_HEAD_DIM); as the
    reference."""
    batch = _make_batch(
        [(21, 21)], [1, 40, 17, 33], num_heads=num_heads, width=width, value_dim=value_dim, seed=5
    )
    out = CpuAttentionBackend().forward_latent(
        batch.query, batch.cache_layer, batch.metadata, batch.scale, value_dim
    )
    torch.testing.assert_close(out, batch.reference(), **FLOAT32)


def test_decode_only_and_prefill_only_steps() -> None:
    backend = CpuAttentionBackend()
    for prefills, decodes in (([], [40, 3, 17]), ([(33, 12)], [])):
        batch = _make_batch(prefills, decodes, width=72, value_dim=64, seed=3)
        out = backend.forward_latent(
            batch.query, batch.cache_layer, batch.metadata, batch.scale, 64
        )
        torch.testing.assert_close(out, batch.reference(), **FLOAT32)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_a_quantized_cache_reads_as_the_reference_reads_it(kv_cache_dtype: str) -> None:
    """float8 e4m3 or int8 entries with the layer's one scale, read in place (the scale on the
    logits and the output) as the reference reads them dequantized."""
    batch = _make_batch([(18, 18), (29, 5)], [1, 26, 11], width=72, value_dim=64)
    cache, kv_scales = _quantized(batch, kv_cache_dtype)
    metadata = batch.metadata
    out = CpuAttentionBackend().forward_latent(
        batch.query, cache, metadata, batch.scale, 64, kv_scales=kv_scales
    )
    expected = TorchAttentionBackend().forward_latent(
        batch.query, cache, metadata, batch.scale, 64, kv_scales=kv_scales
    )
    torch.testing.assert_close(out, expected, **FLOAT32)


def test_bad_latent_caches_are_named() -> None:
    batch = _make_batch([], [5, 3], seed=7)
    metadata = batch.metadata
    args = (metadata.decode_block_tables, metadata.decode_seq_lens, 1.0)
    two_heads = batch.cache_layer.expand(-1, -1, -1, 2, -1).contiguous()
    with pytest.raises(ValueError, match=r"a latent cache's \[1, num_blocks, block_size, 1"):
        paged_decode_attention_cpu(batch.query, two_heads, *args)
    cache, kv_scales = _quantized(batch, "int8")
    with pytest.raises(ValueError, match=r"kv_scales must be a contiguous \[1, num_kv_heads"):
        paged_decode_attention_cpu(
            batch.query, cache, *args, kv_scales=kv_scales.expand(2, 1).contiguous()
        )


def test_a_tiny_deepseek_v3_on_the_cpu_kernels_matches_transformers(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's latent attention layers through the C kernels (the reference refuses to
    run), token for token with transformers: prompts in chunks of at most 24 tokens, so steps
    mix a chunk after its cached prefix with other sequences' decode rows."""

    def refused(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the torch reference ran")

    monkeypatch.setattr(latent_ref, "latent_attention", refused)
    model_dir = model_dirs["DeepseekV3ForCausalLM"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (13, 40, 5)]
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=24
    )
    assert llm.engine.runner.attn_backend.name == "cpu"
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    expected = [hf_greedy(model_dir, prompt, 8) for prompt in prompts]
    assert [output.outputs[0].token_ids for output in outputs] == expected
