"""The gRPC front door: ``pdserve.v1.Generation`` on grpc.aio, with server reflection.

Life of a Generate call: the ``authorization`` metadata names the caller's tenant (UNAUTHENTICATED)
-> the request is checked into a spec by the HTTP API's rules (INVALID_ARGUMENT / NOT_FOUND) ->
admission (UNAVAILABLE / RESOURCE_EXHAUSTED, with trailing ``retry-after``) -> ``Started`` with the
server's request id -> one ``Chunk`` per sample delta, so one per token, its text empty while text
is held back (the first carries the prompt's logprobs when they were asked for: they come with the
first token) -> ``Usage``. An Abort call ends the stream with FINISH_REASON_ABORT chunks; a client
that cancels, or whose deadline passes, has its handler cancelled by the gRPC runtime (or a write
under way fails on the ended call: counted aborted the same, not an internal error). Either way,
leaving the delta stream aborts the request in the cluster and frees its KV blocks. While the
server shuts down, new calls end UNAVAILABLE (with ``retry-after``) and Health says not serving; a
call still running when the drain ends is cut off: its FINISH_REASON_ABORT chunks, then UNAVAILABLE
saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.cluster import RequestFailedError
from router.gateway.auth import Caller
from router.gateway.errors import ApiError, cluster_failed, invalid, retry_headers
from router.gateway.grpc_messages import (
    aborted_message,
    chunk_message,
    generate_spec,
    started_message,
    usage_message,
    with_prompt_logprobs,
)
from router.gateway.openai_response import LogprobsFormatter, Usage
from router.gateway.service import Gateway, new_request_id
from router.gateway.spec import GenerationSpec
from router.gateway.text_stream import TextGeneration, merged_deltas

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdserve.v1.Generation"
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def build_grpc_server(gateway: Gateway, address: str) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server (not started) serving ``gateway`` on ``address``; and its bound port.

    Call it on the event loop that will run the server.
    """
    max_bytes = gateway.limits.max_body_bytes
    server = grpc.aio.server(
        options=[
            # up to twice the limit reaches _decoder, which refuses it as INVALID_ARGUMENT;
            # beyond that gRPC itself answers RESOURCE_EXHAUSTED
            ("grpc.max_receive_message_length", 2 * max_bytes),
            ("grpc.so_reuseport", 0),  # a second server on a taken port fails, not shares it
        ]
    )
    service = GenerationService(gateway)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=_decoder(pb.GenerateRequest, max_bytes),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            service.Abort,
            request_deserializer=_decoder(pb.AbortRequest, max_bytes),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "Health": grpc.unary_unary_rpc_method_handler(
            service.Health,
            request_deserializer=_decoder(pb.HealthRequest, max_bytes),
            response_serializer=pb.HealthResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels,
            request_deserializer=_decoder(pb.ListModelsRequest, max_bytes),
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    return server, port


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request whose bytes are no valid message, or too many: it reaches the method in place
    of the message, which answers INVALID_ARGUMENT naming the reason. (The generated decoder
    fails before the method runs, which a client sees as UNKNOWN.)"""

    reason: str


def _decoder(message: Any, max_bytes: int) -> Callable[[bytes], Any]:
    """Decodes ``message`` requests of at most ``max_bytes``, else gives an ``Undecodable``."""

    def decode(data: bytes) -> Any:
        if len(data) > max_bytes:
            return Undecodable(
                f"the request is {len(data)} bytes, larger than this server's limit of "
                f"{max_bytes} bytes"
            )
        try:
            return message.FromString(data)
        except DecodeError as error:  # e.g. a string field that is not UTF-8
            return Undecodable(f"the request is not a valid {message.DESCRIPTOR.name}: {error}")

    return decode


class GenerationService(pb_grpc.GenerationServicer):
    """The ``pdserve.v1.Generation`` methods over one ``Gateway`` (shared with HTTP)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(
        self, request: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> None:
        arrived_at = time.monotonic()  # TTFT and e2e include the parse and its thread's queue
        try:
            caller = self._caller(context)
            try:
                if isinstance(request, Undecodable):
                    raise invalid(request.reason)
                spec = await self.gateway.parse(
                    request.ByteSize(),
                    generate_spec,
                    request,
                    self.gateway.model,
                    self.gateway.limits,
                    caller,
                )
            except ApiError:
                self.gateway.count_invalid()
                raise
            except asyncio.CancelledError:  # the client left while its request was parsed
                self.gateway.record_outcome("aborted")  # as HTTP counts one that leaves then
                raise
            await self._generate(spec, caller, context, arrived_at)
        except RequestFailedError as error:  # as HTTP: 503, worth retrying
            self.gateway.record_outcome("failed")
            await _abort(context, cluster_failed(error))
        except ApiError as error:
            await _abort(context, error)
        except Exception as error:
            logger.exception("Generate failed")
            self.gateway.record_outcome("failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {error}")

    async def Abort(
        self, request: pb.AbortRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        caller = await self._checked_caller(context)  # not counted: no generation request
        if isinstance(request, Undecodable):
            await _abort(context, invalid(request.reason))
            raise AssertionError("not reached: abort raises")
        return pb.AbortResponse(aborted=self.gateway.abort(request.request_id, caller))

    async def Health(
        self, request: pb.HealthRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        if isinstance(request, Undecodable):
            await _abort(context, invalid(request.reason))
        backend = self.gateway.backend
        live_roles = [s.role for s in backend.worker_statuses() if s.alive]
        return pb.HealthResponse(
            serving=backend.is_ready() and not self.gateway.draining,
            num_prefill_workers=live_roles.count("prefill"),
            num_decode_workers=live_roles.count("decode"),
        )

    async def ListModels(
        self, request: pb.ListModelsRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        await self._checked_caller(context)  # not counted, as HTTP's /v1/models is not
        if isinstance(request, Undecodable):
            await _abort(context, invalid(request.reason))
        model = self.gateway.model
        return pb.ListModelsResponse(
            models=[
                pb.Model(name=model.name, max_model_len=model.max_model_len, created=model.created)
            ]
        )

    async def _generate(
        self,
        spec: GenerationSpec,
        caller: Caller,
        context: grpc.aio.ServicerContext,
        arrived_at: float,
    ) -> None:
        request_id = new_request_id("gen")
        with self.gateway.admitted(request_id, caller, [spec], [request_id]) as live:
            generation = self.gateway.generation(spec, request_id, arrived_at, live.forecasts[0])
            formatter = (
                LogprobsFormatter(self.gateway.model.tokenizer)
                if spec.params.logprobs is not None
                else None
            )
            unfinished = set(range(spec.params.n))
            num_sent_tokens = 0  # what usage reports, also when an Abort cut the run short
            first_chunk = _FirstChunk(generation, self.gateway.model.tokenizer)
            try:
                await context.write(started_message(request_id, self.gateway.model.name))
                deltas = merged_deltas([generation], live.aborted)
                async with contextlib.aclosing(deltas):  # aborts in the cluster on any exit
                    async for _, delta in deltas:
                        await context.write(first_chunk.apply(chunk_message(delta, formatter)))
                        num_sent_tokens += len(delta.token_ids)
                        if delta.finish_reason is not None:
                            unfinished.discard(delta.index)
            except asyncio.CancelledError:  # the client cancelled or its deadline passed
                self.gateway.record_outcome("aborted")
                raise
            except ApiError:  # the workers refused the request (text_stream.refused)
                self.gateway.count_invalid()
                raise
            except Exception:
                if not context.done():
                    raise
                # a write raced the client's cancel or its deadline: the call ended before the
                # handler was cancelled (grpc's write fails then); the client left, as above
                self.gateway.record_outcome("aborted")
                return
            # counted before the writes below, which may be cancelled
            self.gateway.record_ended([generation], live)
            try:
                for index in sorted(unfinished):
                    await context.write(first_chunk.apply(aborted_message(index)))
                if live.cut_off is not None:  # the server shut down before it finished
                    raise live.cut_off
                usage = Usage(
                    generation.num_prompt_tokens, num_sent_tokens, generation.num_cached_tokens
                )
                await context.write(usage_message(usage))
            except Exception:
                if not context.done():
                    raise
                # the client left after its last token (counted above): nothing to send it

    def _caller(self, context: grpc.aio.ServicerContext, *, counted: bool = True) -> Caller:
        """The caller the ``authorization`` metadata names; a refusal is counted in
        ``requests_total`` only when ``counted`` (Generate), as HTTP counts only generations."""
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = value
                break
        return self.gateway.authenticate(authorization, counted=counted)

    async def _checked_caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of a call that generates nothing (Abort, ListModels): not counted."""
        try:
            return self._caller(context, counted=False)
        except ApiError as error:
            await _abort(context, error)
            raise  # not reached: abort raises


class _FirstChunk:
    """Puts the prompt's logprobs, when asked for, on the first Chunk a stream sends."""

    def __init__(self, generation: TextGeneration, tokenizer: Any) -> None:
        self.generation = generation
        self.token_text = LogprobsFormatter(tokenizer).token_text
        self.pending = generation.spec.params.prompt_logprobs is not None

    def apply(self, message: pb.GenerateResponse) -> pb.GenerateResponse:
        if not self.pending:
            return message
        if self.generation.prompt_logprobs is None and message.chunk.finish_reason == (
            pb.FINISH_REASON_ABORT
        ):
            return message  # aborted before the first token: there are none to send
        self.pending = False
        return with_prompt_logprobs(message, self.generation.scored_prompt(), self.token_text)


async def _abort(context: grpc.aio.ServicerContext, error: ApiError) -> None:
    """End the call with the status code for ``error``; its message names the field."""
    code = _STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)
    metadata: tuple[tuple[str, str], ...] = ()
    if error.retry_after_s is not None:
        metadata = tuple(retry_headers(error.retry_after_s).items())
    await context.abort(code, error.message, metadata)
