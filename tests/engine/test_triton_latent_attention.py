"""The Triton latent-attention kernels (multi-head latent attention) against the torch reference,
``engine.attention.latent_ref``, on random paged inputs.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so shapes stay tiny and the tiles shrink to 16 positions, so that contexts span several. Each
batch's blocks are handed out shuffled, so no block table is in order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import latent_ref
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.kernels.latent_attention import (
    LatentTiling,
    latent_decode_attention,
    latent_prefill_attention,
    write_latent_cache,
)
from engine.kv_cache.kv_quantization import quantize_kv, scales_from_amax, storage_dtype
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_triton_kv_write import _rounding_probes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 4
SMALL = LatentTiling(decode_heads=16, prefill_rows=16, tile=16)
FLOAT32 = {"atol": 2e-5, "rtol": 1e-5}
# bf16 keeps 8 mantissa bits: the probabilities are rounded before the P @ V product
BFLOAT16 = {"atol": 2e-2, "rtol": 2e-2}


@dataclass(frozen=True)
class LatentBatch:
    query: torch.Tensor  # [num_tokens, num_heads, width]
    cache_layer: torch.Tensor  # [1, num_blocks, block_size, 1, width], every context entry in
    new_entries: torch.Tensor  # [num_tokens, width]: the new tokens' entries (in the cache too)
    metadata: AttentionMetadata
    value_dim: int
    scale: float

    def reference(self) -> torch.Tensor:  # [num_tokens, num_heads, value_dim] float32
        return latent_ref.latent_attention(
            self.query.float(), self.cache_layer.float(), self.metadata, self.scale, self.value_dim
        )

    def prefill(self, tiling: LatentTiling = SMALL) -> torch.Tensor:
        metadata = self.metadata
        starts = metadata.prefill_query_start_loc
        return latent_prefill_attention(
            self.query[: metadata.num_prefill_tokens],
            self.cache_layer,
            torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            torch.tensor(metadata.prefill_seq_lens, dtype=torch.int32, device=DEVICE),
            metadata.prefill_block_tables,
            self.scale,
            self.value_dim,
            max(end - start for start, end in zip(starts[:-1], starts[1:])),
            tiling,
        )

    def decode(
        self,
        tokens_per_split: int | None = None,
        max_seq_len: int | None = None,
        tiling: LatentTiling = SMALL,
    ) -> torch.Tensor:
        metadata = self.metadata
        return latent_decode_attention(
            self.query[metadata.num_prefill_tokens :],
            self.cache_layer,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            self.scale,
            self.value_dim,
            max_seq_len=max_seq_len or metadata.max_decode_seq_len,
            tokens_per_split=tokens_per_split,
            tiling=tiling,
        )


def _make_batch(
    prefills: list[tuple[int, int]],  # (context after this step, new tokens) per sequence
    decode_lens: list[int],  # context per decode row, its new token included
    num_heads: int = 4,
    width: int = 40,
    value_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LatentBatch:
    """A batch whose whole contexts are already in the cache, in shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    seqs = [*prefills, *[(seq_len, 1) for seq_len in decode_lens]]
    blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # a few never read
    order = torch.randperm(num_blocks, generator=generator).tolist()
    cache = torch.randn(1, num_blocks, BLOCK_SIZE, 1, width, generator=generator).to(dtype)
    tables = torch.zeros(len(seqs), max(blocks_per_seq) + 2, dtype=torch.int64)  # padded
    slots = []
    for seq, ((seq_len, query_len), num) in enumerate(zip(seqs, blocks_per_seq)):
        tables[seq, :num] = torch.tensor(order[:num])
        order = order[num:]
        positions = torch.arange(seq_len - query_len, seq_len)
        slots.append(tables[seq, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE)
    slot_mapping = torch.cat(slots)
    starts = [0]
    for _, query_len in prefills:
        starts.append(starts[-1] + query_len)
    num_prefills = len(prefills)
    metadata = AttentionMetadata(
        num_prefill_seqs=num_prefills,
        num_prefill_tokens=starts[-1],
        num_decode_seqs=len(decode_lens),
        slot_mapping=slot_mapping.to(DEVICE),
        prefill_query_start_loc=starts,
        prefill_seq_lens=[seq_len for seq_len, _ in prefills],
        prefill_block_tables=tables[:num_prefills].to(DEVICE),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64, device=DEVICE),
        decode_block_tables=tables[num_prefills:].to(DEVICE),
        max_decode_seq_len=max(decode_lens, default=0),
    )
    query = torch.randn(len(slot_mapping), num_heads, width, generator=generator).to(dtype)
    new_entries = cache.view(-1, width)[slot_mapping].clone()
    return LatentBatch(
        query.to(DEVICE), cache.to(DEVICE), new_entries.to(DEVICE), metadata, value_dim, 0.3
    )


WIDTHS = pytest.mark.parametrize(
    ("width", "value_dim"), [(40, 32), (72, 64)], ids=["width40", "width72"]
)


@WIDTHS
def test_prefill_with_and_without_a_cached_prefix(width: int, value_dim: int) -> None:
    """Fresh prompts, a chunk after a cached prefix, one of a single token; query tiles of
    4 tokens x 4 heads, so the diagonal falls inside and at the edge of 16-position tiles."""
    batch = _make_batch([(21, 21), (38, 9), (16, 16), (7, 1)], [], width=width, value_dim=value_dim)
    out = batch.prefill()
    assert out.shape == (47, 4, value_dim)
    torch.testing.assert_close(out, batch.reference(), **FLOAT32)


def test_prefill_with_more_heads_than_a_program_takes() -> None:
    """20 heads over programs of 16 rows: one new token x 16 heads each, the second head block
    padded."""
    batch = _make_batch([(13, 6), (5, 5)], [], num_heads=20, seed=1)
    torch.testing.assert_close(batch.prefill(), batch.reference(), **FLOAT32)


@WIDTHS
@pytest.mark.parametrize("tokens_per_split", [None, 16], ids=["one-partition", "partitions-16"])
def test_decode_rows_of_different_lengths(
    width: int, value_dim: int, tokens_per_split: int | None
) -> None:
    """Contexts of 1 to 45 tokens, in one partition or in partitions of 16 merged after."""
    batch = _make_batch([], [1, 45, 16, 9], width=width, value_dim=value_dim, seed=2)
    out = batch.decode(tokens_per_split)
    assert out.shape == (4, 4, value_dim)
    torch.testing.assert_close(out, batch.reference(), **FLOAT32)


def test_decode_with_more_heads_than_a_program_takes() -> None:
    batch = _make_batch([], [23, 3], num_heads=20, seed=3)
    torch.testing.assert_close(batch.decode(16), batch.reference(), **FLOAT32)


def test_a_decode_row_gets_the_same_bits_whatever_the_bound() -> None:
    """A decode graph bounds the contexts by its block table's capacity, an eager step by the
    longest context: the same partitions, the same bits."""
    batch = _make_batch([], [30, 7], seed=4)
    capacity = batch.metadata.decode_block_tables.shape[1] * BLOCK_SIZE
    assert capacity > 30
    assert torch.equal(batch.decode(16, max_seq_len=30), batch.decode(16, max_seq_len=capacity))


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, FLOAT32), (torch.bfloat16, BFLOAT16)]
)
def test_mixed_batch_through_the_backend(dtype: torch.dtype, tolerance: dict[str, float]) -> None:
    """TritonAttentionBackend writes the new entries and attends over a batch of two prefill
    sequences (one after a cached prefix) and three decode rows, as the reference does."""
    batch = _make_batch([(18, 18), (29, 5)], [1, 26, 11], width=72, value_dim=64, dtype=dtype)
    metadata = batch.metadata
    expected_cache = batch.cache_layer.clone()
    cache = batch.cache_layer.clone()
    cache.view(-1, 72)[metadata.slot_mapping] = 0  # the new tokens' entries not yet written
    backend = TritonAttentionBackend()
    backend.write_latent(cache, batch.new_entries, metadata.slot_mapping)
    assert torch.equal(cache, expected_cache)
    out = backend.forward_latent(batch.query, cache, metadata, batch.scale, batch.value_dim)
    assert out.dtype == dtype and out.shape == (26, 4, 64)
    torch.testing.assert_close(out.float(), batch.reference(), **tolerance)
    # the torch reference backend on the same inputs, in the same dtype
    expected = TorchAttentionBackend().forward_latent(
        batch.query, expected_cache, metadata, batch.scale, batch.value_dim
    )
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


def test_float16_decode() -> None:
    batch = _make_batch([], [20, 5], dtype=torch.float16, seed=5)
    out = batch.decode(16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), batch.reference(), atol=4e-3, rtol=4e-3)


def test_write_skips_padding_rows_and_reads_strided_entries() -> None:
    """A negative slot (a decode graph's padding row) writes nothing; entries may be a view of
    wider rows (their width contiguous)."""
    cache = torch.zeros(1, 3, BLOCK_SIZE, 1, 40, dtype=torch.bfloat16, device=DEVICE)
    rows = torch.randn(3, 50, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    entries = rows.to(DEVICE)[:, 5:45]
    slots = torch.tensor([9, -1, 2], device=DEVICE)
    write_latent_cache(cache, entries, slots)
    expected = torch.zeros_like(cache)
    latent_ref.write_latent(expected, entries[[0, 2]], slots[[0, 2]])
    assert torch.equal(cache, expected)


def test_bad_arguments_are_named() -> None:
    batch = _make_batch([], [5, 3], seed=7)
    cache, metadata = batch.cache_layer, batch.metadata
    args = {
        "query": batch.query,
        "cache_layer": cache,
        "block_tables": metadata.decode_block_tables,
        "seq_lens": metadata.decode_seq_lens,
        "scale": 1.0,
        "value_dim": 32,
    }
    bad = [
        (
            {"cache_layer": cache[..., :36].contiguous()},
            r"query must be \[num_tokens, num_heads, 36",
        ),
        ({"cache_layer": cache.expand(2, -1, -1, -1, -1)}, r"cache_layer must be \[1, num_blocks"),
        ({"value_dim": 41}, r"value_dim must be in \[1, width = 40\], got 41"),
        ({"query": batch.query.half()}, "query dtype torch.float16 != cache_layer dtype"),
        ({"seq_lens": metadata.decode_seq_lens.float()}, "seq_lens must be int32 or int64"),
        ({"max_seq_len": 4}, r"seq_lens must be in \[1, max_seq_len = 4\]"),
        ({"tiling": LatentTiling(decode_heads=8)}, "tiling.decode_heads must be a power of two"),
    ]
    for changes, message in bad:
        with pytest.raises(ValueError, match=message):
            latent_decode_attention(**{**args, **changes})
    with pytest.raises(ValueError, match="slot_mapping must be < num_blocks"):
        write_latent_cache(cache, batch.query[:, 0], metadata.slot_mapping + 1000)


# ---- a quantized latent cache: float8 e4m3 or int8 elements, one scale per layer -----------
def _quantized(
    batch: LatentBatch, kv_cache_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:  # the cache quantized, and its [1, 1] scale
    """``batch``'s cache as a quantized cache stores it, by a calibrated scale."""
    kv_scales = scales_from_amax(kv_cache_dtype, batch.cache_layer.abs().amax().float())
    kv_scales = kv_scales.reshape(1, 1).to(DEVICE)
    into = storage_dtype(kv_cache_dtype, batch.cache_layer.dtype)
    return quantize_kv(
        batch.cache_layer.view(-1, 1, batch.cache_layer.shape[-1]), kv_scales[0], into
    ).view(batch.cache_layer.shape), kv_scales


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "tolerance"),
    [("fp8_e4m3", torch.float32, FLOAT32), ("int8", torch.bfloat16, BFLOAT16)],
)
def test_quantized_mixed_batch_through_the_backend(
    kv_cache_dtype: str, dtype: torch.dtype, tolerance: dict[str, float]
) -> None:
    """A quantized latent cache: the backend's write stores the bytes the torch reference
    stores, and its prefill and decode kernels (the scale folded into the logits and the
    output) read the entries as the reference does (dequantized to the query's dtype); the
    decode rows also in partitions of 16, merged."""
    batch = _make_batch([(18, 18), (29, 5)], [1, 26, 11], width=72, value_dim=64, dtype=dtype)
    metadata = batch.metadata
    expected_cache, kv_scales = _quantized(batch, kv_cache_dtype)
    cache = expected_cache.clone()
    cache.view(torch.uint8).view(-1, 72)[metadata.slot_mapping] = 0  # the new entries unwritten
    backend = TritonAttentionBackend()
    backend.write_latent(cache, batch.new_entries, metadata.slot_mapping, kv_scales)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    out = backend.forward_latent(
        batch.query, cache, metadata, batch.scale, batch.value_dim, kv_scales=kv_scales
    )
    assert out.dtype == dtype and out.shape == (26, 4, 64)
    expected = TorchAttentionBackend().forward_latent(
        batch.query, cache, metadata, batch.scale, batch.value_dim, kv_scales=kv_scales
    )
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    decode = latent_decode_attention(
        batch.query[metadata.num_prefill_tokens :],
        cache,
        metadata.decode_block_tables,
        metadata.decode_seq_lens,
        batch.scale,
        batch.value_dim,
        tokens_per_split=16,
        tiling=SMALL,
        kv_scales=kv_scales,
    )
    torch.testing.assert_close(
        decode.float(), expected[metadata.num_prefill_tokens :].float(), **tolerance
    )


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.37])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_latent_write_is_bit_exact(kv_cache_dtype: str, scale: float) -> None:
    """Every stored byte is quantize_kv's (the torch reference's write): ties to even, clamped
    at 448 / 127, subnormals, signed zeros, infinities saturated; a padding row and the slots
    not written keep their bytes. Scales 1 and 0.25 keep the ties ties, 0.37 rounds in the
    division."""
    width = 40
    probes = _rounding_probes(kv_cache_dtype)
    num_tokens = -(-probes.numel() // width)
    entries = torch.zeros(num_tokens * width)
    entries[: probes.numel()] = probes
    entries = entries.view(num_tokens, width).to(DEVICE)
    generator = torch.Generator().manual_seed(8)
    num_slots = num_tokens + 7
    cache_bytes = torch.randint(0, 256, (1, num_slots, 1, 1, width), generator=generator)
    cache = cache_bytes.to(torch.uint8).view(storage_dtype(kv_cache_dtype, torch.float32))
    cache = cache.to(DEVICE)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens].to(DEVICE)
    slots[3] = -1  # a padding row
    kv_scales = torch.tensor([[scale]], device=DEVICE)
    written = cache.clone()
    write_latent_cache(written, entries, slots, kv_scales)
    expected = cache.clone()
    kept = slots >= 0
    latent_ref.write_latent(expected, entries[kept], slots[kept], kv_scales)
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))


def test_bad_quantized_arguments_are_named() -> None:
    batch = _make_batch([], [5, 3], seed=9)
    cache, kv_scales = _quantized(batch, "int8")
    metadata = batch.metadata
    args = (batch.query, cache, metadata.decode_block_tables, metadata.decode_seq_lens, 1.0, 32)
    with pytest.raises(ValueError, match="a torch.int8 kv_cache_layer needs kv_scales"):
        latent_decode_attention(*args)
    with pytest.raises(ValueError, match=r"kv_scales must be a contiguous \[1, num_kv_heads = 1"):
        latent_decode_attention(*args, kv_scales=kv_scales.expand(2, 1).contiguous())
    with pytest.raises(ValueError, match="kv_scales are for a quantized cache"):
        write_latent_cache(batch.cache_layer, batch.new_entries, metadata.slot_mapping, kv_scales)
    with pytest.raises(ValueError, match="query dtype must be float32, float16 or bfloat16"):
        latent_decode_attention(batch.query.to(torch.int8), *args[1:], kv_scales=kv_scales)


def test_a_tiny_deepseek_v3_through_the_triton_backend_matches_transformers(
    model_dirs: dict[str, Path],
) -> None:
    """The engine's latent attention layers through the Triton kernels, token for token with
    transformers: prompts in chunks of at most 24 tokens, so steps mix a chunk after its cached
    prefix with other sequences' decode rows."""
    model_dir = model_dirs["DeepseekV3ForCausalLM"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (13, 40, 5)]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        attention_backend="triton",
        block_size=8,
        max_num_batched_tokens=24,
    )
    assert llm.engine.runner.attn_backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    expected = [hf_greedy(model_dir, prompt, 8) for prompt in prompts]
    assert [output.outputs[0].token_ids for output in outputs] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deepseek_shapes_on_gpu() -> None:
    """Width 576 = 512 + 64, 16 heads (a tensor-parallel rank's share of 128), bfloat16, the
    engine's default tiling."""
    batch = _make_batch(
        [(300, 300), (700, 120)],
        [1024 - 37 * i for i in range(16)],
        num_heads=16,
        width=576,
        value_dim=512,
        dtype=torch.bfloat16,
    )
    out = TritonAttentionBackend().forward_latent(
        batch.query, batch.cache_layer, batch.metadata, batch.scale, batch.value_dim
    )
    torch.testing.assert_close(out.float(), batch.reference(), **BFLOAT16)
