"""The OpenAI-compatible HTTP gateway (FastAPI): routes, auth, body limits, whole responses
(streamed ones: ``sse_stream``).

Life of an HTTP request: the body is read up to ``max_body_bytes`` (413 past it) -> the bearer
key names the caller's tenant (401) -> the JSON is parsed and bounds-checked into one spec per
prompt (400 / 404) -> admission (503 / 429) -> the prompts run on the cluster -> sample deltas
become one JSON response, or SSE chunks ending with ``data: [DONE]`` -> each prompt's first-token
trace is recorded (``Gateway.record_first_token``) once the first chunk after its first token is
written (a whole response: once it is complete). If the client goes away first, the requests
are aborted in the cluster and their KV blocks freed. While the server shuts down, new
generation requests get 503 with Retry-After and /health 503; a request still running when the
drain ends is cut off with a 503 error (streamed: the last event before ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from router.cluster import RequestFailedError
from router.gateway.beam_search import respond_beams
from router.gateway.choice_prompts import add_prompt_logprobs, shown
from router.gateway.dashboard import ASSETS, asset
from router.gateway.errors import (
    ApiError,
    cluster_failed,
    internal_error,
    invalid,
    retry_headers,
)
from router.gateway.openai_request import OpenAIJob, parse_job
from router.gateway.openai_response import (
    ChoiceText,
    Echo,
    LogprobsFormatter,
    ResponseHeader,
    output_decoder,
    total_usage,
)
from router.gateway.responses_output import ResponseEvents, new_item_id, response_body
from router.gateway.responses_request import parse_responses_job
from router.gateway.responses_store import ResponsesTurn
from router.gateway.service import FrontDoorStamps, Gateway, LiveRequest, new_request_id
from router.gateway.sse_stream import EventStreamResponse, event_stream
from router.gateway.text_stream import TextGeneration, merged_deltas
from router.gateway.tokenizer_endpoints import add_tokenizer_routes

logger = logging.getLogger(__name__)


def build_http_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app, gateway)

    @app.get("/health")
    async def health() -> Response:
        statuses = gateway.backend.worker_statuses()
        status = "ok" if gateway.backend.is_ready() else "unavailable"
        body = {
            "status": "shutting_down" if gateway.draining else status,
            "workers": {
                role: sum(1 for s in statuses if s.alive and s.role == role)
                for role in ("prefill", "decode")
            },
        }
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        gateway.authenticate(request.headers.get("authorization"), counted=False)
        return JSONResponse({"object": "list", "data": [_model_card(gateway)]})

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> Response:
        gateway.authenticate(request.headers.get("authorization"), counted=False)
        if name != gateway.model.name:
            raise ApiError(
                404, f"the model {name!r} does not exist", param="model", code="model_not_found"
            )
        return JSONResponse(_model_card(gateway))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # not counted: the dashboard's first poll, without its key, would count as a request
        gateway.authenticate(request.headers.get("authorization"), counted=False)
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return _dashboard_file("index.html")

    @app.get("/dashboard/{name}")
    async def dashboard_asset(name: str) -> Response:
        return _dashboard_file(name)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(gateway, request, "completion", time.monotonic())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(gateway, request, "chat", time.monotonic())

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _generate(gateway, request, "responses", time.monotonic())

    @app.get("/v1/responses/{response_id}")
    async def kept_response(response_id: str, request: Request) -> Response:
        caller = gateway.authenticate(request.headers.get("authorization"))
        stored = gateway.responses.get(caller.tenant_salt, response_id)
        if stored is None:
            raise ApiError(
                404,
                f"response {response_id!r} is not kept here for this API key (kept: the last "
                f"{gateway.responses.capacity}, with --responses-store-size)",
                "not_found_error",
                code="response_not_found",
            )
        return JSONResponse(stored.body)

    add_tokenizer_routes(app, gateway, _read_json)  # /tokenize, /detokenize, /version
    return app


def _model_card(gateway: Gateway) -> dict[str, Any]:
    return {
        "id": gateway.model.name,
        "object": "model",
        "created": gateway.model.created,
        "owned_by": "pdserve",
        "max_model_len": gateway.model.max_model_len,
        "quantization": gateway.model.quantization,  # None: float weights
        "kv_cache_dtype": gateway.model.kv_cache_dtype,  # fp8_e4m3 | int8 | the model's dtype
    }


def _dashboard_file(name: str) -> Response:
    """A static file of the dashboard. It holds no data (its script fetches /metrics with the
    API key), so it is served without one: a browser cannot send a bearer key on navigation."""
    if name not in ASSETS:
        raise ApiError(404, f"no dashboard file {name!r}", "not_found_error")
    return Response(asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


def _add_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> Response:
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> Response:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(error.status_code, str(error.detail), kind))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> Response:
        gateway.record_outcome("failed")
        return _error_response(ApiError(500, f"internal error: {error}", "internal_error"))


def _error_response(error: ApiError) -> Response:
    headers = {} if error.retry_after_s is None else retry_headers(error.retry_after_s)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _read_json(request: Request, max_bytes: int) -> Any:
    declared = _body_size(request)
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise invalid(f"the request body is not valid UTF-8 (byte {error.start})") from error
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, too many digits or levels
        raise invalid(f"the request body is not valid JSON: {error}") from error


def _body_size(request: Request) -> int | None:
    """The body's size in bytes as its Content-Length declares it (the server holds a body to
    it); None for a body sent in chunks."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413, f"the request body is larger than this server's limit of {max_bytes} bytes"
    )


async def _generate(
    gateway: Gateway,
    request: Request,
    kind: Literal["completion", "chat", "responses"],
    arrived_at: float,
) -> Response:
    """``arrived_at``: ``time.monotonic()`` at the route's entry, so that TTFT and e2e latency
    include reading the body, waiting for a parser thread and tokenizing."""
    caller = gateway.authenticate(request.headers.get("authorization"))
    try:
        body = await _read_json(request, gateway.limits.max_body_bytes)
        size = _body_size(request)
        turn = None
        if kind == "responses":  # read as the chat request it asks for
            job, turn = await gateway.parse(
                size,
                parse_responses_job,
                body,
                gateway.model,
                gateway.limits,
                caller,
                gateway.responses,
            )
        else:
            job = await gateway.parse(
                size, parse_job, kind, body, gateway.model, gateway.limits, caller
            )
    except ClientDisconnect:  # gone before it finished sending the body: not a server failure
        gateway.record_outcome("aborted")
        return Response(status_code=499)
    except ApiError:
        gateway.count_invalid()
        raise
    parsed_at = time.time()
    arrived_on_wall_clock = parsed_at - (time.monotonic() - arrived_at)
    if kind == "responses":
        request_id = new_item_id("resp")  # (OpenAI's form, resp_<hex>)
    else:
        request_id = new_request_id("chatcmpl" if kind == "chat" else "cmpl")
    header = ResponseHeader(request_id, int(time.time()), gateway.model.name)
    if job.beam_search is not None:  # (refused in a stream)
        return await respond_beams(gateway, job, header, caller, _client_disconnected(request))
    if job.stream:
        # admitted now, so that a refusal is still a status code; the stream gives the slot back
        admission = contextlib.ExitStack()
        live = admission.enter_context(gateway.admitted(header.id, caller, job.specs))
        front = FrontDoorStamps(arrived_on_wall_clock, parsed_at, time.time())
        generations = _generations(gateway, job, header, arrived_at, live)
        for generation in generations:  # placed while the response's headers go out
            generation.start()
            admission.callback(generation.close)  # (if the response never streams)
        shape = ResponseEvents(header.id, turn) if turn is not None else None
        events = event_stream(gateway, job, header, generations, live, shape)
        events = _recording_first_tokens(events, gateway, generations, front)
        return EventStreamResponse(events, on_close=admission.close, request_id=header.id)
    with gateway.admitted(header.id, caller, job.specs) as live:
        front = FrontDoorStamps(arrived_on_wall_clock, parsed_at, time.time())
        generations = _generations(gateway, job, header, arrived_at, live)
        return await _respond_whole(gateway, request, job, header, generations, live, front, turn)


async def _recording_first_tokens(
    events: AsyncGenerator[bytes, None],
    gateway: Gateway,
    generations: list[TextGeneration],
    front: FrontDoorStamps,
) -> AsyncGenerator[bytes, None]:
    """Yields ``events``; each prompt's first-token trace is recorded once an event has been
    written (handed to the connection) after the prompt's first token came: that write is the
    trace's last stamp."""
    unrecorded = list(generations)
    async with contextlib.aclosing(events):
        async for event in events:
            yield event  # returns once the event is written
            if unrecorded:
                written_at = time.time()
                unrecorded = [
                    generation
                    for generation in unrecorded
                    if not gateway.record_first_token(generation, front, written_at)
                ]


def _generations(
    gateway: Gateway,
    job: OpenAIJob,
    header: ResponseHeader,
    arrived_at: float,
    live: LiveRequest,
) -> list[TextGeneration]:
    return [
        gateway.generation(spec, f"{header.id}-{i}", arrived_at, forecast)
        for i, (spec, forecast) in enumerate(zip(job.specs, live.forecasts, strict=True))
    ]


async def _respond_whole(
    gateway: Gateway,
    request: Request,
    job: OpenAIJob,
    header: ResponseHeader,
    generations: list[TextGeneration],
    live: LiveRequest,
    front: FrontDoorStamps,
    responses_turn: ResponsesTurn | None = None,
) -> Response:
    """``responses_turn``: a /v1/responses request, whose response this chat job's makes;
    None: the job's own response."""
    echo = Echo(job.echo_texts, job.n)
    choices = [ChoiceText(echo.first(i)) for i in range(len(generations) * job.n)]

    async def collect() -> None:
        deltas = merged_deltas(generations, live.aborted)
        async with contextlib.aclosing(deltas):  # aborts in the cluster on any exit
            async for index, delta in deltas:
                choices[index * job.n + delta.index].add(shown(job, delta))
        formatter = LogprobsFormatter(gateway.model.tokenizer, job.tokens_as_ids)
        add_prompt_logprobs(job, choices, generations, formatter, live.aborted.is_set())

    task = asyncio.create_task(collect())
    client_gone = asyncio.create_task(_client_disconnected(request))
    try:
        await asyncio.wait({task, client_gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_gone.cancel()
    if not task.done():  # the client left while we generated: abort and stop
        task.cancel()
        gateway.record_outcome("aborted")
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    try:
        task.result()
    except RequestFailedError as error:
        gateway.record_outcome("failed")
        raise cluster_failed(error) from error
    except ApiError:  # the workers refused the request (text_stream.refused)
        gateway.count_invalid()
        raise
    except Exception as error:  # a 500 as an ApiError: uvicorn then keeps the connection open
        logger.exception("request %s failed", header.id)
        gateway.record_outcome("failed")
        raise internal_error(error) from error
    if live.cut_off is not None:  # the server shut down before it finished
        gateway.record_outcome("aborted")
        raise live.cut_off
    if live.aborted.is_set():  # an Abort call cut it short: what was generated, as gRPC sends
        for choice in choices:
            choice.finish_reason = choice.finish_reason or "abort"
    for generation in generations:
        gateway.record_first_token(generation, front, written_at=None)
    gateway.record_ended(generations, live)
    usage = total_usage(generations)
    decode = output_decoder(generations[0])
    body = job.response_body(header, choices, usage, gateway.model.tokenizer, decode)
    if responses_turn is not None:
        body = response_body(header.id, responses_turn, body)
    # the response's id in X-Request-Id, as OpenAI sends (openai's client reads _request_id)
    return JSONResponse(body, headers={"X-Request-Id": header.id})


async def _client_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
