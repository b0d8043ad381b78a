"""What speculative decoding the user asks for: vLLM's ``speculative_config`` for the ngram
(prompt lookup), draft_model (a smaller model of the same vocabulary) and mtp (the model's own
multi-token-prediction layer) methods, checked on construction; torch-free, so the router
builds it too."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_DEFAULT_LOOKUP = 5  # vLLM's window when neither bound is given
MAX_SPECULATIVE_TOKENS = 16  # drafts per sequence per step, at most
METHODS = ("ngram", "draft_model", "mtp")
# vLLM's older names of the mtp method, per model family
_MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp")
_LOOKUP_KEYS = ("prompt_lookup_max", "prompt_lookup_min")  # ngram's alone
_KEYS = ("method", "model", "num_speculative_tokens", *_LOOKUP_KEYS, "disable_by_batch_size")
_INT_KEYS = ("num_speculative_tokens", *_LOOKUP_KEYS, "disable_by_batch_size")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # drafts proposed per decoding sequence per step, at most
    prompt_lookup_max: int = _DEFAULT_LOOKUP  # longest n-gram looked up in the context
    prompt_lookup_min: int = _DEFAULT_LOOKUP  # shortest n-gram that may give a proposal
    # "ngram": drafts copied from the sequence's own context; "draft_model": drafted greedily
    # by ``model``, run beside the target on the same blocks (engine/speculative/draft_model.py);
    # "mtp": drafted greedily by the checkpoint's multi-token-prediction layer from the target's
    # hidden states (engine/speculative/mtp.py)
    method: str = "ngram"
    model: str | None = None  # the draft model's directory (draft_model alone)
    # no drafts in a step while more sequences than this are running (None: always drafts):
    # a large batch already keeps the hardware busy, and its drafts cost more than they save
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model is required by method 'draft_model' (the draft "
                f"model's directory) and by no other; got method {self.method!r} and model "
                f"{self.model!r}"
            )
        for name in _INT_KEYS:
            value = getattr(self, name)
            if value is None and name == "disable_by_batch_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"speculative_config.{name} must be an int, got {type(value).__name__}"
                )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                "speculative_config.disable_by_batch_size must be >= 1, got "
                f"{self.disable_by_batch_size}"
            )
        if self.prompt_lookup_min < 1:
            raise ValueError(
                f"speculative_config.prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}"
            )
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config.prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                f"prompt_lookup_min ({self.prompt_lookup_min})"
            )

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict: ``method`` "ngram", "draft_model" or "mtp" (vLLM's default: the
        second when a ``model`` is given, else the first; "deepseek_mtp" and "glm4_moe_mtp" are
        the third's older names), ``model``, ``num_speculative_tokens``
        (required), ngram's ``prompt_lookup_max`` / ``prompt_lookup_min`` (one given: the other
        is the same; neither: both 5, as vLLM), ``disable_by_batch_size``."""
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {', '.join(unknown)}; "
                f"accepted: {', '.join(_KEYS)}"
            )
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        method = raw.get("method", "ngram" if raw.get("model") is None else "draft_model")
        if method in _MTP_ALIASES:
            method = "mtp"
        lookup_given = sorted(set(_LOOKUP_KEYS) & set(raw))
        if method != "ngram" and lookup_given:
            raise ValueError(
                f"speculative_config.{lookup_given[0]} is the ngram method's; method is {method!r}"
            )
        model = raw.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(
                f"speculative_config.model must be a directory path, got {type(model).__name__}"
            )
        lookup_max = raw.get("prompt_lookup_max")
        lookup_min = raw.get("prompt_lookup_min")
        if lookup_max is None:
            lookup_max = _DEFAULT_LOOKUP if lookup_min is None else lookup_min
        if lookup_min is None:
            lookup_min = lookup_max
        return cls(
            num_speculative_tokens=raw["num_speculative_tokens"],
            prompt_lookup_max=lookup_max,
            prompt_lookup_min=lookup_min,
            method=method,
            model=model,
            disable_by_batch_size=raw.get("disable_by_batch_size"),
        )
