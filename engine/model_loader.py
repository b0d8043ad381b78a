"""Builds a model on the meta device, materialises it once on the target device, fills weights.

Weights come from a Hugging Face safetensors checkpoint (single file or sharded via
``model.safetensors.index.json``) or, with ``load_format="dummy"``, from a seeded random
init so big shapes can be benchmarked without a checkpoint.

Under tensor parallelism a rank reads only its slice of each checkpoint tensor (the rows of
its heads, MLP columns and vocab rows, or the input columns of a row-parallel weight) through
safetensors' ``get_slice``; no rank holds a whole sharded tensor. Replicated tensors (norms)
are read whole. Dummy weights of a rank are the same slices of the one-rank dummy model.

What differs between a family's checkpoints and our parameters is said in tables: renamed
tensors (``_CHECKPOINT_RENAMES``), projections stored fused (``_FUSED_IN_CHECKPOINT``), experts
stored stacked (``_STACKED_EXPERTS_IN_CHECKPOINT``). A quantized checkpoint's projections
(engine/quantization/) hold their tensors as published (packed words, scales per group, row or
block), a per-tensor scale repeated over its tensor's rows: each lands where its layer's float
weight's slice would, counted in its own units. Latent attention's interleaved rope rows
are reordered into halves once loaded (``LatentAttention.rope_rows_interleaved_to_halves``),
and its ``kv_b_proj`` made the absorption's matrices (``LatentAttention.absorb_in``: a
quantized one dequantized; float32 on a CPU).
Quantized routed experts are stacked as the float ones are: each expert's checkpoint tensors
land in its slice of the stacked quantized tensors, as a dense layer's would in the whole.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from engine.checkpoint_targets import Target, in_units, quantized_target
from engine.kernels.linear import PackedLinear, pack_linears
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.mla import LatentAttention
from engine.models.moe import ClampedSwigluExperts, Mxfp4ClampedSwigluExperts, RoutedExperts
from engine.models.prediction_layer import MultiTokenPredictor, prediction_layer_config
from engine.models.registry import get_model_class
from engine.models.rms_norm import RMSNorm
from engine.models.rope import RotaryEmbedding
from engine.parallel.group import TensorParallelGroup
from engine.parallel.shard import TensorParallelShard
from engine.quantization.awq_gptq import checkpoint_leaf
from engine.quantization.fp8_linear import Fp8BlockLinear
from engine.quantization.kv_cache_scheme import is_kv_scale
from engine.quantization.linear import QUANTIZED_LEAVES
from engine.quantization.mxfp4_experts import GROUP as MXFP4_GROUP
from engine.quantization.mxfp4_experts import SCALE_BIAS
from engine.quantization.packed_linear import PackedIntLinear
from engine.quantization.quantized_experts import (
    EXPERT_QUANTIZED_LEAVES,
    ExpertWeights,
    Fp8BlockExpertWeights,
    PackedIntExpertWeights,
)
from engine.quantization.w8a8_linear import W8A8Linear

LoadFormat = Literal["auto", "safetensors", "dummy"]
# what the loader fills: a model, or a checkpoint's multi-token-prediction layer
_Weighted = LlamaForCausalLM | MultiTokenPredictor
_Module = TypeVar("_Module", bound=nn.Module)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DUMMY_INIT_STD = 0.02


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: LoadFormat = "auto",
    seed: int = 0,
    linear_backend: Literal["torch", "onednn"] = "torch",
    shard: TensorParallelShard | None = None,
    group: TensorParallelGroup | None = None,
) -> LlamaForCausalLM:
    """The model in eval mode without grad, every tensor allocated once on ``device``.

    ``linear_backend="onednn"``: projections are repacked for oneDNN after loading
    (engine/kernels/linear.py); a tied logits projection gets its own packed copy.
    ``shard`` and ``group``: this rank's slice of the model and its ranks' group (None: the
    whole model on one rank; a group alone implies its rank's shard).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}")
    names_by_file, all_names = _checkpoint_names(model_dir, load_format)
    if names_by_file and not config.tie_word_embeddings and "lm_head.weight" not in all_names:
        config = dataclasses.replace(config, tie_word_embeddings=True)  # lm_head reuses embeddings
    if shard is None and group is not None:
        shard = TensorParallelShard.of(config, group.rank, group.size)
    model = _build_empty(config, dtype, torch.device(device), shard, group)
    _check_dummy_shard(load_format, config, model.shard.size)
    with torch.no_grad():
        if load_format == "dummy" and model.shard.size > 1:
            _init_dummy_sharded(model, seed, lambda: get_model_class(config.architecture)(config))
        elif load_format == "dummy":
            _init_dummy(model, seed)
        else:
            _load_safetensors(model, names_by_file, all_names)
        _finish_loading(model, dtype, dummy=load_format == "dummy")
    if linear_backend == "onednn" and model.lm_head is None:
        model.lm_head = PackedLinear(model.model.embed_tokens.weight, None)
    _pack(model, linear_backend)
    return model.eval()


def load_prediction_layer(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    load_format: LoadFormat = "auto",
    seed: int = 0,
    linear_backend: Literal["torch", "onednn"] = "torch",
    shard: TensorParallelShard | None = None,
    group: TensorParallelGroup | None = None,
) -> MultiTokenPredictor:
    """The checkpoint's first multi-token-prediction layer (engine/models/prediction_layer.py),
    loaded as ``load_model`` loads the model (random weights under load_format "dummy"): this
    rank's slice of it under ``shard`` and ``group`` (the model's; None: whole), in eval mode
    without grad."""
    config = prediction_layer_config(model_dir)
    if shard is not None:  # the model's shard, of the config that counts the layer
        shard = TensorParallelShard.of(config, shard.rank, shard.size, shard.expert_parallel)
    sharded = shard is not None and shard.size > 1
    _check_dummy_shard(load_format, config, shard.size if shard is not None else 1)
    predictor = build_empty(
        lambda: MultiTokenPredictor(config, shard, group), dtype, torch.device(device)
    )
    prefix = f"model.layers.{predictor.layer_idx}."
    names_by_file, all_names = _checkpoint_names(model_dir, load_format, prefix=prefix)
    if load_format != "dummy" and not all_names:
        raise ValueError(
            f"speculative_config.method 'mtp': config.json's num_nextn_predict_layers is "
            f"{config.num_prediction_layers}, but the checkpoint holds no {prefix}* tensors "
            "(a checkpoint saved again through transformers loses them)"
        )
    with torch.no_grad():
        if load_format == "dummy" and sharded:
            _init_dummy_sharded(predictor, seed, lambda: MultiTokenPredictor(config))
        elif load_format == "dummy":
            _init_dummy(predictor, seed)
        else:
            _load_safetensors(predictor, names_by_file, all_names)
        _finish_loading(predictor, dtype, dummy=load_format == "dummy")
    _pack(predictor, linear_backend)
    return predictor.eval()


def _check_dummy_shard(load_format: LoadFormat, config: ModelConfig, size: int) -> None:
    """Dummy weights of a quantized checkpoint are drawn on one rank only."""
    if load_format == "dummy" and config.quantization is not None and size > 1:
        raise ValueError(
            "load_format 'dummy' builds a quantized model on one rank only (tensor_parallel_size 1)"
        )


def _finish_loading(model: _Weighted, dtype: torch.dtype, dummy: bool) -> None:
    """What loaded weights need before they compute; then no grad."""
    if not dummy:
        _reorder_interleaved_rope_rows(model)
    _order_inputs_by_group(model, dummy=dummy)
    _group_rows_by_input_scale(model, dummy=dummy)
    _absorbed_up_projections(model, dtype)
    model.requires_grad_(False)


def _pack(model: _Weighted, linear_backend: Literal["torch", "onednn"]) -> None:
    """Projections repacked for oneDNN (``linear_backend`` "onednn"); nothing otherwise."""
    if linear_backend != "onednn":
        return
    pack_linears(model)
    for module in model.modules():
        if isinstance(module, (RoutedExperts, ClampedSwigluExperts)):
            module.pack_for_onednn()


def safetensors_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} "
        "(only safetensors checkpoints are supported; load_format='dummy' needs none)"
    )


def _checkpoint_names(
    model_dir: str | Path, load_format: LoadFormat, prefix: str = ""
) -> tuple[dict[Path, list[str]], set[str]]:
    """The checkpoint's tensor names that start with ``prefix``, by file, and all of them (none
    under load_format "dummy")."""
    files = [] if load_format == "dummy" else safetensors_files(Path(model_dir))
    names_by_file = {f: [n for n in _tensor_names(f) if n.startswith(prefix)] for f in files}
    return names_by_file, {name for names in names_by_file.values() for name in names}


def _tensor_names(file: Path) -> list[str]:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return list(f.keys())


def _build_empty(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: TensorParallelShard | None,
    group: TensorParallelGroup | None,
) -> LlamaForCausalLM:
    return build_empty(
        lambda: get_model_class(config.architecture)(config, shard, group), dtype, device
    )


def build_empty(
    factory: Callable[[], _Module], dtype: torch.dtype, device: torch.device
) -> _Module:
    """``factory()``'s module constructed on meta (no memory), cast there, then each tensor
    allocated once on device."""
    with torch.device("meta"):
        model = factory()
    model = model.to(dtype=dtype)
    for module in model.modules():
        if isinstance(module, (Fp8BlockLinear, W8A8Linear, Fp8BlockExpertWeights)):
            module.keep_quantized_dtypes()  # float8 weights (and block scales), not dtype
    model = model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache()  # fp32 tables, recomputed on the real device
        packed = module if isinstance(module, (PackedIntLinear, PackedIntExpertWeights)) else None
        if packed is not None and packed.g_idx is not None:
            packed.g_idx.fill_(-1)  # no input's group read yet (``_same_groups``)
    return model


def _load_targets(model: _Weighted) -> dict[str, list[Target]]:
    """Checkpoint tensor name -> where its slices go. A fused projection takes several
    checkpoint tensors, or several row ranges of one where the checkpoint stores it fused
    (``_FUSED_IN_CHECKPOINT``); a stacked experts param takes each expert's tensors into its
    slice ``param[expert]``; a quantized layer's tensors go where its float weight's slices
    would, in their own units (``quantized_target``), and a stacked quantized experts
    projection's (``...experts.gate_up_proj.weight_packed``) expert by expert, each expert's
    as its own dense layer's would (``...experts.{e}.gate_proj.weight_packed``)."""
    targets: dict[str, list[Target]] = {}
    for name, param in model.named_parameters():
        prefix, leaf = name.rsplit(".", 1)
        layer = model.get_submodule(prefix)
        if leaf in QUANTIZED_LEAVES.get(type(layer), ()):
            assert isinstance(layer, (PackedIntLinear, Fp8BlockLinear, W8A8Linear))
            placed = _quantized_targets(model, f"{prefix}.weight", leaf, layer, param)
        elif leaf in EXPERT_QUANTIZED_LEAVES.get(type(layer), ()):
            assert isinstance(layer, (PackedIntExpertWeights, Fp8BlockExpertWeights))
            experts, projection = prefix.rsplit(".", 1)
            placed = [
                found
                for held, expert in enumerate(model.shard.experts)
                for found in _quantized_targets(
                    model, f"{experts}.{expert}.{projection}.weight", leaf, layer, param[held]
                )
            ]
        else:
            placed = _targets_of(model, name, param)
        for hf_name, target in placed:
            targets.setdefault(hf_name, []).append(target)
    _add_experts_held_elsewhere(targets, model)
    return targets


_EXPERT_IN_NAME = re.compile(r"\.experts\.(\d+)\.")


def _add_experts_held_elsewhere(targets: dict[str, list[Target]], model: _Weighted) -> None:
    """Under expert parallelism, the checkpoint tensors of the experts other ranks hold, with
    nothing to load on this one: the checkpoint must have them (not missing), and they are not
    unexpected, but this rank reads none of their bytes."""
    shard, moe = model.shard, model.config.moe
    if not shard.expert_parallel or moe is None:
        return
    for name in list(targets):
        found = _EXPERT_IN_NAME.search(name)
        if found is None or int(found.group(1)) != shard.experts.start:
            continue
        for expert in range(moe.num_experts):
            if expert not in shard.experts:
                other = f"{name[: found.start()]}.experts.{expert}.{name[found.end() :]}"
                targets.setdefault(other, [])


def _quantized_targets(
    model: _Weighted,
    weight_name: str,
    leaf: str,
    layer: PackedIntLinear | Fp8BlockLinear | W8A8Linear | ExpertWeights,
    param: torch.Tensor,
) -> list[tuple[str, Target]]:
    """The checkpoint tensors a quantized layer's ``leaf`` tensor (``param``: one expert's
    slice of a stacked one) loads from, and where each lands: where the slices of its float
    weight ``weight_name`` would, in the leaf's own units."""
    float_weight = torch.empty(layer.out_features, layer.in_features, device="meta")
    stored = checkpoint_leaf(leaf, layer.weights)
    return [
        (
            f"{hf_name.removesuffix('.weight')}.{stored}",
            quantized_target(leaf, target, param, layer.weights),
        )
        for hf_name, target in _targets_of(model, weight_name, float_weight)
    ]


def _targets_of(model: _Weighted, name: str, param: torch.Tensor) -> list[tuple[str, Target]]:
    """The checkpoint tensors ``param`` (named ``name``) loads from, and where each lands."""
    config, shard = model.config, model.shard
    fused_on_disk = _FUSED_IN_CHECKPOINT.get(config.architecture, ())
    found: list[tuple[str, Target]] = []
    for hf_name, tensor, parts in _checkpoint_tensors(name, param, config, shard):
        if parts is None:
            found.append((hf_name, _single_target(hf_name, tensor, config, shard)))
            continue
        # a fused projection: its parts stacked along the rows
        stored_fused = _module(hf_name) in fused_on_disk
        total_rows = sum(full_rows for _, full_rows, _ in parts)
        row_offset = source_offset = 0
        for hf_part, full_rows, rows in parts:
            if stored_fused:  # the part's rows of the one fused checkpoint tensor
                source = hf_name
                read = range(source_offset + rows.start, source_offset + rows.stop)
                full_shape = (total_rows, *tensor.shape[1:])
            else:  # the checkpoint tensor of the part
                source = hf_name.replace(f".{_module(hf_name)}.", f".{hf_part}.")
                read, full_shape = rows, (full_rows, *tensor.shape[1:])
            found.append((source, Target(tensor, row_offset, len(rows), full_shape, read, None)))
            row_offset += len(rows)
            source_offset += full_rows
    return found


# Architectures whose checkpoints store each layer's experts stacked, as our parameters hold
# them (gpt-oss), rather than one module per expert.
_STACKED_EXPERTS_IN_CHECKPOINT = ("GptOssForCausalLM",)


# Our fused projections that an architecture's checkpoints store fused too (q, k, v rows in
# one qkv_proj; gate then up rows in one gate_up_proj), rather than as their parts.
_FUSED_IN_CHECKPOINT: dict[str, tuple[str, ...]] = {
    "Phi3ForCausalLM": ("qkv_proj", "gate_up_proj"),
}


_Parts = list[tuple[str, int, range]]  # (checkpoint projection, its rows, the rows read)


def _checkpoint_tensors(
    name: str, param: torch.Tensor, config: ModelConfig, shard: TensorParallelShard
) -> list[tuple[str, torch.Tensor, _Parts | None]]:
    """The checkpoint names a parameter loads from, as (name, the tensor it fills, the fused
    parts stacked in it or None). A routed experts param ``...experts.gate_up_proj`` [experts,
    rows, cols] loads expert e from ``...experts.{e}.gate_up_proj.weight`` into ``param[e]``
    (and the fused parts of that name); under expert parallelism ``param[i]`` is the i-th
    expert of the shard's run."""
    module_name, leaf = name.split(".")[-2:]
    if module_name != "experts":
        return [(name, param, _fused_parts(name, config, shard))]
    if config.architecture in _STACKED_EXPERTS_IN_CHECKPOINT:
        return [(name, param, None)]
    prefix = name[: -len(leaf) - 1]  # stacked: one checkpoint module per expert
    expert_names = [f"{prefix}.{expert}.{leaf}.weight" for expert in shard.experts]
    return [
        (expert_name, param[held], _fused_parts(expert_name, config, shard))
        for held, expert_name in enumerate(expert_names)
    ]


def _module(name: str) -> str:
    return name.split(".")[-2]


def _fused_parts(name: str, config: ModelConfig, shard: TensorParallelShard) -> _Parts | None:
    """The Hugging Face projections stacked in our fused projection ``name``, in row order,
    each as (name, the checkpoint tensor's rows, the rows this rank reads); None: not fused."""
    module_name = _module(name)
    if module_name == "qkv_proj":
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        kv_rows = _times(shard.kv_heads, config.head_dim)
        return [
            ("q_proj", q_size, _times(shard.q_heads, config.head_dim)),
            ("k_proj", kv_size, kv_rows),
            ("v_proj", kv_size, kv_rows),
        ]
    if module_name != "gate_up_proj":
        return None
    full, rows = _mlp_columns(name, config, shard)
    return [("gate_proj", full, rows), ("up_proj", full, rows)]


def _mlp_columns(name: str, config: ModelConfig, shard: TensorParallelShard) -> tuple[int, range]:
    """The intermediate width of the MLP ``name`` belongs to (a routed expert's, the shared
    expert's, or the dense one's), and this rank's columns of it."""
    moe = config.moe
    if ".experts." in name and moe is not None:
        return moe.expert_intermediate_size, shard.expert_intermediate
    if ".shared_expert." in name and moe is not None:
        return moe.shared_expert_intermediate_size, shard.shared_expert_intermediate
    return config.intermediate_size, shard.intermediate


def _single_target(
    name: str, param: torch.Tensor, config: ModelConfig, shard: TensorParallelShard
) -> Target:
    """Where an unfused checkpoint tensor lands: row-parallel weights read their input columns,
    the vocabulary-parallel ones their vocab rows; the rest is replicated."""
    module_name, leaf = name.split(".")[-2:]
    if module_name == "experts":  # stacked in the checkpoint: ClampedSwigluExperts' layout
        return _stacked_expert_target(leaf, param, config, shard)
    if leaf == "sinks":  # one per query head
        return Target(param, 0, param.shape[0], (config.num_heads,), shard.q_heads, None)
    if module_name in ("q_norm", "k_norm") and config.qk_norm_across_heads:  # by head
        heads = shard.q_heads if module_name == "q_norm" else shard.kv_heads
        num_heads = config.num_heads if module_name == "q_norm" else config.num_kv_heads
        rows = _times(heads, config.head_dim)
        return Target(param, 0, param.shape[0], (num_heads * config.head_dim,), rows, None)
    per_head = _latent_attention_rows_per_head(module_name, config)
    if per_head is not None:  # column-parallel by query head (latent attention)
        full_shape = (config.num_heads * per_head, param.shape[1])
        rows = _times(shard.q_heads, per_head)
        return Target(param, 0, param.shape[0], full_shape, rows, None)
    if module_name in ("o_proj", "down_proj") and leaf == "weight":
        if module_name == "o_proj":
            value_dim = config.mla.v_head_dim if config.mla is not None else config.head_dim
            full_cols, cols = config.num_heads * value_dim, _times(shard.q_heads, value_dim)
        else:
            full_cols, cols = _mlp_columns(name, config, shard)
        full_shape = (param.shape[0], full_cols)
        return Target(param, 0, param.shape[0], full_shape, range(param.shape[0]), cols)
    if module_name in ("o_proj", "down_proj"):  # the bias, added once: rank 0 holds it
        rows = range(param.shape[0]) if shard.rank == 0 else range(0)
        return Target(param, 0, param.shape[0], tuple(param.shape), rows, None)
    if module_name in ("embed_tokens", "lm_head", "head"):  # (head: a prediction layer's)
        rows = range(shard.vocab.start, min(shard.vocab.stop, config.vocab_size))
        full_shape = (config.vocab_size, param.shape[1])
        return Target(param, 0, shard.vocab_rows, full_shape, rows, None)
    whole = range(param.shape[0])  # replicated on every rank
    return Target(param, 0, param.shape[0], tuple(param.shape), whole, None)


def _stacked_expert_target(
    leaf: str, param: torch.Tensor, config: ModelConfig, shard: TensorParallelShard
) -> Target:
    """A stacked experts tensor (gpt-oss): the shard's experts (all of them unless expert
    parallel), this rank's columns of each (gate and up interleaved in gate_up_proj's last dim,
    so a rank's are one contiguous range); the down projection's bias is added once
    (``holds_expert_down_bias``). MXFP4's blocks and scales hold output rows first: gate_up's
    rank's rows, down's rank's groups of 32 inputs (dim 2)."""
    assert config.moe is not None
    width = config.moe.expert_intermediate_size
    mine = shard.expert_intermediate
    pairs = range(2 * mine.start, 2 * mine.stop)  # its gate and up columns, interleaved
    experts, held = shard.experts, param.shape[0]
    num_experts = config.moe.num_experts
    if leaf == "gate_up_proj":  # [experts, hidden, 2 x width]
        full = (num_experts, param.shape[1], 2 * width)
        return Target(param, 0, held, full, experts, None, pairs)
    if leaf == "gate_up_proj_bias":  # [experts, 2 x width]
        return Target(param, 0, held, (num_experts, 2 * width), experts, pairs)
    if leaf == "down_proj":  # [experts, width, hidden]
        full = (num_experts, width, param.shape[2])
        return Target(param, 0, held, full, experts, mine)
    if leaf == "down_proj_bias":  # added once
        rows = experts if shard.holds_expert_down_bias else range(0)
        return Target(param, 0, held, (num_experts, param.shape[1]), rows, None)
    if leaf in ("gate_up_proj_blocks", "gate_up_proj_scales"):  # [experts, 2 x width, ...]
        full = (num_experts, 2 * width, *param.shape[2:])
        return Target(param, 0, held, full, experts, pairs)
    if leaf in ("down_proj_blocks", "down_proj_scales"):  # [experts, hidden, width / 32, ...]
        full = (num_experts, param.shape[1], width // MXFP4_GROUP, *param.shape[3:])
        groups = in_units(mine, MXFP4_GROUP, "quant_method mxfp4: a scale per 32 inputs")
        return Target(param, 0, held, full, experts, None, groups)
    raise ValueError(f"no stacked expert tensor {leaf!r}")


def _latent_attention_rows_per_head(module_name: str, config: ModelConfig) -> int | None:
    """Rows per query head of a latent-attention projection that is split by head (the query's
    up projection, and the latent's up projection to keys and values); None for the others."""
    mla = config.mla
    if mla is None:
        return None
    if module_name in ("q_proj", "q_b_proj"):
        return mla.qk_head_dim
    if module_name == "kv_b_proj":
        return mla.qk_nope_head_dim + mla.v_head_dim
    return None


def _times(heads: range, head_dim: int) -> range:
    """The rows of ``heads`` in a projection of ``head_dim`` rows per head."""
    return range(heads.start * head_dim, heads.stop * head_dim)


# Checkpoint names that differ from ours, per architecture: (pattern, replacement) applied in
# order to each checkpoint tensor's name before it is matched to a parameter.
_CHECKPOINT_RENAMES: dict[str, tuple[tuple[re.Pattern[str], str], ...]] = {
    "MixtralForCausalLM": (
        (re.compile(r"\.block_sparse_moe\."), ".mlp."),
        (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
        (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
        (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
    ),
    "GptOssForCausalLM": (
        (re.compile(r"\.mlp\.router\."), ".mlp.gate."),
        (re.compile(r"\.self_attn\.sinks$"), ".self_attn.attn.sinks"),
    ),
    "DeepseekV2ForCausalLM": ((re.compile(r"\.shared_experts\."), ".shared_expert."),),
    "DeepseekV3ForCausalLM": ((re.compile(r"\.shared_experts\."), ".shared_expert."),),
    "Glm4MoeForCausalLM": ((re.compile(r"\.shared_experts\."), ".shared_expert."),),
    "MiniMaxM2ForCausalLM": (
        (re.compile(r"\.block_sparse_moe\."), ".mlp."),
        (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
        (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
        (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
        (re.compile(r"\.mlp\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    ),
}
# architectures whose checkpoints publish multi-token-prediction layers past num_hidden_layers
# (for speculative decoding; transformers skips them)
_PREDICTION_LAYERS_IN_CHECKPOINT = (
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM",
)


def _our_name(name: str, config: ModelConfig) -> str:
    """A checkpoint tensor's name as our parameters spell it (``_CHECKPOINT_RENAMES``)."""
    for pattern, replacement in _CHECKPOINT_RENAMES.get(config.architecture, ()):
        name = pattern.sub(replacement, name)
    return name


_BEYOND_THE_LAYERS = re.compile(r"model\.layers\.(\d+)\.")


def _is_ignored(name: str, config: ModelConfig) -> bool:
    """Checkpoint tensors we know and do not need."""
    if name.endswith("rotary_emb.inv_freq"):
        return True  # older checkpoints store the rope buffer; we recompute it
    if is_kv_scale(name):
        return True  # a quantized KV cache's, read by engine/quantization/kv_cache_scheme.py
    if config.quantization is not None and name.endswith(".weight_shape"):
        return True  # a packed layer's [out, in]: its packed tensors' shapes are checked
    layer = _BEYOND_THE_LAYERS.match(name)
    if (
        layer is not None
        and config.architecture in _PREDICTION_LAYERS_IN_CHECKPOINT
        and int(layer[1]) >= config.num_layers
    ):
        return True  # a multi-token-prediction layer, skipped as transformers does
    return name == "lm_head.weight" and config.tie_word_embeddings


def _load_safetensors(
    model: _Weighted, names_by_file: dict[Path, list[str]], all_names: set[str]
) -> None:
    targets = _load_targets(model)
    config = model.config
    ours = {name: _our_name(name, config) for name in all_names}
    unexpected = sorted(
        n for n, our in ours.items() if our not in targets and not _is_ignored(our, config)
    )
    missing = sorted(set(targets) - set(ours.values()))
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match {model.config.architecture}: "
            f"missing tensors {missing}, unexpected tensors {unexpected}"
        )
    for file, names in names_by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                for target in targets.get(ours[name], ()):
                    if target.is_whole():
                        tensor = f.get_tensor(name)
                        _check_shape(name, file, tuple(tensor.shape), target)
                        _copy(tensor, target)
                        continue
                    tensor_slice = f.get_slice(name)
                    _check_shape(name, file, tuple(tensor_slice.get_shape()), target)
                    _copy(tensor_slice[target.index()] if target.rows else None, target)


def _reorder_interleaved_rope_rows(model: _Weighted) -> None:
    """Latent attention checkpoints whose rotary dims come in interleaved pairs get those rows
    in halves, the layout the engine's rope turns (``LatentAttention``)."""
    mla = model.config.mla
    if mla is None or not mla.rope_interleaved:
        return
    for module in model.modules():
        if isinstance(module, LatentAttention):
            module.rope_rows_interleaved_to_halves()


def _check_shape(name: str, file: Path, shape: tuple[int, ...], target: Target) -> None:
    if shape != target.full_shape:
        raise ValueError(f"{name} in {file.name} has shape {shape}, expected {target.full_shape}")


def _copy(part: torch.Tensor | None, target: Target) -> None:
    """Copies the slice read (None: nothing), converted where the target says, into its rows;
    zeros the rest of them."""
    if part is not None and target.convert is not None:
        part = target.convert(part)
    num_read = 0 if part is None else part.shape[0]
    start, end = target.row_offset, target.row_offset + target.num_rows
    if part is not None:
        target.param[start : start + num_read].copy_(part)
    if start + num_read < end:
        target.param[start + num_read : end].zero_()


def _order_inputs_by_group(model: _Weighted, dummy: bool) -> None:
    """GPTQ layers' inputs sorted by the group their g_idx gives each, where it is not input
    order (``PackedIntLinear.order_inputs_by_group``); GPTQ experts' g_idx checked to be in
    input order and dropped; dummy weights' inputs stay in order."""
    for module in model.modules():
        if isinstance(module, PackedIntLinear) and module.g_idx is not None:
            module.order_inputs_by_group(keep_in_order=dummy)
        if isinstance(module, PackedIntExpertWeights) and module.g_idx is not None:
            module.drop_groups_in_input_order(dummy=dummy)


def _absorbed_up_projections(model: _Weighted, dtype: torch.dtype) -> None:
    """Latent attention's ``kv_b_proj``, loaded, becomes the float matrices the absorption
    multiplies by (``LatentAttention.absorb_in``; a quantized one dequantized): in ``dtype``,
    but float32 on a CPU, whose bfloat16 and float16 batched matmuls of these shapes took 5-15x
    float32's time (4 heads of 128 x 512 at batch 1: 100-435 us against 14-30 us); the
    matrices are a small part of a layer's weights."""
    device = next(model.parameters()).device
    absorbed = torch.float32 if device.type == "cpu" else dtype
    for module in model.modules():
        if isinstance(module, LatentAttention):
            module.absorb_in(absorbed)


DUMMY_INPUT_SCALE = 1.0 / 64  # a dummy 8-bit layer's static input scale: any positive one


def _group_rows_by_input_scale(model: _Weighted, dummy: bool) -> None:
    """Static-input 8-bit layers find their rows that share an input scale
    (``W8A8Linear.group_rows_by_input_scale``); dummy ones get one positive scale each."""
    for module in model.modules():
        if isinstance(module, W8A8Linear) and module.input_scale is not None:
            if dummy:
                module.input_scale.fill_(DUMMY_INPUT_SCALE)
            module.group_rows_by_input_scale()


def _init_dummy(model: _Weighted, seed: int) -> None:
    """Normal(0, 0.02) weights from a seeded generator; norms that scale by 1."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    norm_weights = _unit_norm_weights(model)
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(norm_weights[id(param)])
        elif not param.is_floating_point():  # packed integer weights: any bits
            param.random_(generator=generator)
        elif param.dtype not in SUPPORTED_DTYPES:  # float8 weights: drawn in float32
            drawn = torch.empty(param.shape, device=device)
            param.copy_(drawn.normal_(0.0, DUMMY_INIT_STD, generator=generator))
        else:
            param.normal_(0.0, DUMMY_INIT_STD, generator=generator)
    for module in model.modules():  # MXFP4 experts: weights of at most 6 x 2^-8 (~0.02)
        if isinstance(module, Mxfp4ClampedSwigluExperts):
            for scales in (module.gate_up_proj_scales, module.down_proj_scales):
                scales.random_(SCALE_BIAS - 10, SCALE_BIAS - 7, generator=generator)


def _unit_norm_weights(model: _Weighted) -> dict[int, float]:
    """id of each norm's weight -> the value that makes the norm scale by 1 (1, or 0 where it
    scales by 1 + weight)."""
    return {id(m.weight): 1.0 - m.offset for m in model.modules() if isinstance(m, RMSNorm)}


def _init_dummy_sharded(model: _Weighted, seed: int, build_whole: Callable[[], _Weighted]) -> None:
    """This rank's slices of the one-rank dummy model (``build_whole``'s): each of its tensors
    is drawn whole, in the one-rank model's order from the same generator, and sliced as a
    checkpoint would be. A row-parallel bias is zeros off rank 0 (rank 0's holds all of it)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        whole = build_whole().to(dtype=dtype)
    norm_weights = _unit_norm_weights(whole)
    targets = _load_targets(model)
    for name, meta_param in whole.named_parameters():
        tensor = torch.empty(meta_param.shape, dtype=meta_param.dtype, device=device)
        if id(meta_param) in norm_weights:
            tensor.fill_(norm_weights[id(meta_param)])
        else:
            tensor.normal_(0.0, DUMMY_INIT_STD, generator=generator)
        for part_name, part in _checkpoint_parts(name, tensor, model.config):
            for target in targets[part_name]:  # (none: an expert another rank holds)
                _copy(part[target.index()] if target.rows else None, target)


def _checkpoint_parts(
    name: str, tensor: torch.Tensor, config: ModelConfig
) -> list[tuple[str, torch.Tensor]]:
    """A one-rank parameter as the checkpoint tensors it is fused (or stacked) from."""
    whole = TensorParallelShard.whole(config)
    fused_on_disk = _FUSED_IN_CHECKPOINT.get(config.architecture, ())
    pieces: list[tuple[str, torch.Tensor]] = []
    for hf_name, part, parts in _checkpoint_tensors(name, tensor, config, whole):
        if parts is None or _module(hf_name) in fused_on_disk:
            pieces.append((hf_name, part))
            continue
        module_name = _module(hf_name)
        split = part.split([full_rows for _, full_rows, _ in parts])
        pieces.extend(
            (hf_name.replace(f".{module_name}.", f".{hf_part}."), piece)
            for (hf_part, _, _), piece in zip(parts, split, strict=True)
        )
    return pieces
