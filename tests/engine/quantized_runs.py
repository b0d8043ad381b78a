"""What the quantized-checkpoint tests run: one set of prompts, greedy and past any eos, through
the engine and through a transformers model loaded from the same files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams

PROMPTS = [[5, 77, 301, 12, 950, 40], list(range(3, 40)), [9] * 20, list(range(500, 380, -3))]
NUM_TOKENS = 12


def quantized_llm(model_dir: Path, **options: Any) -> LLM:
    """The offline engine on CPU, float32 unless ``options`` say otherwise."""
    options.setdefault("dtype", "float32")
    return LLM(str(model_dir), device="cpu", skip_tokenizer_init=True, **options)


def engine_greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def transformers_greedy(model: torch.nn.Module) -> list[list[int]]:
    """``model``'s greedy ``NUM_TOKENS`` after each prompt, eos or not: no eos stops it, and
    none is kept from being picked (as ``min_new_tokens`` would), as the engine's ignore_eos."""
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NUM_TOKENS,
                eos_token_id=None,
                do_sample=False,
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def projection_bytes(llm: LLM) -> int:
    """Bytes of the decoder's projections as ``llm``'s model holds them."""
    return sum(
        p.numel() * p.element_size()
        for name, p in llm.engine.model.named_parameters()
        if name.split(".")[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    )


def set_fields(config: dict[str, Any], changes: dict[str, Any]) -> None:
    """Set each dotted path of ``changes`` (``"weights.num_bits"``) in ``config``, in place."""
    for path, value in changes.items():
        node: Any = config
        *parents, leaf = path.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value


_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def assert_dequantized_exactly(llm: LLM, float_dir: Path) -> int:
    """Asserts that each packed projection of ``llm``'s model dequantizes to the float weight
    ``float_dir``'s checkpoint holds for it (its fused parts stacked), bit for bit; returns how
    many it compared."""
    from safetensors.torch import load_file

    from engine.quantization.packed_linear import PackedIntLinear

    expected = load_file(str(float_dir / "model.safetensors"))
    compared = 0
    for name, layer in llm.engine.model.named_modules():
        if not isinstance(layer, PackedIntLinear):
            continue
        prefix, projection = name.rsplit(".", 1)
        parts = _FUSED_PARTS.get(projection, (projection,))
        weight = torch.cat([expected[f"{prefix}.{part}.weight"] for part in parts])
        assert torch.equal(layer.dequantized_weight().float(), weight), name
        compared += 1
    return compared
