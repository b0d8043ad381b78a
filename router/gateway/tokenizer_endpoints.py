"""vLLM's utility endpoints on the HTTP gateway: ``POST /tokenize``, ``POST /detokenize`` and
``GET /version``, in the request and response shapes of vLLM's ``api_server`` (``protocol.py``'s
``TokenizeCompletionRequest`` / ``TokenizeChatRequest`` -> ``TokenizeResponse``,
``DetokenizeRequest`` -> ``DetokenizeResponse``, ``{"version": ...}``).

Life of a request: the bearer key is checked as on /v1/* (401) -> the body is read up to
``max_body_bytes`` (413) -> on a parser thread, ``model`` is checked (404) and the prompt
tokenized, or the ids decoded (400 naming the field) -> one JSON response. A chat is rendered
as /v1/chat/completions renders it (``chat.render_chat``, tools as ``tool_fields`` checks
them), so its ids are the ones a chat completion sends to the workers. None of this generates:
nothing here is counted in ``pdserve:requests_total``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from router.gateway.chat import (
    check_prompt_chars,
    check_text,
    checked_documents,
    parse_messages,
    render_chat,
    template_kwargs,
    template_options,
)
from router.gateway.errors import ApiError, invalid
from router.gateway.limits import RequestLimits
from router.gateway.openai_request import check_model, optional_field
from router.gateway.served_model import ServedModel
from router.gateway.service import Gateway
from router.gateway.tool_fields import checked_tools

logger = logging.getLogger(__name__)

DISTRIBUTION = "pdserve"  # the package name in pyproject.toml
# reads a request's JSON body, refusing one over the byte limit (http_app's reader)
JsonReader = Callable[[Request, int], Awaitable[Any]]
_Parse = Callable[[Any, ServedModel, RequestLimits], dict[str, Any]]


def add_tokenizer_routes(app: FastAPI, gateway: Gateway, read_json: JsonReader) -> None:
    """Registers /tokenize, /detokenize and /version on ``app``."""
    version = package_version()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _answer(gateway, request, read_json, tokenize_body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _answer(gateway, request, read_json, detokenize_body)

    @app.get("/version")
    async def show_version(request: Request) -> Response:
        gateway.authenticate(request.headers.get("authorization"), counted=False)
        return JSONResponse({"version": version})


async def _answer(
    gateway: Gateway, request: Request, read_json: JsonReader, parse: _Parse
) -> Response:
    """``parse``'s answer to the request's body, computed on a parser thread. Refusals are
    ApiErrors the app's handler turns into OpenAI's error shape; none is counted."""
    gateway.authenticate(request.headers.get("authorization"), counted=False)
    try:
        body = await read_json(request, gateway.limits.max_body_bytes)
        result = await gateway.parse(None, parse, body, gateway.model, gateway.limits)
    except ClientDisconnect:  # gone before it finished sending the body
        return Response(status_code=499)
    except ApiError:
        raise
    except Exception as error:  # an ApiError, so the app's catch-all does not count it failed
        logger.exception("%s failed", request.url.path)
        raise ApiError(500, f"internal error: {error}", "internal_error") from error
    return JSONResponse(result)


def tokenize_body(body: Any, model: ServedModel, limits: RequestLimits) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse`` to a tokenize body: the text form (``prompt``) or the chat
    form (``messages``); ApiError 400 / 404 naming the field otherwise."""
    body = _checked_body(body, model)
    return_token_strs = _flag(body, "return_token_strs", False)
    if body.get("prompt") is not None and body.get("messages") is not None:
        raise invalid("send either prompt (text) or messages (chat), not both", param="messages")
    if body.get("messages") is not None:
        token_ids = _chat_token_ids(body, model, limits)
    elif body.get("prompt") is not None:
        token_ids = _text_token_ids(body, model)
    else:
        raise invalid("prompt (a string) or messages (a chat) is required", param="prompt")
    token_strs = None
    if return_token_strs:
        token_strs = list(model.tokenizer.convert_ids_to_tokens(token_ids))
    return {
        "count": len(token_ids),
        "max_model_len": model.max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
    }


def _text_token_ids(body: dict[str, Any], model: ServedModel) -> list[int]:
    """The prompt as /v1/completions tokenizes it (special tokens added unless turned off)."""
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise invalid(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
    check_prompt_chars(len(check_text(prompt, "prompt")), "prompt", model.max_model_len)
    add_special_tokens = _flag(body, "add_special_tokens", True)
    return list(model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def _chat_token_ids(body: dict[str, Any], model: ServedModel, limits: RequestLimits) -> list[int]:
    """The conversation as /v1/chat/completions renders it: the same checks, template options
    and tools (handed to the template whatever else the request says, as chat does)."""
    if body.get("chat_template") is not None:
        raise invalid(
            "chat_template is not supported: this server applies the model's own chat "
            "template only",
            param="chat_template",
        )
    # "none": tools are rendered, and no tool choice (nor its parser) is asked for
    tools = checked_tools({"tools": body.get("tools"), "tool_choice": "none"})
    messages = parse_messages(body.get("messages"), limits, harmony=model.harmony)
    options = template_options(
        _flag(body, "add_generation_prompt", True),
        _flag(body, "continue_final_message", False),
        template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort")),
        tools.tools,
        checked_documents(body.get("documents"), limits),
    )
    add_special_tokens = _flag(body, "add_special_tokens", False)
    return render_chat(model.tokenizer, messages, options, add_special_tokens)


def detokenize_body(body: Any, model: ServedModel, limits: RequestLimits) -> dict[str, Any]:
    """vLLM's ``DetokenizeResponse``: the text of ``tokens``, special tokens included, as
    vLLM decodes them. Ids outside the vocabulary are a 400 naming ``tokens`` and the limit.
    The body's byte limit bounds how many there are."""
    body = _checked_body(body, model)
    tokens = body.get("tokens")
    if tokens is None:
        raise invalid("tokens (a list of token ids) is required", param="tokens")
    if not isinstance(tokens, list):
        raise invalid(
            f"tokens must be a list of token ids, got {type(tokens).__name__}", param="tokens"
        )
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int):
            raise invalid(
                f"tokens[{i}] must be an integer token id, got {type(token).__name__}",
                param="tokens",
            )
        if not 0 <= token < model.vocab_size:
            raise invalid(
                f"tokens[{i}] is {token}, outside this model's vocabulary: token ids must be "
                f"in [0, {model.vocab_size})",
                param="tokens",
            )
    return {"prompt": str(model.tokenizer.decode(tokens))}


def package_version() -> str:
    """pdserve's version: its installed metadata (an editable install has it too), else the
    ``pyproject.toml`` of the source tree it runs from, else "unknown"."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    return _source_version(Path(__file__).resolve().parents[2] / "pyproject.toml") or "unknown"


def _source_version(pyproject: Path) -> str | None:
    """``[project] version`` of ``pyproject`` when it is pdserve's; None otherwise."""
    if sys.version_info < (3, 11):  # no TOML reader in the standard library
        return None
    import tomllib

    try:
        with pyproject.open("rb") as file:
            project = tomllib.load(file).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    version = project.get("version")
    if project.get("name") != DISTRIBUTION or not isinstance(version, str):
        return None
    return version


def _checked_body(body: Any, model: ServedModel) -> dict[str, Any]:
    """``body`` as an object whose ``model``, when given, is the served one (404 otherwise, as
    /v1/completions answers)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_model(body, model)
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """``body[name]``, a boolean, or ``default`` when absent or null."""
    value: bool = optional_field(body, name, bool, default)
    return value
