"""Scales for a quantized KV cache from a calibration pass at start-up, when neither the
checkpoint nor the configuration gives them.

One prompt (``CALIBRATION_TEXT`` in the model's tokenizer; a fixed pseudo-random sequence of
token ids for a model directory without one) runs through the model once against a temporary
cache of the model's dtype, each cache group in blocks of its own. The largest magnitude each
layer's planes (K and V, or a latent cache's entries) reached per KV head, read back from that
cache (so it is exactly what a quantized cache would have been asked to store), becomes the
scale by ``scales_from_amax``. With speculative decoding's prediction layer (``"method":
"mtp"``), its slot after the decoder's is scaled too: the layer runs once over the forward's
hidden states. Every rank of a tensor-parallel worker runs the same pass (the forward is a
collective) and the ranks' heads are gathered into the whole model's scales.

A calibration depends on the device, dtype and parallelism that ran it; workers that hand KV
to each other must use the same scales (the layout handshake refuses others), so a cluster
calibrates once and hands the result to every worker (``CacheConfig.kv_cache_scales``).
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.forward_context import set_forward_context
from engine.kernels.linear import has_packed_linears
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.budget import KVLayout
from engine.kv_cache.cache_groups import CacheGroups
from engine.kv_cache.kv_quantization import KVCacheScales, scales_from_amax
from engine.model_runner import ModelRunner
from engine.models.prediction_layer import MultiTokenPredictor
from engine.models.registry import CausalLM
from engine.parallel.group import TensorParallelGroup
from engine.sampling import SamplingParams
from engine.scheduler.outputs import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.draft_batch import Chunk, chunk_forward, rows_with_padding
from engine.tokenizer import load_tokenizer

MAX_CALIBRATION_TOKENS = 512
CALIBRATION_TEXT = """\
A key-value cache keeps, for every token a model has read, the keys and values each attention
layer computed for it, so that the next token attends over them without computing them again.
When the cache is stored in eight bits, each head's keys and values are divided by a scale
and rounded; the scale must leave room for the largest values the head produces.

def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end) intervals and return them sorted.\"\"\"
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

The quick brown fox jumps over the lazy dog. In 1969, 600 million people watched the first
landing on the Moon; the crew returned 21.5 kilograms of lunar samples. Water boils at 100
degrees Celsius at sea level, and at about 70 degrees on the summit of Mount Everest.

class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        value = self.entries.pop(key, None)
        if value is not None:
            self.entries[key] = value  # most recently used goes last
        return value

Translate to French: "Where is the train station?" -> "Ou est la gare ?"
Question: what is 17 * 23? Answer: 391. Question: name three prime numbers. Answer: 2, 3, 5.
"""


def calibration_token_ids(
    tokenizer_dir: str, vocab_size: int, max_tokens: int, trust_remote_code: bool = False
) -> list[int]:
    """The calibration prompt's token ids, at most ``max_tokens``: ``CALIBRATION_TEXT`` in the
    tokenizer saved in ``tokenizer_dir``, else a fixed pseudo-random sequence."""
    tokenizer = load_tokenizer(tokenizer_dir, trust_remote_code)
    if tokenizer is not None:
        ids = [int(i) for i in tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)]
        ids = [i for i in ids if 0 <= i < vocab_size]
        if ids:
            return ids[:max_tokens]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (max_tokens,), generator=generator).tolist()


def calibrate_kv_scales(
    model: CausalLM,
    float_layout: KVLayout,  # the cache's layout in the model's dtype
    cache_groups: CacheGroups,
    attn_backend: AttentionBackend,
    device: torch.device,
    token_ids: list[int],
    kv_cache_dtype: str,
    kv_heads_of_ranks: tuple[range, ...],  # each rank's KV heads (one rank: all of them)
    group: TensorParallelGroup | None,
    # speculative decoding's prediction layer, whose slot (the last) is scaled too
    predictor: MultiTokenPredictor | None = None,
) -> KVCacheScales:
    """The whole model's scales from one forward over ``token_ids`` (and one of its prediction
    layer over the forward's hidden states, the token after each position)."""
    amax = _kv_amax(model, float_layout, cache_groups, attn_backend, device, token_ids, predictor)
    scales = scales_from_amax(kv_cache_dtype, amax)  # [num_layers, kv_planes, rank's heads]
    if group is not None:
        scales = _whole_model(group.all_gather(scales.contiguous()), kv_heads_of_ranks)
    return KVCacheScales.from_tensor(kv_cache_dtype, scales)


def _kv_amax(
    model: CausalLM,
    layout: KVLayout,
    cache_groups: CacheGroups,
    attn_backend: AttentionBackend,
    device: torch.device,
    token_ids: list[int],
    predictor: MultiTokenPredictor | None,
) -> torch.Tensor:  # [num_layers (+ the prediction layer), kv_planes, num_kv_heads] float32
    num_tokens = len(token_ids)
    blocks_per_group = -(-num_tokens // layout.block_size)
    num_groups = cache_groups.num_groups
    # [num_slots, kv_planes, num_groups * blocks_per_group, block_size, num_kv_heads, head_dim]
    cache = torch.zeros(
        layout.shape(num_groups * blocks_per_group), dtype=layout.dtype, device=device
    )
    runner = ModelRunner(model, cache, attn_backend, frozenset(), device)
    seq = Sequence(-1, "kv-calibration", token_ids, SamplingParams(max_tokens=1), num_tokens + 1)
    seq.block_tables = [
        BlockTable(range(g * blocks_per_group, (g + 1) * blocks_per_group))
        for g in range(num_groups)
    ]
    with torch.inference_mode():
        launched = runner.launch(
            SchedulerOutput([ScheduledSequence(seq, 0, num_tokens, (seq,))], [], num_tokens, 0)
        )
        num_layers = sum(len(g.layers) for g in cache_groups.groups)
        amax = torch.zeros(
            num_layers + (predictor is not None), layout.kv_planes, layout.num_kv_heads,
            dtype=torch.float32, device=device,
        )  # fmt: skip
        if predictor is not None:  # its slot after the decoder's (one cache group)
            _predict_over(predictor, launched.hidden, seq, cache, attn_backend)
            amax[num_layers] = cache[num_layers].abs().float().amax(dim=(1, 2, 4))
        for index, cache_group in enumerate(cache_groups.groups):
            blocks = slice(index * blocks_per_group, (index + 1) * blocks_per_group)
            for slot, layer in enumerate(cache_group.layers):
                # [kv_planes, blocks, block_size, heads, head_dim] -> [kv_planes, heads]
                amax[layer] = cache[slot, :, blocks].abs().float().amax(dim=(1, 2, 4))
    return amax


def _predict_over(
    predictor: MultiTokenPredictor,
    hidden: torch.Tensor,  # [num_tokens (+ padding), hidden_size]: the model's forward's
    seq: Sequence,
    cache: torch.Tensor,
    attn_backend: AttentionBackend,
) -> None:
    """The prediction layer's forward over ``seq``'s positions but the last (the token after
    each known), its KV written into its slot of ``cache``."""
    chunk = Chunk(seq, 0, seq.token_ids[1:])
    forward = chunk_forward([chunk], cache, attn_backend, has_packed_linears(predictor))
    held = rows_with_padding(hidden, forward.source_rows, forward.num_padding_rows)
    with set_forward_context(forward.context):
        predictor(forward.input_ids, forward.positions, held)


def _whole_model(
    gathered: torch.Tensor,  # [num_layers, kv_planes, size * rank's heads]: each rank's in turn
    kv_heads_of_ranks: tuple[range, ...],
) -> torch.Tensor:  # [num_layers, kv_planes, the model's KV heads]
    """The ranks' scales placed at their heads (a head replicated on several ranks takes the
    first one's)."""
    gathered = gathered.cpu()
    rank_heads = gathered.shape[-1] // len(kv_heads_of_ranks)
    num_heads = max(heads.stop for heads in kv_heads_of_ranks)
    whole = torch.zeros(*gathered.shape[:-1], num_heads, dtype=gathered.dtype)
    for rank in reversed(range(len(kv_heads_of_ranks))):
        heads = kv_heads_of_ranks[rank]
        whole[..., heads.start : heads.stop] = gathered[
            ..., rank * rank_heads : (rank + 1) * rank_heads
        ]
    return whole
