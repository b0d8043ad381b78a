"""Which entries of a quantization_config's lists of unquantized modules (compressed-tensors'
``ignore``, fp8's ``modules_to_not_convert`` / ``ignored_layers``, AWQ's and GPTQ's
``modules_to_not_convert``) name a mixture-of-experts model's router gates, which stay float.

What the tools write: llm-compressor ``ignore: ["lm_head", "re:.*mlp.gate$"]`` (the recipe's
pattern), or each layer's gate by name (``model.layers.3.mlp.gate``: what compressed-tensors
saves when it lists the modules it left alone); Mixtral's ``re:.*block_sparse_moe.gate``;
Qwen2-MoE's shared expert gate (``re:.*mlp.shared_expert_gate$``, a [1, hidden] layer); Qwen's
FP8 releases each layer's ``model.layers.N.mlp.gate``; AutoAWQ's Mixtral ``["gate"]``.

An entry names the gates when it matches a gate's name and no projection's that the engine
runs quantized: a pattern (``re:``, matched from the start of a name as compressed-tensors
matches) is tried on such names; a plain name must be a gate's, whole or by its last parts.
"""

from __future__ import annotations

import re
from typing import Any

# one layer's gate modules, as checkpoints name them
_GATES = (
    "model.layers.0.mlp.gate",
    "model.layers.0.block_sparse_moe.gate",
    "model.layers.0.mlp.shared_expert_gate",
)
# one layer's projections that hold quantized weights, as checkpoints name them
_PROJECTIONS = tuple(
    f"model.layers.0.{module}"
    for module in (
        *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(f"self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")),
        *(f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
        *(f"mlp.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
        *(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
        *(f"mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
        *(f"block_sparse_moe.experts.0.{p}" for p in ("w1", "w2", "w3")),
    )
)
_GATE_NAME = re.compile(
    r"(?:(?:model\.)?layers\.\d+\.)?(?:(?:mlp|block_sparse_moe)\.)?(?:gate|shared_expert_gate)"
)


def names_router_gates(entry: str) -> bool:
    """Whether ``entry`` of an unquantized-modules list names router gates (or a shared
    expert's gate) and no quantized projection."""
    if entry.startswith("re:"):
        try:
            pattern = re.compile(entry.removeprefix("re:"))
        except re.error:
            return False
        return any(pattern.match(name) for name in _GATES) and not any(
            pattern.match(name) for name in _PROJECTIONS
        )
    return _GATE_NAME.fullmatch(entry) is not None


def names_the_lm_head(entry: str) -> bool:
    return entry == "lm_head" or entry.endswith(".lm_head")


def gates_named(entries: list[str]) -> frozenset[str]:
    """The kinds of gate the router-gate entries among ``entries`` name: "gate" (routers) and
    "shared_expert_gate"."""
    named: set[str] = set()
    for entry in entries:
        if not names_router_gates(entry):
            continue
        if not entry.startswith("re:"):
            named.add(entry.rsplit(".", 1)[-1])
            continue
        pattern = re.compile(entry.removeprefix("re:"))
        named.update(name.rsplit(".", 1)[-1] for name in _GATES if pattern.match(name))
    return frozenset(named)


def require_gates_ignored(ignore: list[Any], gated_shared_expert: bool, unsupported: str) -> None:
    """compressed-tensors quantizes every linear layer its ``ignore`` does not name, so that
    of a mixture-of-experts model names the router gates (and a gated shared expert's gate),
    which stay float; raises ValueError, ``unsupported`` first, where it does not."""
    named = gates_named([str(entry) for entry in ignore])
    needed = ["gate", "shared_expert_gate"] if gated_shared_expert else ["gate"]
    missing = [gate for gate in needed if gate not in named]
    if missing:
        raise ValueError(
            f"{unsupported} with quantization_config.ignore {ignore!r}: its "
            f"{' and '.join(missing)} layers stay float, so the ignore list must name them "
            f"(e.g. {', '.join(repr(f're:.*mlp.{gate}$') for gate in missing)})"
        )
