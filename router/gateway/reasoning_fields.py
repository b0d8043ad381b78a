"""A chat request's reasoning options under ``--reasoning-parser``, checked: how its output is
split (``reasoning``), where an output constraint starts, and the fields the split cannot be
combined with. Completions are not split, as vLLM applies reasoning parsers to chat only.

- vLLM's ``include_reasoning`` (default true): false leaves the reasoning out (``reasoning``
  null, no reasoning deltas) and, as vLLM hides them with it, the logprobs (``logprobs`` null).
- qwen3 with ``chat_template_kwargs: {"enable_thinking": false}`` (as Qwen3's templates read
  it), or ``reasoning_effort: "none"`` without it: thinking is off, the output is all content.
- deepseek_v3 (DeepSeek-V3.1's hybrid thinking) thinks only when ``chat_template_kwargs`` sets
  ``thinking`` (V3.1's template variable) or ``enable_thinking`` true, as vLLM's parser of the
  name; otherwise the output is all content.
- glm45 thinks unless ``enable_thinking`` (GLM's template variable; ``reasoning_effort:
  "none"`` sets it false) or ``thinking`` is set and neither is true, as vLLM's parser.
- kimi_k2 thinks unless ``chat_template_kwargs`` set ``thinking`` (Kimi's template variable)
  false, as vLLM's parser.
- While thinking is on, an output constraint (a named or ``"required"`` ``tool_choice``,
  ``response_format``, ``structured_outputs``, ``guided_*``) holds from the token after
  ``</think>`` (gpt-oss's harmony: after ``<|channel|>final<|message|>``, its final answer's
  header), as vLLM applies it once the reasoning has ended; the reasoning is free. ``echo``
  is refused: its text would be read as reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from engine.structured.spec import StructuredOutputSpec
from router.gateway.errors import invalid
from router.gateway.reasoning import ReasoningMode


def checked_reasoning(
    body: Mapping[str, Any], parser: str | None, variables: Mapping[str, Any]
) -> ReasoningMode | None:
    """How the request's output is split; None without a reasoning parser (the served model's,
    ``ServedModel.reasoning_parser``). ``variables``: what its template is passed
    (``chat.template_kwargs``). ApiError(400) names the field at fault."""
    include = body.get("include_reasoning")
    if include is not None and not isinstance(include, bool):
        raise invalid("include_reasoning must be a boolean", param="include_reasoning")
    if parser is None:
        return None
    if parser == "deepseek_v3":  # thinking only when the request's own kwargs turn it on
        asked = body.get("chat_template_kwargs") or {}
        thinking = bool(asked.get("thinking")) or bool(asked.get("enable_thinking"))
    elif parser == "glm45":  # thinking unless the variables turn it off (and none on)
        switches = [variables.get(key) for key in ("thinking", "enable_thinking")]
        thinking = all(s is None for s in switches) or any(bool(s) for s in switches)
    elif parser == "kimi_k2":  # Kimi's template variable
        thinking = bool(variables.get("thinking", True))
    else:
        thinking = not (parser == "qwen3" and variables.get("enable_thinking") is False)
    mode = ReasoningMode(parser, thinking, include=include is not False)
    if mode.thinking and body.get("echo") is True:
        raise invalid(
            f"echo cannot be combined with this server's --reasoning-parser {parser}: the echoed "
            "message would be read as the start of the reasoning",
            param="echo",
        )
    return mode


def constrained_after_reasoning(
    mode: ReasoningMode, spec: StructuredOutputSpec, reasoning_end_token_ids: tuple[int, ...]
) -> StructuredOutputSpec:
    """``spec`` applied once the reasoning has ended, as vLLM applies an output constraint under
    a reasoning parser: the workers leave the output free until it holds the reasoning's end
    (``reasoning_end_token_ids``: ``</think>``'s tokens, or harmony's final header's), and
    constrain what follows (``StructuredOutputSpec.after_token_ids``). With thinking off
    there is no reasoning to wait for: constrained from the first token, as vLLM."""
    if not mode.thinking:
        return spec
    return replace(spec, after_token_ids=reasoning_end_token_ids)
