"""Chat messages to prompt tokens, with the model's own chat template (server-side only).

Clients cannot send a template: only the one saved with the tokenizer is used. Messages are
checked first (roles, text content, count, tool calls), so a template never sees malformed
input. Tool turns reach the template in the shape transformers' templates expect, as vLLM
passes them: an assistant message's ``tool_calls`` with each ``function.arguments`` parsed from
its JSON text to an object, and ``tool`` messages with their ``tool_call_id``. An assistant
message's earlier reasoning (vLLM's ``reasoning``, or its old name ``reasoning_content``)
reaches the template as ``reasoning``, which transformers also passes as ``reasoning_content``
(Qwen3's templates read it) and ``thinking`` (gpt-oss's template writes it as the analysis
before a call). For a model read as harmony (``harmony=True``), an assistant message with calls,
content and reasoning drops its content (a preamble to the user), which gpt-oss's template
refuses beside the reasoning; the reasoning stays, the analysis before the calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from router.gateway.errors import invalid
from router.gateway.limits import RequestLimits

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOL_CALLS = 128  # tool calls in one assistant message
# reasoning_effort's values, vLLM's (OpenAI's, and DeepSeek's "max")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# names chat_template_kwargs may not set: apply_chat_template's own arguments and the messages
_RESERVED_TEMPLATE_KWARGS = frozenset(
    [
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    ]
)


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How a conversation is rendered (vLLM's chat-request extras of the same names)."""

    add_generation_prompt: bool = True  # open the assistant's turn after the last message
    continue_final_message: bool = False  # leave the last (assistant) message open to extend
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables
    # the request's tools, as apply_chat_template's ``tools`` (tool_fields); None: no tools
    tools: list[dict[str, Any]] | None = None
    # vLLM's ``documents`` (RAG templates render them), ``checked_documents``; None: none
    documents: list[dict[str, str]] | None = None


def template_options(
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
) -> ChatTemplateOptions:
    """The chat request's template options (flags already type-checked; ``variables``:
    ``template_kwargs``'), checked together; 400 naming the field otherwise."""
    if add_generation_prompt and continue_final_message:
        raise invalid(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    return ChatTemplateOptions(
        add_generation_prompt, continue_final_message, variables, tools, documents
    )


def template_kwargs(chat_template_kwargs: Any, reasoning_effort: Any) -> dict[str, Any]:
    """The variables a chat request passes its template: ``chat_template_kwargs``, and
    ``reasoning_effort`` as vLLM passes it (gpt-oss's template writes it into the system
    message), with ``enable_thinking`` false for "none" unless the kwargs set it (Qwen3's
    templates read that); 400 naming the field otherwise."""
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, dict):
        raise invalid("chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs))
    if reserved:
        raise invalid(
            f"chat_template_kwargs may not set {', '.join(reserved)}",
            param="chat_template_kwargs",
        )
    if reasoning_effort is None:
        return chat_template_kwargs
    if reasoning_effort not in REASONING_EFFORTS:
        raise invalid(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got "
            f"{reasoning_effort!r}",
            param="reasoning_effort",
        )
    thinking = reasoning_effort != "none"
    return {
        "enable_thinking": thinking,
        **chat_template_kwargs,
        "reasoning_effort": reasoning_effort,
    }


def parse_messages(
    value: Any, limits: RequestLimits, check_length: bool = True, harmony: bool = False
) -> list[dict[str, Any]]:
    """``messages`` from a request body as [{"role", "content"}] with text content (and, on
    tool turns, ``tool_calls`` or ``tool_call_id``; an assistant's earlier ``reasoning``).

    ``check_length``: refuse text far too long for the context before it is rendered; off when
    the prompt is to be truncated (``truncate_prompt_tokens``), which may make it fit.
    ``harmony``: the model's replies are harmony (gpt-oss): a preamble beside reasoning and
    calls is dropped, as its template takes no such message."""
    if not isinstance(value, list):
        raise invalid("messages must be a list of message objects", param="messages")
    if not value:
        raise invalid("messages must hold at least one message", param="messages")
    if len(value) > limits.max_messages:
        raise invalid(
            f"messages holds {len(value)} messages; at most {limits.max_messages} are allowed",
            param="messages",
        )
    messages = [_parse_message(i, message) for i, message in enumerate(value)]
    if harmony:
        messages = [_without_preamble(message) for message in messages]
    if check_length:
        num_chars = sum(len(m["content"]) + _chars_beyond_content(m) for m in messages)
        check_prompt_chars(num_chars, "messages", limits.max_model_len)
    return messages


def _parse_message(index: int, message: Any) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{param} must be an object with 'role' and 'content'", param=param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(
            f"{param}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
            param=f"{param}.role",
        )
    if "function_call" in message:
        raise invalid(f"{param}.function_call is not supported (use tool_calls)", param=param)
    tool_calls = message.get("tool_calls")
    if tool_calls and role != "assistant":
        raise invalid(f"{param}.tool_calls is only allowed on assistant messages", param=param)
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""  # OpenAI's clients send null content on assistant turns (tool calls)
    content = _text_content(content, f"{param}.content")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"{param}.name must be a string", param=f"{param}.name")
    parsed: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:  # an empty list is no tool calls, as vLLM drops it
        parsed["tool_calls"] = _tool_calls(tool_calls, f"{param}.tool_calls")
    if role == "assistant":
        reasoning = _earlier_reasoning(message, param)
        if reasoning is not None:
            parsed["reasoning"] = reasoning
    if role == "tool":
        tool_call_id = message.get("tool_call_id")
        if not isinstance(tool_call_id, str):
            raise invalid(
                f"{param}.tool_call_id must be a string (the id of the call this answers)",
                param=f"{param}.tool_call_id",
            )
        parsed["tool_call_id"] = tool_call_id
        if name is not None:  # some templates show the function's name with its result
            parsed["name"] = name
    return parsed


def _without_preamble(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with calls, content and reasoning without its content."""
    if message.get("tool_calls") and message["content"] and "reasoning" in message:
        return {**message, "content": ""}
    return message


def _earlier_reasoning(message: dict[str, Any], param: str) -> str | None:
    """An assistant message's reasoning, ``reasoning`` or else ``reasoning_content``; None
    when it has none."""
    name = "reasoning" if message.get("reasoning") is not None else "reasoning_content"
    reasoning = message.get(name)
    if reasoning is not None and not isinstance(reasoning, str):
        raise invalid(f"{param}.{name} must be a string", param=f"{param}.{name}")
    return reasoning


def _tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates take them."""
    if not isinstance(value, list):
        raise invalid(f"{param} must be a list of tool calls", param=param)
    if len(value) > MAX_TOOL_CALLS:
        raise invalid(
            f"{param} holds {len(value)} tool calls; at most {MAX_TOOL_CALLS} are allowed",
            param=param,
        )
    return [_tool_call(call, f"{param}[{j}]") for j, call in enumerate(value)]


def _tool_call(call: Any, param: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise invalid(f"{param} must be an object with 'id', 'type' and 'function'", param=param)
    if call.get("type") not in (None, "function"):
        raise invalid(f"{param}.type must be 'function', got {call['type']!r}", f"{param}.type")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise invalid(f"{param}.id must be a string", param=f"{param}.id")
    function = call.get("function")
    if not isinstance(function, dict):
        message = f"{param}.function must be an object with 'name' and 'arguments'"
        raise invalid(message, param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        message = f"{param}.function.name must be a non-empty string"
        raise invalid(message, param=f"{param}.function.name")
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str | dict):
        raise invalid(
            f"{param}.function.arguments must be a string of JSON (or an object), got "
            f"{type(arguments).__name__}",
            param=f"{param}.function.arguments",
        )
    parsed: dict[str, Any] = {"type": "function"}
    if call_id is not None:
        parsed["id"] = call_id
    parsed["function"] = {"name": name, "arguments": _arguments_object(arguments)}
    return parsed


def _arguments_object(arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    """A tool call's arguments as the object templates iterate. As vLLM: arguments that are not
    a JSON object (a call cut short, say) become {}, so the conversation can go on."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _chars_beyond_content(message: dict[str, Any]) -> int:
    """The characters of a message's tool calls and earlier reasoning."""
    calls = message.get("tool_calls", ())
    reasoning = len(message.get("reasoning", ""))
    return reasoning + sum(len(json.dumps(c["function"]["arguments"])) for c in calls)


def _text_content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return check_text(content, param)
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(
                    f"{param}[{i}] must be a text part ({{'type': 'text', 'text': ...}}); "
                    "this model takes text only",
                    param=param,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{param}[{i}].text must be a string", param=param)
            parts.append(check_text(text, param))
        return "".join(parts)
    raise invalid(f"{param} must be a string or a list of text parts", param=param)


def check_text(text: str, param: str) -> str:
    """``text`` itself, or a 400 when it cannot be UTF-8 (a lone surrogate from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise invalid(
            f"{param} is not valid Unicode (a lone surrogate at index {error.start})",
            param=param,
        ) from error
    return text


def checked_documents(value: Any, limits: RequestLimits) -> list[dict[str, str]] | None:
    """vLLM's ``documents`` chat field: a list (at most ``max_messages``) of objects whose
    values are strings (``{"title": ..., "text": ...}`` as RAG templates read them), handed to
    the template as ``documents``; None when absent. 400 naming the field otherwise."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("documents must be a list of objects of strings", param="documents")
    if len(value) > limits.max_messages:
        raise invalid(
            f"documents holds {len(value)} documents; at most {limits.max_messages} are allowed",
            param="documents",
        )
    for i, document in enumerate(value):
        if not isinstance(document, dict) or not document:
            raise invalid(f"documents[{i}] must be a non-empty object", param=f"documents[{i}]")
        for key, text in document.items():
            if not isinstance(text, str):
                param = f"documents[{i}].{key}"
                raise invalid(f"{param} must be a string", param=param)
    num_chars = sum(len(k) + len(t) for document in value for k, t in document.items())
    check_prompt_chars(num_chars, "documents", limits.max_model_len)
    return value


def check_prompt_chars(num_chars: int, param: str, max_model_len: int) -> None:
    """A 400 for prompt text that cannot fit the context whatever the tokenizer (none yields
    fewer than one token per 16 characters), before tokenizing it holds up the event loop."""
    if num_chars > 16 * max_model_len + 1024:
        raise invalid(
            f"{param} is {num_chars} characters, far beyond this model's maximum context "
            f"length of {max_model_len} tokens",
            param=param,
            code="context_length_exceeded",
        )


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    options: ChatTemplateOptions | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The prompt token ids of a conversation, ready for the assistant's reply (by default).
    ``add_special_tokens``: the tokenizer's own (a BOS) on top of the template's, as vLLM's
    /tokenize may ask; chat completions never do."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("this model has no chat template; use /v1/completions", param="messages")
    options = options or ChatTemplateOptions()
    if options.continue_final_message and messages[-1]["role"] != "assistant":
        raise invalid(
            "continue_final_message needs the last message to be the assistant's",
            param="continue_final_message",
        )
    extra: dict[str, Any] = {"tools": options.tools} if options.tools else {}
    if options.documents:
        extra["documents"] = options.documents
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **extra,
            **options.template_kwargs,
        )
    except Exception as error:  # the template rejected the conversation (raise_exception)
        raise invalid(f"messages cannot be rendered by the chat template: {error}") from error
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
