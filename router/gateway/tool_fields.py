"""A chat request's ``tools`` and ``tool_choice``, checked, as the template and the output
constraint or tool-call parser take them: the forms vLLM implements.

- ``tools``: at most ``MAX_TOOLS`` ``{"type": "function", "function": {"name", "description"?,
  "parameters"?, "strict"?}}``, names as OpenAI's (``^[a-zA-Z0-9_-]{1,64}$``, no two alike).
  They are handed to the chat template whatever ``tool_choice`` says, as vLLM does.
- ``tool_choice`` ``"none"`` (or absent without tools): the output is plain content.
- a named function ``{"type": "function", "function": {"name": X}}``: the output is constrained
  to X's ``parameters`` schema and returned as one call of X (``tool_calls``).
- ``"required"``: the output is constrained to a JSON array (at least one item; one at most
  with ``parallel_tool_calls: false``) of ``{"name": <a tool's name>, "parameters": <its
  parameters>}``, one schema alternative per tool as vLLM builds it, each item returned as a
  call. With ``tools: []`` it is ``"none"``, as vLLM reads it.
- ``"auto"``, OpenAI's default when tools are given: the output is free and read for tool calls
  by the served model's tool-call parser (``--enable-auto-tool-choice --tool-call-parser
  NAME``), whose special tokens (``<tool_call>`` is one in many models) are then kept in the
  text, as vLLM's hermes parser asks; ``parallel_tool_calls`` is ignored, as vLLM ignores it.
  Without those flags it is refused naming them, as vLLM refuses it. With ``tools: []`` it is
  ``"none"``.

A tool without ``parameters`` takes none: its arguments are ``{}``. A constraint from the tools
cannot be combined with ``response_format``, ``structured_outputs`` or ``guided_*``; no tool
choice that returns tool calls ("auto" included) with ``echo``. Errors name the field as the
client wrote it (``tools[2].function.name``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.structured.spec import StructuredOutputSpec
from router.gateway.errors import ApiError, invalid
from router.gateway.qwen3_coder_tool_calls import tool_parameters
from router.gateway.structured_fields import checked_schema_spec, structured_output_field
from router.gateway.tool_calls import AutoToolCalls, ForcedToolCalls, ToolCallMode

MAX_TOOLS = 128  # tools in one request, as OpenAI's limit
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NAMED_FORM = '{"type": "function", "function": {"name": ...}}'
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# JSON Schema keywords whose values are data, not schemas: their "$ref" keys are not references
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# keywords whose values map names (which may be any word, "enum" too) to schemas
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})


@dataclass(frozen=True, slots=True)
class ChatTools:
    """What a chat request's tools ask of the chat template and of the output."""

    tools: list[dict[str, Any]] | None  # apply_chat_template's ``tools``; None: no tools
    mode: ToolCallMode | None  # how the output becomes tool calls; None: plain content
    constraint: StructuredOutputSpec | None  # the output constraint that forces them, if any


def checked_tools(body: Mapping[str, Any], tool_call_parser: str | None = None) -> ChatTools:
    """The request's tools and tool choice; ApiError(400) names the field at fault.
    ``tool_call_parser``: the served model's (``ServedModel``); None: "auto" is refused."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    auto = choice == "auto" or (choice is None and bool(tools))
    if auto and tool_call_parser is None:
        raise invalid(
            'tool_choice "auto" (OpenAI\'s default when tools are given) needs a tool-call '
            "parser: this server was not started with --enable-auto-tool-choice and "
            '--tool-call-parser (as vLLM requires); send tool_choice "required", "none" or a '
            f"named function ({_NAMED_FORM})",
            param="tool_choice",
        )
    if choice not in (None, "none") and body.get("tools") is None:
        raise invalid(
            'tool_choice other than "none" needs tools (the functions that may be called)',
            param="tool_choice",
        )
    if (choice in (None, "none") and not auto) or (choice in ("required", "auto") and not tools):
        return ChatTools(tools or None, None, None)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    constraint = None
    mode: ToolCallMode
    if auto:
        assert tool_call_parser is not None
        mode = AutoToolCalls(tool_call_parser, tool_parameters(tools))
    elif choice == "required":
        constraint = _required_constraint(tools, one_call=parallel is False)
        mode = ForcedToolCalls(None)
    else:
        index = _named_tool(choice, tools)
        label = f"tools[{index}].function.parameters"
        parameters = tools[index]["function"].get("parameters") or _NO_ARGUMENTS
        constraint = checked_schema_spec(label, label, parameters)
        mode = ForcedToolCalls(tools[index]["function"]["name"])
    if body.get("echo") is True:
        raise invalid("echo cannot be combined with tool calls (tool_choice)", param="echo")
    return ChatTools(tools, mode, constraint)


def output_constraint(
    body: Mapping[str, Any], tools: ChatTools | None
) -> tuple[str, StructuredOutputSpec] | None:
    """The one constraint on the request's output with the field that sets it: the tools'
    (``tool_choice``), or that of ``response_format``, ``structured_outputs`` or ``guided_*``.
    Both: a 400 naming the latter, as one per request."""
    found = structured_output_field(body)
    if tools is None or tools.constraint is None:
        return found
    if found is not None:
        raise invalid(
            f"{found[0]} and tool_choice each constrain the output; send at most one",
            param=found[0],
        )
    return "tool_choice", tools.constraint


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools must be a list of function tools", param="tools")
    if len(value) > MAX_TOOLS:
        raise invalid(
            f"tools holds {len(value)} tools; at most {MAX_TOOLS} are allowed", param="tools"
        )
    tools = [_tool(i, tool) for i, tool in enumerate(value)]
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            param = f"tools[{i}].function.name"
            raise invalid(f"{param} {name!r} is also tools[{seen[name]}]'s", param=param)
        seen[name] = i
    return tools


def _tool(index: int, tool: Any) -> dict[str, Any]:
    """One tool as the template takes it: its type and the function's known fields."""
    param = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise invalid(f"{param} must be an object with 'type' and 'function'", param=param)
    if tool.get("type") not in (None, "function"):
        raise invalid(
            f"{param}.type must be 'function' (the only tool type), got {tool['type']!r}",
            param=f"{param}.type",
        )
    function = tool.get("function")
    param += ".function"
    if not isinstance(function, dict):
        raise invalid(f"{param} must be an object with a 'name'", param=param)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(
            f"{param}.name must be 1 to 64 letters, digits, '_' or '-' "
            f"(^[a-zA-Z0-9_-]{{1,64}}$), got {name!r}",
            param=f"{param}.name",
        )
    checked: dict[str, Any] = {"name": name}
    for field, kind, what in (
        ("description", str, "a string"),
        ("parameters", dict, "a JSON schema (an object)"),
        ("strict", bool, "a boolean"),
    ):
        if function.get(field) is not None:
            if not isinstance(function[field], kind):
                raise invalid(f"{param}.{field} must be {what}", param=f"{param}.{field}")
            checked[field] = function[field]
    return {"type": "function", "function": checked}


def _named_tool(choice: Any, tools: list[dict[str, Any]]) -> int:
    """The index of the tool a named ``tool_choice`` names."""
    form = f'tool_choice must be "none", "auto", "required" or a named function ({_NAMED_FORM})'
    if not isinstance(choice, dict) or choice.get("type") not in (None, "function"):
        raise invalid(f"{form}, got {choice!r}", param="tool_choice")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise invalid(f"{form}; tool_choice.function.name is missing", param="tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise invalid(
            f"tool_choice.function.name {name!r} is not one of the tools "
            f"({', '.join(names) or 'tools is empty'})",
            param="tool_choice",
        )
    return names.index(name)


def _required_constraint(tools: list[dict[str, Any]], one_call: bool) -> StructuredOutputSpec:
    """vLLM's schema for "required": an array of calls, each item one tool's name and
    parameters, their ``$ref``s rewritten to point into the array's schema. Checked whole; if
    that fails, each tool's parameters alone, so that the error names the tool at fault."""
    alternatives = []
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters") or _NO_ARGUMENTS
        alternatives.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": _rebased(parameters, f"#/items/anyOf/{i}/properties/parameters"),
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if one_call:
        schema["maxItems"] = 1
    try:
        return checked_schema_spec('tools (as tool_choice "required")', "tools", schema)
    except ApiError:
        for i, tool in enumerate(tools):  # which tool is at fault
            label = f"tools[{i}].function.parameters"
            checked_schema_spec(label, label, tool["function"].get("parameters") or _NO_ARGUMENTS)
        raise


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with each ``$ref`` into it ("#/...") pointing into ``root`` instead."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
            rebased[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rebased[key] = {name: _rebased(sub, root) for name, sub in value.items()}
        else:
            rebased[key] = _rebased(value, root)
    return rebased
