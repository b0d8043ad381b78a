"""A checkpoint's ``quantization_config``, read into what the engine runs, or refused at load
naming the field.

Supported:
- compressed-tensors' "pack-quantized" weight-only schemes (what llm-compressor writes for
  W4A16 and W8A16): every linear layer of the decoder but the LM head holds signed 4- or 8-bit
  integers packed eight (or four) to an int32 along its input dimension, a float scale per
  group of ``group_size`` inputs of each output row (or one per row), and, where asymmetric,
  an integer zero point per group;
- compressed-tensors' 8-bit "int-quantized" and "float-quantized" schemes (W8A8, FP8_DYNAMIC,
  FP8): int8 or float8 e4m3 weights with a scale per output row ("channel") or one per weight
  tensor ("tensor"), inputs quantized symmetrically to the same type per token on the fly
  (``dynamic: true``, "token") or with a static ``input_scale`` per layer (``dynamic: false``,
  "tensor");
- AWQ (``quant_method: awq``, version "gemm", 4 bits, zero points) and GPTQ (``quant_method:
  gptq``, 4 or 8 bits, checkpoint_format "gptq" or "gptq_v2", in order or in activation
  order): the same integers, scales and zero points in their own layouts, converted into the
  one above as they are read (engine/quantization/awq_gptq.py);
- block-wise FP8 (``quant_method: fp8``, DeepSeek-V3's and Qwen3's FP8 checkpoints): every
  linear layer's weight in float8 e4m3 with a float32 scale per 128 x 128 block
  (``weight_scale_inv``, multiplied despite its name); activations quantized per token group
  on the fly by the GPU kernels (``activation_scheme: dynamic``), not on CPU, as transformers;
- MXFP4 (``quant_method: mxfp4``, gpt-oss as OpenAI publishes it): the routed experts' weights
  in 4-bit e2m1 floats, two to a byte, with a power-of-two scale (an e8m0 byte) per 32 inputs;
  every other layer (attention, router, embeddings, LM head) float
  (engine/quantization/mxfp4_experts.py).
The layouts, as published, are in docs/quantized-checkpoints.md. A ``kv_cache_scheme`` (the
scales of a quantized KV cache) is read by engine/quantization/kv_cache_scheme.py. Everything
else (compressed-tensors' other activation schemes: asymmetric, per group, dynamic per
tensor; AWQ's other versions, GPTQ's other formats) is refused here, before any weight is read.
The LM head alone may stay unquantized, and a mixture-of-experts model's router gates, which
the lists of unquantized modules then name (engine/quantization/router_gates.py); what the
model's layers can hold of the rest is checked by engine/model_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.quantization.router_gates import names_router_gates, names_the_lm_head

_FIELD = "quantization_config"


@dataclass(frozen=True, slots=True)
class PackedIntWeights:
    """Integer weights packed into int32 words along the input dimension (compressed-tensors'
    pack-quantized format), or read into that layout from AWQ's or GPTQ's."""

    num_bits: int  # 4 or 8: the integers' width
    group_size: int | None  # inputs sharing one scale (and zero point); None: one per row
    symmetric: bool  # False: each group has an integer zero point too
    method: str = "compressed-tensors"  # the checkpoint's layout: or "awq" (GEMM), "gptq"
    zeros_minus_one: bool = False  # GPTQ's "gptq" (v1) format: zero points stored minus one
    act_order: bool = False  # GPTQ's desc_act: groups of inputs in activation order (g_idx)

    @property
    def pack_factor(self) -> int:
        """Integers in one int32 word."""
        return 32 // self.num_bits

    @property
    def has_zero_points(self) -> bool:
        """Whether the layer holds a zero point per group: asymmetric, or GPTQ's (whose
        checkpoints store them either way)."""
        return not self.symmetric or self.method == "gptq"

    @property
    def stored_bits_per_weight(self) -> float:
        """Bits a weight takes in memory, its group's 16-bit scale (and zero point) shared in:
        what a capacity plan counts (router/planner/model_costs.py). Per-row scales (no group)
        are left out: one per input row of thousands."""
        if self.group_size is None:
            return float(self.num_bits)
        shared = 16 + (self.num_bits if self.has_zero_points else 0)
        return self.num_bits + shared / self.group_size

    def describe(self) -> str:
        """E.g. ``compressed-tensors w4a16 (group 128, asymmetric)``."""
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        order = ", activation order" if self.act_order else ""
        return f"{self.method} w{self.num_bits}a16 ({group}, {kind}{order})"


@dataclass(frozen=True, slots=True)
class Fp8BlockWeights:
    """Float8 e4m3 weights with a float32 scale per block of ``block_rows`` x ``block_cols``
    (``quant_method: fp8``)."""

    block_rows: int  # output features a scale covers
    block_cols: int  # input features a scale covers
    method: str = "fp8"

    @property
    def stored_bits_per_weight(self) -> float:
        """8 bits, and the block's float32 scale shared in."""
        return 8 + 32 / (self.block_rows * self.block_cols)

    def describe(self) -> str:
        """E.g. ``fp8 e4m3 (blocks of 128 x 128)``."""
        return f"{self.method} e4m3 (blocks of {self.block_rows} x {self.block_cols})"


@dataclass(frozen=True, slots=True)
class W8A8Weights:
    """8-bit weights, int8 or float8 e4m3, with a float scale per output row or one per weight
    tensor; the inputs quantized to the same type per token as they arrive, or with one static
    scale per layer (compressed-tensors' "int-quantized" and "float-quantized": W8A8, FP8_DYNAMIC,
    FP8)."""

    kind: str  # "int": int8; "float": float8 e4m3
    weight_strategy: str = "channel"  # "channel": a scale per output row; "tensor": one
    static_inputs: bool = False  # True: an ``input_scale`` per layer; False: per token
    method: str = "compressed-tensors"

    @property
    def stored_bits_per_weight(self) -> float:
        """8 bits (a scale per row or per tensor is left out: one per thousands)."""
        return 8.0

    def describe(self) -> str:
        """E.g. ``compressed-tensors w8a8 int8 (per channel, dynamic per-token inputs)``."""
        element = "int8" if self.kind == "int" else "fp8 e4m3"
        weights = "per channel" if self.weight_strategy == "channel" else "per tensor"
        inputs = "static per-tensor" if self.static_inputs else "dynamic per-token"
        return f"{self.method} w8a8 {element} ({weights}, {inputs} inputs)"


@dataclass(frozen=True, slots=True)
class Mxfp4ExpertWeights:
    """gpt-oss's routed experts in MXFP4 (``quant_method: mxfp4``); its other layers float."""

    method: str = "mxfp4"
    group_size: int = 32  # inputs of an output row sharing one power-of-two scale

    @property
    def stored_bits_per_weight(self) -> float:
        """4 bits, and the group's 8-bit scale shared over its 32 weights (the experts' alone)."""
        return 4 + 8 / self.group_size

    @property
    def experts_only(self) -> bool:
        """Whether only the routed experts hold quantized weights (the rest float)."""
        return True

    def describe(self) -> str:
        return "mxfp4 experts (e2m1, a power-of-two scale per 32)"


WeightQuantization = PackedIntWeights | Fp8BlockWeights | W8A8Weights | Mxfp4ExpertWeights


def parse_quantization_config(raw: Any, experts: bool = False) -> WeightQuantization:
    """The weight quantization a config.json's ``quantization_config`` describes; raises
    ValueError naming the field (``quantization_config.<path>``) of anything not supported.
    ``experts``: the model routes tokens to experts, so its lists of unquantized modules may
    name the router gates too (they stay float)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{_FIELD} must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "fp8":
        return _fp8_blocks(raw, experts)
    if method == "awq":
        return _awq(raw, experts)
    if method == "gptq":
        return _gptq(raw, experts)
    if method == "mxfp4":
        return _mxfp4(raw)
    if method != "compressed-tensors":
        raise ValueError(
            f"{_FIELD}.quant_method {method!r} is not supported; supported: "
            "'compressed-tensors' (pack-quantized W4A16 / W8A16, W8A8), 'awq', 'gptq', "
            "'fp8' (block-wise), 'mxfp4' (gpt-oss's experts)"
        )
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(
            f"{_FIELD}.quantization_status {status!r} is not supported; only 'compressed' "
            "(weights saved packed)"
        )
    _require_absent(raw, "sparsity_config", "sparse weights")
    _require_absent(raw, "transform_config", "weight transforms")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(
            f"{_FIELD}.config_groups must hold exactly one group (one scheme for every linear "
            f"layer), got {groups!r}"
        )
    ((name, group),) = groups.items()
    path = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise ValueError(f"{_FIELD}.{path} must be an object, got {group!r}")
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise ValueError(f"{_FIELD}.{path}.targets {targets!r} is not supported; only ['Linear']")
    if group.get("output_activations") is not None:
        raise ValueError(
            f"{_FIELD}.{path}.output_activations is set: output quantization is not supported"
        )
    ignore = list(raw.get("ignore") or [])
    if "lm_head" not in ignore or not _only_unconverted(ignore, experts, lm_head="lm_head"):
        raise ValueError(
            f"{_FIELD}.ignore {ignore!r} is not supported; only ['lm_head'] (every decoder "
            "linear layer quantized alike), and a mixture-of-experts model's router gates "
            "(e.g. 're:.*mlp.gate$')"
        )
    fmt = group.get("format") or raw.get("format")
    if fmt in _W8A8_FORMATS:
        return _w8a8(group, fmt, path)
    if group.get("input_activations") is not None:
        raise ValueError(
            f"{_FIELD}.{path}.input_activations is set with format {fmt!r}: activations are "
            f"quantized only with an int-quantized or float-quantized 8-bit scheme (W8A8)"
        )
    if fmt != "pack-quantized":
        raise ValueError(
            f"{_FIELD}.{path}.format {fmt!r} is not supported; 'pack-quantized', "
            "'int-quantized' or 'float-quantized'"
        )
    return _weights(group.get("weights"), f"{path}.weights")


_W8A8_FORMATS = {"int-quantized": "int", "float-quantized": "float"}


def _w8a8(group: dict[str, Any], fmt: str, path: str) -> W8A8Weights:
    """An 8-bit scheme: int8 or float8 weights with a scale per output row or per tensor,
    activations quantized per token on the fly or with a static scale per tensor (what
    llm-compressor's W8A8, FP8_DYNAMIC and FP8 write)."""
    kind = _W8A8_FORMATS[fmt]
    weights = group.get("weights")
    _require_fields(weights, {"type": kind, "num_bits": 8, "symmetric": True}, f"{path}.weights")
    assert isinstance(weights, dict)
    weight_strategy = _one_of(weights, "strategy", ("channel", "tensor"), f"{path}.weights")
    if weights.get("dynamic"):
        raise ValueError(f"{_FIELD}.{path}.weights.dynamic true is not supported for weights")
    activations = group.get("input_activations")
    inputs = f"{path}.input_activations"
    _require_fields(activations, {"type": kind, "num_bits": 8}, inputs)
    assert isinstance(activations, dict)
    dynamic = activations.get("dynamic")
    if dynamic not in (True, False):
        raise ValueError(
            f"{_FIELD}.{inputs}.dynamic {dynamic!r} is not supported; true (per token) or "
            "false (a static input_scale per layer)"
        )
    _require_fields(activations, {"strategy": "token" if dynamic else "tensor"}, inputs)
    if activations.get("symmetric", True) is not True:
        raise ValueError(
            f"{_FIELD}.{inputs}.symmetric {activations.get('symmetric')!r} is not supported; "
            "True (asymmetric inputs, with an input zero point, are not)"
        )
    return W8A8Weights(kind, weight_strategy, static_inputs=not dynamic)


def _one_of(args: dict[str, Any], key: str, supported: tuple[str, ...], path: str) -> str:
    value = args.get(key)
    if value not in supported:
        raise ValueError(
            f"{_FIELD}.{path}.{key} {value!r} is not supported here; one of {list(supported)!r}"
        )
    return str(value)


def _require_fields(args: Any, expected: dict[str, Any], path: str) -> None:
    if not isinstance(args, dict):
        raise ValueError(f"{_FIELD}.{path} must be an object, got {args!r}")
    for key, value in expected.items():
        if args.get(key, True if key == "symmetric" else None) != value:
            raise ValueError(
                f"{_FIELD}.{path}.{key} {args.get(key)!r} is not supported here; {value!r}"
            )


def _weights(args: Any, path: str) -> PackedIntWeights:
    if not isinstance(args, dict):
        raise ValueError(f"{_FIELD}.{path} must be an object, got {args!r}")
    kind = args.get("type")
    if kind != "int":
        raise ValueError(f"{_FIELD}.{path}.type {kind!r} is not supported; only 'int'")
    num_bits = args.get("num_bits")
    if num_bits not in (4, 8):
        raise ValueError(f"{_FIELD}.{path}.num_bits {num_bits!r} is not supported; 4 or 8")
    if args.get("dynamic"):
        raise ValueError(f"{_FIELD}.{path}.dynamic true is not supported for weights")
    if args.get("actorder") is not None:
        raise ValueError(
            f"{_FIELD}.{path}.actorder {args.get('actorder')!r} is not supported (groups in "
            "activation order); only null"
        )
    if args.get("block_structure") is not None:
        raise ValueError(f"{_FIELD}.{path}.block_structure is not supported for int weights")
    strategy = args.get("strategy")
    group_size = args.get("group_size")
    if strategy == "channel":
        group_size = None
    elif strategy == "group":
        if type(group_size) is not int or group_size < 1:
            raise ValueError(
                f"{_FIELD}.{path}.group_size {group_size!r} must be a positive int for "
                "strategy 'group'"
            )
    else:
        raise ValueError(
            f"{_FIELD}.{path}.strategy {strategy!r} is not supported; 'group' or 'channel'"
        )
    symmetric = args.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"{_FIELD}.{path}.symmetric must be true or false, got {symmetric!r}")
    return PackedIntWeights(num_bits, group_size, symmetric)


def _mxfp4(raw: dict[str, Any]) -> Mxfp4ExpertWeights:
    """gpt-oss's MXFP4 experts: its ``modules_to_not_convert`` may name any layer but them."""
    skipped = raw.get("modules_to_not_convert") or []
    if not isinstance(skipped, list):
        raise ValueError(f"{_FIELD}.modules_to_not_convert must be a list, got {skipped!r}")
    experts = [entry for entry in skipped if "experts" in str(entry)]
    if experts:
        raise ValueError(
            f"{_FIELD}.modules_to_not_convert names the experts ({experts}): MXFP4 is supported "
            "for quantized experts only (the other layers float)"
        )
    return Mxfp4ExpertWeights()


def _require_absent(raw: dict[str, Any], key: str, what: str) -> None:
    if raw.get(key):
        raise ValueError(f"{_FIELD}.{key} is set: {what} is not supported yet")


def _fp8_blocks(raw: dict[str, Any], experts: bool) -> Fp8BlockWeights:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{_FIELD}.fmt {fmt!r} is not supported; only 'e4m3'")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{_FIELD}.activation_scheme {scheme!r} is not supported; only 'dynamic'")
    block = raw.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(type(size) is int and size > 0 for size in block)
    ):
        raise ValueError(
            f"{_FIELD}.weight_block_size {block!r} is not supported; [rows, cols] of positive "
            "ints (per-tensor FP8 is not supported yet)"
        )
    for key in ("modules_to_not_convert", "ignored_layers"):
        skipped = raw.get(key) or []
        if not _only_unconverted(skipped, experts):
            raise ValueError(
                f"{_FIELD}.{key} {skipped!r} is not supported; only the LM head (and a "
                "mixture-of-experts model's router gates) may stay unconverted"
            )
    if raw.get("modules_to_convert"):
        raise ValueError(f"{_FIELD}.modules_to_convert is not supported; every linear layer")
    return Fp8BlockWeights(int(block[0]), int(block[1]))


_AWQ = f"{_FIELD}.quant_method 'awq'"
_GPTQ = f"{_FIELD}.quant_method 'gptq'"


def _awq(raw: dict[str, Any], experts: bool) -> PackedIntWeights:
    """AWQ's GEMM layout (AutoAWQ, GPTQModel): 4-bit integers with a scale and a zero point per
    group. ``version`` names the layout (``format`` where it is absent, as transformers reads
    it); the others (gemv, exllama, marlin ...) pack the words otherwise."""
    key = "version" if raw.get("version") is not None else "format"
    version = raw.get(key) or "gemm"
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ValueError(f"{_FIELD}.{key} {version!r} is not supported with {_AWQ}; only 'gemm'")
    bits = _first_of(raw, "bits", "w_bit")
    if bits != 4:
        raise ValueError(f"{_FIELD}.bits {bits!r} is not supported with {_AWQ}; only 4")
    zero_point = raw.get("zero_point", True)
    if zero_point is not True:
        raise ValueError(
            f"{_FIELD}.zero_point {zero_point!r} is not supported with {_AWQ}; only true (a "
            "zero point per group, as the GEMM layout stores)"
        )
    group_size = _group_size(_first_of(raw, "group_size", "q_group_size"))
    _only_the_lm_head_unconverted(raw, experts)
    return PackedIntWeights(4, group_size, symmetric=False, method="awq")


_GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}  # format -> zero points stored minus one


def _gptq(raw: dict[str, Any], experts: bool) -> PackedIntWeights:
    """GPTQ (AutoGPTQ, GPTQModel, optimum): 4- or 8-bit integers packed along the inputs, a
    scale and a zero point per group, ``g_idx`` naming each input's group. Its format is
    ``checkpoint_format`` (``format`` where it is absent, as transformers reads it)."""
    key = "checkpoint_format" if raw.get("checkpoint_format") is not None else "format"
    fmt = raw.get(key) or "gptq"
    if not isinstance(fmt, str) or fmt.lower() not in _GPTQ_FORMATS:
        raise ValueError(
            f"{_FIELD}.{key} {fmt!r} is not supported with {_GPTQ}; 'gptq' or 'gptq_v2'"
        )
    bits = raw.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"{_FIELD}.bits {bits!r} is not supported with {_GPTQ}; 4 or 8")
    pack_dtype = raw.get("pack_dtype", "int32")
    if pack_dtype not in ("int32", "torch.int32"):
        raise ValueError(f"{_FIELD}.pack_dtype {pack_dtype!r} is not supported; only 'int32'")
    group_size = _group_size(raw.get("group_size"))
    for flag in ("sym", "desc_act"):
        if not isinstance(raw.get(flag, flag == "sym"), bool):
            raise ValueError(f"{_FIELD}.{flag} must be true or false, got {raw.get(flag)!r}")
    if raw.get("lm_head"):
        raise ValueError(f"{_FIELD}.lm_head true is not supported: the LM head stays float")
    for per_module in ("dynamic", "modules_in_block_to_quantize"):
        if raw.get(per_module):
            raise ValueError(
                f"{_FIELD}.{per_module} is set: only every decoder linear layer quantized "
                "alike is supported"
            )
    _only_the_lm_head_unconverted(raw, experts)
    return PackedIntWeights(
        bits,
        group_size,
        symmetric=raw.get("sym", True),
        method="gptq",
        zeros_minus_one=_GPTQ_FORMATS[fmt.lower()],
        act_order=raw.get("desc_act", False),
    )


def _first_of(raw: dict[str, Any], key: str, legacy: str) -> Any:
    return raw[key] if key in raw else raw.get(legacy)


def _group_size(group_size: Any) -> int | None:
    """A group size as AWQ and GPTQ write it: positive, or -1 for one group a row (None)."""
    if group_size == -1:
        return None
    if type(group_size) is not int or group_size < 1:
        raise ValueError(
            f"{_FIELD}.group_size {group_size!r} is not supported; a positive int or -1"
        )
    return group_size


def _only_the_lm_head_unconverted(raw: dict[str, Any], experts: bool) -> None:
    skipped = raw.get("modules_to_not_convert") or []
    if not _only_unconverted(skipped, experts):
        raise ValueError(
            f"{_FIELD}.modules_to_not_convert {skipped!r} is not supported; only the LM head "
            "(and a mixture-of-experts model's router gates) may stay unconverted"
        )


def _only_unconverted(entries: Any, experts: bool, lm_head: str | None = None) -> bool:
    """Whether every entry of a list of unquantized modules names the LM head (exactly
    ``lm_head`` where given) or, where the model has ``experts``, router gates."""
    return all(
        (entry == lm_head if lm_head is not None else names_the_lm_head(str(entry)))
        or (experts and names_router_gates(str(entry)))
        for entry in entries
    )
