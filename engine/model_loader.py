"""Builds a model on the meta device, materialises it once on the target device, fills weights.

Weights come from a Hugging Face safetensors checkpoint (single file or sharded via
``model.safetensors.index.json``) or, with ``load_format="dummy"``, from a seeded random
init so big shapes can be benchmarked without a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from engine.kernels.linear import PackedLinear, pack_linears
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM, RMSNorm
from engine.models.registry import get_model_class
from engine.models.rope import RotaryEmbedding

LoadFormat = Literal["auto", "safetensors", "dummy"]
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DUMMY_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    param: torch.Tensor  # the parameter a checkpoint tensor lands in
    row_offset: int  # first row of its slice (fused projections stack along dim 0)
    num_rows: int


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: LoadFormat = "auto",
    seed: int = 0,
    linear_backend: Literal["torch", "onednn"] = "torch",
) -> LlamaForCausalLM:
    """The model in eval mode without grad, every tensor allocated once on ``device``.

    ``linear_backend="onednn"``: projections are repacked for oneDNN after loading
    (engine/kernels/linear.py); a tied logits projection gets its own packed copy.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}")
    files = [] if load_format == "dummy" else safetensors_files(Path(model_dir))
    names_by_file = {file: _tensor_names(file) for file in files}
    all_names = {name for names in names_by_file.values() for name in names}
    if files and not config.tie_word_embeddings and "lm_head.weight" not in all_names:
        config = dataclasses.replace(config, tie_word_embeddings=True)  # lm_head reuses embeddings
    model = _build_empty(config, dtype, torch.device(device))
    with torch.no_grad():
        if load_format == "dummy":
            _init_dummy(model, seed)
        else:
            _load_safetensors(model, names_by_file, all_names)
    model.requires_grad_(False)
    if linear_backend == "onednn":
        if model.lm_head is None:
            model.lm_head = PackedLinear(model.model.embed_tokens.weight, None)
        pack_linears(model)
    return model.eval()


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


def _tensor_names(file: Path) -> list[str]:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return list(f.keys())


def _build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Construct on meta (no memory), cast there, then allocate each tensor once on device."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache()  # fp32 tables, recomputed on the real device
    return model


def _load_targets(model: LlamaForCausalLM) -> dict[str, _Target]:
    """Checkpoint tensor name -> where it goes. Fused params take several checkpoint tensors."""
    config = model.config
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    # our fused projection -> the Hugging Face projections stacked in it, in row order
    fused_parts = {
        "qkv_proj": [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)],
        "gate_up_proj": [
            ("gate_proj", config.intermediate_size),
            ("up_proj", config.intermediate_size),
        ],
    }
    targets: dict[str, _Target] = {}
    for name, param in model.named_parameters():
        module_name = name.split(".")[-2]
        if module_name not in fused_parts:
            targets[name] = _Target(param, 0, param.shape[0])
            continue
        row_offset = 0
        for hf_part, num_rows in fused_parts[module_name]:
            hf_name = name.replace(f".{module_name}.", f".{hf_part}.")
            targets[hf_name] = _Target(param, row_offset, num_rows)
            row_offset += num_rows
    return targets


def _is_ignored(name: str, config: ModelConfig) -> bool:
    """Checkpoint tensors we know and do not need."""
    if name.endswith("rotary_emb.inv_freq"):
        return True  # older checkpoints store the rope buffer; we recompute it
    return name == "lm_head.weight" and config.tie_word_embeddings


def _load_safetensors(
    model: LlamaForCausalLM, names_by_file: dict[Path, list[str]], all_names: set[str]
) -> None:
    targets = _load_targets(model)
    unexpected = sorted(
        n for n in all_names if n not in targets and not _is_ignored(n, model.config)
    )
    missing = sorted(set(targets) - all_names)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match {model.config.architecture}: "
            f"missing tensors {missing}, unexpected tensors {unexpected}"
        )
    for file, names in names_by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                target = targets.get(name)
                if target is None:
                    continue
                tensor = f.get_tensor(name)
                expected = (target.num_rows, *target.param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"{name} in {file.name} has shape {tuple(tensor.shape)}, expected {expected}"
                    )
                target.param[target.row_offset : target.row_offset + target.num_rows].copy_(tensor)


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) weights from a seeded generator; norm weights 1."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        else:
            param.normal_(0.0, DUMMY_INIT_STD, generator=generator)
