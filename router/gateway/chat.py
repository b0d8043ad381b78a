"""Chat messages to prompt tokens, with the model's own chat template (server-side only).

Clients cannot send a template: only the one saved with the tokenizer is used. Messages are
checked first (roles, text content, count), so a template never sees malformed input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.gateway.errors import invalid
from router.gateway.limits import RequestLimits

CHAT_ROLES = ("system", "developer", "user", "assistant")
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


def template_options(
    add_generation_prompt: bool, continue_final_message: bool, template_kwargs: Any
) -> ChatTemplateOptions:
    """The chat request's template options (flags already type-checked), checked together;
    400 naming the field otherwise."""
    if add_generation_prompt and continue_final_message:
        raise invalid(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if template_kwargs is None:
        template_kwargs = {}
    if not isinstance(template_kwargs, dict):
        raise invalid("chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:
        raise invalid(
            f"chat_template_kwargs may not set {', '.join(reserved)}",
            param="chat_template_kwargs",
        )
    return ChatTemplateOptions(add_generation_prompt, continue_final_message, template_kwargs)


def parse_messages(
    value: Any, limits: RequestLimits, check_length: bool = True
) -> list[dict[str, str]]:
    """``messages`` from a request body as [{"role", "content"}] with text content.

    ``check_length``: refuse text far too long for the context before it is rendered; off when
    the prompt is to be truncated (``truncate_prompt_tokens``), which may make it fit."""
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
    if check_length:
        num_chars = sum(len(m["content"]) for m in messages)
        check_prompt_chars(num_chars, "messages", limits.max_model_len)
    return messages


def _parse_message(index: int, message: Any) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{param} must be an object with 'role' and 'content'", param=param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(
            f"{param}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
            param=f"{param}.role",
        )
    if "tool_calls" in message or "function_call" in message:
        raise invalid(f"{param}: tool calls are not supported", param=param)
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""  # OpenAI's clients send null content on assistant turns
    content = _text_content(content, f"{param}.content")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"{param}.name must be a string", param=f"{param}.name")
    return {"role": role, "content": content}


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
    tokenizer: Any, messages: list[dict[str, str]], options: ChatTemplateOptions | None = None
) -> list[int]:
    """The prompt token ids of a conversation, ready for the assistant's reply (by default)."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("this model has no chat template; use /v1/completions", param="messages")
    options = options or ChatTemplateOptions()
    if options.continue_final_message and messages[-1]["role"] != "assistant":
        raise invalid(
            "continue_final_message needs the last message to be the assistant's",
            param="continue_final_message",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **options.template_kwargs,
        )
    except Exception as error:  # the template rejected the conversation (raise_exception)
        raise invalid(f"messages cannot be rendered by the chat template: {error}") from error
    return list(tokenizer.encode(text, add_special_tokens=False))
