"""A quantized KV cache: the element types a cache may store, the scales that say what a stored
element stands for, and how a K or V value is stored (and read back).

``kv_cache_dtype`` "auto" stores the model's dtype. "fp8_e4m3" (alias "fp8") stores float8
e4m3 (``torch.float8_e4m3fn``: finite, at most 448 in magnitude), "int8" signed 8-bit
integers; either takes half the bytes of bf16 and a quarter of float32, so a worker holds that
many more tokens and a hand-off moves that many fewer bytes.

A quantized cache has static scales, fixed at start-up: for every layer, a float32 scale for
each KV head's keys and one for its values (``KVCacheScales``); a latent cache (multi-head
latent attention) has one per layer, for its whole entries. A stored element ``q`` stands
for ``q * scale``. Storing divides a value by its head's scale in float32 and rounds: to the
nearest e4m3 value (ties to even) after clamping to +-448, or to the nearest integer (ties to
even) clamped to +-127. Every attention backend stores and reads by these rules, so a block
written by one worker reads the same on any other that has the same scales.

Scales come from the checkpoint (``k_scale``/``v_scale``), from the configuration (the cluster
hands every worker the same ones), or from a calibration pass at start-up
(engine/kv_calibration.py): ``scales_from_amax`` turns the largest magnitude each head
reached into a scale with headroom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: the router builds cache configs on a CPU head node
    import torch

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
_ALIASES = {"fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"}
# the largest magnitude each quantized type stores
QUANTIZED_MAX = {"fp8_e4m3": 448.0, "int8": 127.0}
# calibrated scales leave room above the largest magnitude calibration saw: float8 keeps its
# relative precision at any scale, so it takes 2x; int8 loses a bit of resolution per 2x, so
# it takes less
_CALIBRATION_HEADROOM = {"fp8_e4m3": 2.0, "int8": 1.25}


def parse_kv_cache_dtype(name: str) -> str:
    """``name`` as one of KV_CACHE_DTYPES; ValueError naming the field otherwise."""
    canonical = _ALIASES.get(name, name)
    if canonical not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or fp8); got {name!r}"
        )
    return canonical


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in QUANTIZED_MAX


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's element type."""
    import torch

    if kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    if kv_cache_dtype == "int8":
        return torch.int8
    return model_dtype


def kv_cache_dtype_of(cache: torch.Tensor) -> str | None:
    """The quantized type a cache tensor stores, or None for a float cache."""
    import torch

    if cache.dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if cache.dtype == torch.int8:
        return "int8"
    return None


def quantize_kv(
    values: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    scales: torch.Tensor,  # [num_kv_heads] float32
    into: torch.dtype,  # float8_e4m3fn | int8
) -> torch.Tensor:  # [num_tokens, num_kv_heads, head_dim] of ``into``
    """``values`` as a quantized cache stores them (the module docstring's rules)."""
    import torch

    scaled = values.float() / scales[:, None]
    if into == torch.int8:
        return scaled.round().clamp_(-127.0, 127.0).to(torch.int8)
    return scaled.clamp_(-448.0, 448.0).to(into)


def dequantize_kv(
    stored: torch.Tensor,  # [..., num_kv_heads, head_dim] float8_e4m3fn | int8
    scales: torch.Tensor,  # [num_kv_heads] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # like ``stored``, of ``dtype``
    """What stored elements stand for, in ``dtype``."""
    return (stored.float() * scales[:, None]).to(dtype)


@dataclass(frozen=True, slots=True)
class KVCacheScales:
    """A quantized cache's scales for the whole model: ``per_layer[layer][plane][head]``, one
    per KV head of the model (a tensor-parallel rank uses its heads' share). A layer has the
    cache's planes (ModelConfig.kv_planes): 2, the keys (plane 0) and the values (plane 1); or
    1, a latent cache's entries (multi-head latent attention: one "head", one scale for the
    whole entry, latent and rotary key alike)."""

    kv_cache_dtype: str  # "fp8_e4m3" | "int8": the stored type the scales are for
    per_layer: tuple[tuple[tuple[float, ...], ...], ...]

    def __post_init__(self) -> None:
        if not is_quantized(self.kv_cache_dtype):
            raise ValueError(
                f"KV cache scales are for fp8_e4m3 or int8, got {self.kv_cache_dtype!r}"
            )
        if not self.per_layer:
            raise ValueError("KV cache scales need at least one layer")
        num_planes = len(self.per_layer[0])
        if num_planes not in (1, 2):
            raise ValueError(
                f"KV cache scales need 2 planes (K and V) or 1 (a latent) per layer, layer 0 "
                f"has {num_planes}"
            )
        num_heads = len(self.per_layer[0][0])
        for layer, planes in enumerate(self.per_layer):
            if len(planes) != num_planes or any(len(plane) != num_heads for plane in planes):
                what = "a K and a V scale" if num_planes == 2 else "a latent scale"
                raise ValueError(
                    f"KV cache scales of layer {layer} must be {what} for each of "
                    f"{num_heads} KV heads"
                )
            for plane in planes:
                for scale in plane:
                    if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0):
                        raise ValueError(
                            f"KV cache scales must be finite floats > 0; layer {layer} has "
                            f"{scale!r}"
                        )

    @property
    def num_layers(self) -> int:
        return len(self.per_layer)

    @property
    def num_kv_heads(self) -> int:
        return len(self.per_layer[0][0])

    @property
    def kv_planes(self) -> int:
        """Planes per layer: 2 (K and V) or 1 (a latent cache)."""
        return len(self.per_layer[0])

    def layer(self, layer: int, heads: range, device: torch.device) -> torch.Tensor:
        """Layer ``layer``'s scales of the model's KV ``heads``: [kv_planes, len(heads)]
        float32."""
        import torch

        return torch.tensor(
            [[plane[head] for head in heads] for plane in self.per_layer[layer]],
            dtype=torch.float32,
            device=device,
        )

    def check_model(
        self, num_layers: int, num_kv_heads: int, kv_cache_dtype: str, kv_planes: int = 2
    ) -> None:
        """ValueError unless these scales fit a model of this shape (``kv_planes``: its
        cache's planes per layer, ModelConfig.kv_planes) and cache type."""
        if self.kv_cache_dtype != kv_cache_dtype:
            raise ValueError(
                f"kv_cache_scales are for {self.kv_cache_dtype}, the cache stores {kv_cache_dtype}"
            )
        if self.kv_planes != kv_planes:
            raise ValueError(
                f"kv_cache_scales have {self.kv_planes} planes per layer; the model's cache has "
                f"{kv_planes} ({'K and V' if kv_planes == 2 else 'a latent'})"
            )
        if (self.num_layers, self.num_kv_heads) != (num_layers, num_kv_heads):
            raise ValueError(
                f"kv_cache_scales cover {self.num_layers} layers of {self.num_kv_heads} KV heads; "
                f"the model has {num_layers} layers of {num_kv_heads}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "kv_cache_dtype": self.kv_cache_dtype,
            "per_layer": [[list(plane) for plane in planes] for planes in self.per_layer],
        }

    @classmethod
    def from_json(cls, data: Any) -> KVCacheScales:
        """ValueError on anything but ``to_json``'s shape."""
        if not isinstance(data, dict) or sorted(data) != ["kv_cache_dtype", "per_layer"]:
            raise ValueError(
                f"KV cache scales must be {{'kv_cache_dtype': ..., 'per_layer': ...}}, got {data!r}"
            )
        layers = data["per_layer"]
        if not isinstance(layers, list) or not all(
            isinstance(planes, list) and all(isinstance(plane, list) for plane in planes)
            for planes in layers
        ):
            raise ValueError("KV cache scales' per_layer must be [layer][plane][head] lists")
        per_layer = tuple(
            tuple(tuple(_as_float(scale) for scale in plane) for plane in planes)
            for planes in layers
        )
        return cls(str(data["kv_cache_dtype"]), per_layer)

    @classmethod
    def from_tensor(cls, kv_cache_dtype: str, scales: torch.Tensor) -> KVCacheScales:
        """From a [num_layers, kv_planes, num_kv_heads] tensor of scales."""
        rows = scales.detach().float().cpu().tolist()
        return cls(
            kv_cache_dtype, tuple(tuple(tuple(plane) for plane in planes) for planes in rows)
        )


def scales_from_amax(kv_cache_dtype: str, amax: torch.Tensor) -> torch.Tensor:
    """Calibrated scales from the largest magnitude each head's planes reached (any shape,
    float32): the type's largest value stands for ``headroom * amax``. A head that stayed at
    zero gets scale 1."""
    import torch

    headroom = _CALIBRATION_HEADROOM[kv_cache_dtype]
    scales = amax.float() * (headroom / QUANTIZED_MAX[kv_cache_dtype])
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"KV cache scales must be numbers, got {value!r}")
    return float(value)
