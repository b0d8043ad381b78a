"""Request fields pdserve does not implement, refused with a 400 naming the field when set.

OpenAI's fields and vLLM's extras that would change the output (or the response's shape) are
refused unless the value means "off": a client ported from OpenAI or vLLM then learns at once
that a field has no effect here, instead of reading output that silently ignored it. Unknown
fields are still ignored, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from router.gateway.errors import invalid

# field -> the values that mean "off" (accepted, since they change nothing)
_OFF: Mapping[str, tuple[Any, ...]] = {
    # OpenAI
    "suffix": ("",),
    "tools": ([],),  # completions only, as tool_choice: chat implements them (tool_fields)
    "tool_choice": ("none",),  # "none" with no tools is what every client means by default
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "prediction": (),
    # vLLM's extras
    "guided_grammar": (),
    "guided_whitespace_pattern": (),
    "logits_processors": ([],),
    "prompt_embeds": (),
    "mm_processor_kwargs": ({},),
}
# fields only the chat endpoint implements (tool_fields): refused on completions as above
_CHAT_ONLY = frozenset({"tools", "tool_choice"})
# server-side templates only (the security model): a template sent by a client is refused
_REASONS = {"chat_template": "this server applies the model's own chat template only"}
# vLLM tokenizes completion prompts with special tokens added and rendered chats without
_ADD_SPECIAL_TOKENS = {"completion": True, "chat": False}


def check_unsupported(kind: Literal["completion", "chat"], body: Mapping[str, Any]) -> None:
    """ApiError(400) naming the first field set that this server does not implement."""
    for name, off in _OFF.items():
        if kind == "chat" and name in _CHAT_ONLY:
            continue
        value = body.get(name)
        if value is not None and not any(_same(value, o) for o in off):
            raise invalid(f"{name} is not supported by this server", param=name)
    for name, reason in _REASONS.items():
        if body.get(name) is not None:
            raise invalid(f"{name} is not supported: {reason}", param=name)
    _check_best_of(body)
    add_special_tokens = body.get("add_special_tokens")
    if add_special_tokens is not None and add_special_tokens is not _ADD_SPECIAL_TOKENS[kind]:
        raise invalid(
            f"add_special_tokens must be {str(_ADD_SPECIAL_TOKENS[kind]).lower()} on this "
            "endpoint (the only tokenization this server implements)",
            param="add_special_tokens",
        )


def _same(value: Any, off: Any) -> bool:
    return type(value) is type(off) and value == off


def _check_best_of(body: Mapping[str, Any]) -> None:
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise invalid("best_of is not supported by this server (use n)", param="best_of")
