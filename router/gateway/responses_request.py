"""A ``/v1/responses`` request (OpenAI's Responses API, which vLLM serves) read as the chat
request it asks for: the chat path then checks, renders, samples and parses it, and
``responses_output`` shapes what comes back.

- ``input``: a string (one user message) or a list of items: messages (``role`` user, system,
  developer or assistant; ``content`` a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` items (an assistant's earlier call: ``call_id``, ``name``, ``arguments``;
  calls in a row join one assistant message), ``function_call_output`` items (the call's result:
  a tool message) and ``reasoning`` items (their ``reasoning_text``, the next assistant turn's
  reasoning). ``instructions``: a system message before them.
- ``max_output_tokens``, ``temperature``, ``top_p``, ``parallel_tool_calls``; ``tools``:
  function tools (``{"type": "function", "name", "description"?, "parameters"?, "strict"?}``)
  and ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function",
  "name"}``), as chat reads them; ``reasoning.effort`` as chat's ``reasoning_effort``;
  ``text.format`` (``text``, ``json_object``, ``json_schema`` with ``name``, ``schema``,
  ``strict``) as chat's ``response_format``; vLLM's extra sampling fields (``top_k``, ``min_p``,
  ``repetition_penalty``, ``seed``, ``priority``, ``cache_salt``, ``chat_template_kwargs``) as
  they are.
- ``previous_response_id``: the conversation a kept response ended (``responses_store``) comes
  before the input (a 404 when it is not kept; a 400 naming the flag when none are).
- ``include: ["message.output_text.logprobs"]``: the output text's logprobs, with
  ``top_logprobs`` alternatives each (0 without it), as chat's ``logprobs`` and
  ``top_logprobs``; ``top_logprobs`` alone shows none, as vLLM. Refused, each naming the field:
  background responses, built-in tools (web and file search, code interpreter ...), non-text
  input, any other ``include``, ``truncation: "auto"``. Errors from the chat path name the
  Responses field (``max_output_tokens``, not ``max_completion_tokens``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from router.gateway.auth import Caller
from router.gateway.errors import ApiError, invalid
from router.gateway.limits import RequestLimits
from router.gateway.openai_request import OpenAIJob, parse_job
from router.gateway.responses_store import ResponseStore, ResponsesTurn
from router.gateway.served_model import ServedModel

# vLLM's sampling extras, passed to the chat path as they are
_PASSED_ON = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "priority",
    "cache_salt",
    "chat_template_kwargs",
    "parallel_tool_calls",
    "stream",
)
# fields of the Responses API this server does not serve, and why
_REFUSED = {
    "conversation": "this server stores no conversations; send the whole conversation in input",
    "prompt": "stored prompt templates are not served; send the prompt in input",
    "max_tool_calls": "a cap on built-in tool calls is not served (there are none)",
}
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one extra output ``include`` can ask for
_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# the chat path's field names, as a Responses request writes them
_FIELD_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
_CHAT_NAME = re.compile(r"\b(" + "|".join(_FIELD_NAMES) + r")\b")


def parse_responses_job(
    body: Any, model: ServedModel, limits: RequestLimits, caller: Caller, store: ResponseStore
) -> tuple[OpenAIJob, ResponsesTurn]:
    """The chat job a Responses request asks for, and the turn it is (what it continues, from
    ``store``); ApiError(400) names the Responses field, a 404 a response not kept."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    earlier = _earlier_turns(body.get("previous_response_id"), store, caller.tenant_salt)
    chat, conversation = chat_request(body, earlier)
    try:
        job = parse_job("chat", chat, model, limits, caller)
    except ApiError as error:
        raise renamed(error) from error
    return job, ResponsesTurn(body, conversation, caller.tenant_salt, store)


def _earlier_turns(
    previous: Any, store: ResponseStore, owner: str | None
) -> tuple[dict[str, Any], ...]:
    """The conversation the response ``previous`` (None: none) ended, as chat messages."""
    if previous is None:
        return ()
    param = "previous_response_id"
    if not isinstance(previous, str):
        raise invalid(f"{param} must be a string", param=param)
    if not store.enabled:
        raise invalid(
            f"{param} needs kept responses and this server keeps none (pdserve serve "
            "--responses-store-size N keeps the last N); send the whole conversation in input",
            param=param,
        )
    stored = store.get(owner, previous)
    if stored is None:
        raise ApiError(
            404,
            f"{param} {previous!r} is not a response this server keeps for this API key (it "
            f"keeps the last {store.capacity})",
            param=param,
            code="response_not_found",
        )
    return stored.conversation


def chat_request(
    body: dict[str, Any], earlier: tuple[dict[str, Any], ...] = ()
) -> tuple[dict[str, Any], tuple[dict[str, Any], ...]]:
    """The chat request body a Responses request asks for, after the ``earlier`` turns (chat
    messages), and the conversation it holds (those and its input, its instructions aside);
    ApiError(400) names the field."""
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise invalid(f"{name} is not supported: {why}", param=name)
    if body.get("background") is True:
        raise invalid(
            "background responses are not supported: each is answered as it runs", "background"
        )
    if body.get("truncation") not in (None, "disabled"):
        raise invalid('truncation must be "disabled" (the input is never cut)', "truncation")
    chat: dict[str, Any] = {key: body[key] for key in _PASSED_ON if key in body}
    conversation = (*earlier, *_messages(body.get("input")))
    chat["messages"] = [*_instructions(body.get("instructions")), *conversation]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    effort = _object(body, "reasoning").get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    text_format = _object(_object(body, "text"), "format", "text.format")
    if text_format:
        chat["response_format"] = _response_format(text_format)
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}  # the completed event's usage
    if _included(body.get("include")):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    elif body.get("top_logprobs") is not None:
        _check_top_logprobs(body["top_logprobs"])
    return chat, conversation


def _included(include: Any) -> bool:
    """Whether ``include`` asks for the output text's logprobs (the one extra served)."""
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise invalid("include must be a list of strings", param="include")
    others = [item for item in include if item != OUTPUT_LOGPROBS]
    if others:
        raise invalid(
            f"include {others[0]!r} is not supported: of the extra outputs this server "
            f"serves {OUTPUT_LOGPROBS!r} only",
            param="include",
        )
    return bool(include)


def _check_top_logprobs(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"top_logprobs must be an integer >= 0, got {value!r}", "top_logprobs")


def renamed(error: ApiError) -> ApiError:
    """``error`` from the chat path naming the Responses request's fields."""
    message = _CHAT_NAME.sub(lambda m: _FIELD_NAMES[m.group(1)], error.message)
    param = error.param
    if param is not None:
        param = _CHAT_NAME.sub(lambda m: _FIELD_NAMES[m.group(1)], param)
    return dataclasses.replace(error, message=message, param=param)


def _object(body: Mapping[str, Any], name: str, param: str | None = None) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{param or name} must be an object", param=param or name)
    return value


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise invalid("instructions must be a string", param="instructions")
    return [{"role": "system", "content": instructions}]


def _messages(value: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty list of items", param="input")
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{param} must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, param)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(item, param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls in a row: one turn
            else:
                turn: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    turn["reasoning"], reasoning = reasoning, None
                messages.append(turn)
        elif kind == "function_call_output":
            messages.append(_call_output(item, param))
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, param)
        else:
            raise invalid(
                f"{param}.type must be message, function_call, function_call_output or "
                f"reasoning; got {kind!r}",
                param=f"{param}.type",
            )
    return messages


def _string(item: Mapping[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{param}.{name} must be a string", param=f"{param}.{name}")
    return value


def _message(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _INPUT_ROLES:
        raise invalid(
            f"{param}.role must be one of {', '.join(_INPUT_ROLES)}; got {role!r}",
            param=f"{param}.role",
        )
    return {"role": role, "content": _text(item.get("content"), f"{param}.content")}


def _text(value: Any, param: str) -> str:
    """A string, or a list of text parts (``input_text`` / ``output_text``) joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise invalid(
                f"{param}[{j}].type must be input_text or output_text (only text is served); "
                f"got {kind!r}",
                param=f"{param}[{j}].type",
            )
        texts.append(_string(part, "text", f"{param}[{j}]"))
    return "".join(texts)


def _function_call(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    return {
        "id": _string(item, "call_id", param),
        "type": "function",
        "function": {
            "name": _string(item, "name", param),
            "arguments": _string(item, "arguments", param),
        },
    }


def _call_output(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    output = _text(item.get("output"), f"{param}.output")
    return {"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": output}


def _reasoning_text(item: Mapping[str, Any], param: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts (else its summary's text)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise invalid(f"{param}.content must be a list of reasoning_text parts", param=param)
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise invalid(f"{param}.content[{j}] must be an object", f"{param}.content[{j}]")
        texts.append(_string(part, "text", f"{param}.content[{j}]"))
    return "\n".join(texts)


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid("tools must be a list of function tools", param="tools")
    tools = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(
                f"{param}.type must be function (built-in tools are not served); got {kind!r}",
                param=f"{param}.type",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    if value in ("auto", "none", "required"):
        return value
    raise invalid(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def _response_format(value: dict[str, Any]) -> dict[str, Any]:
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: value[k] for k in ("name", "schema", "strict", "description") if k in value}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(
        f"text.format.type must be text, json_object or json_schema; got {kind!r}",
        param="text.format.type",
    )
