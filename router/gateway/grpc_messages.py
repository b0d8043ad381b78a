"""``pdserve.v1`` protobuf messages to and from the gateway's own types: the gRPC edge.

A ``GenerateRequest`` becomes a ``GenerationSpec`` by the same rules (and error messages) as an
HTTP body, through ``make_spec``; sample deltas and usage become ``GenerateResponse`` messages.
Nothing protobuf goes further in than this module and ``grpc_service``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.sampling.messages import TokenLogprobs
from pdserve.v1 import generation_pb2 as pb
from router.gateway.auth import Caller
from router.gateway.chat import check_prompt_chars, check_text
from router.gateway.errors import ApiError, invalid
from router.gateway.limits import RequestLimits
from router.gateway.logit_fields import checked_bad_words
from router.gateway.openai_response import LogprobsFormatter, Usage
from router.gateway.prompt_logprobs import ScoredPrompt, TokenText
from router.gateway.served_model import ServedModel
from router.gateway.spec import GenerationSpec, make_spec
from router.gateway.structured_fields import grpc_structured_outputs
from router.gateway.text_stream import SampleDelta
from router.gateway.truncation import NAME as TRUNCATE
from router.gateway.truncation import checked_truncation, encode_truncated, keep_last

# GenerateRequest fields passed to SamplingParams under the same name when set
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
)
_FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def generate_spec(
    request: pb.GenerateRequest, model: ServedModel, limits: RequestLimits, caller: Caller
) -> GenerationSpec:
    """The checked job of a Generate call; ApiError (400, 404) names the field at fault."""
    if request.model and request.model != model.name:
        raise ApiError(
            404,
            f"the model {request.model!r} does not exist; this server serves {model.name!r}",
            param="model",
            code="model_not_found",
        )
    prompt_kind = request.WhichOneof("prompt")
    if prompt_kind is None:
        raise invalid("prompt is required: set text or token_ids", param="prompt")
    sampling: dict[str, Any] = {
        name: getattr(request, name) for name in _SAMPLING_FIELDS if request.HasField(name)
    }
    sampling.setdefault("max_tokens", None)  # unset: the context left
    truncate = request.truncate_prompt_tokens if request.HasField(TRUNCATE) else None
    keep = checked_truncation(truncate, sampling["max_tokens"], model.max_model_len)
    if prompt_kind == "text":
        prompt_token_ids = _encode(model, request.text, keep)
    else:
        prompt_token_ids = keep_last(request.token_ids.ids, keep)
    if request.stop_token_ids:
        sampling["stop_token_ids"] = list(request.stop_token_ids)
    if request.logit_bias:  # checked in make_spec, with the HTTP API's messages
        sampling["logit_bias"] = dict(request.logit_bias)
    if request.allowed_token_ids:
        sampling["allowed_token_ids"] = list(request.allowed_token_ids)
    if request.bad_words:
        sampling["bad_words_token_ids"] = checked_bad_words(
            list(request.bad_words), model.tokenizer, model.vocab_size
        )
    if request.HasField("structured_outputs"):
        sampling["structured_outputs"] = grpc_structured_outputs(request.structured_outputs)
    return make_spec(
        prompt_token_ids,
        sampling,
        list(request.stop),
        limits=limits,
        vocab_size=model.vocab_size,
        cache_salt=caller.tenant_salt,
        prompt_param=prompt_kind,
        include_stop_str_in_output=request.include_stop_str_in_output,
        priority=request.priority,
    )


def _encode(model: ServedModel, text: str, keep: int | None) -> list[int]:
    if not text:
        raise invalid("text must not be empty", param="text")
    check_text(text, "text")
    if keep is None:  # one to be truncated may be longer: the message size limit bounds it
        check_prompt_chars(len(text), "text", model.max_model_len)
    return encode_truncated(model.tokenizer, text, keep)


def started_message(request_id: str, model_name: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(started=pb.Started(request_id=request_id, model=model_name))


def chunk_message(delta: SampleDelta, formatter: LogprobsFormatter | None) -> pb.GenerateResponse:
    chunk = pb.Chunk(
        index=delta.index,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=_logprobs(delta.logprobs, formatter),
        finish_reason=_FINISH_REASONS[delta.finish_reason],
    )
    if isinstance(delta.stop_reason, str):
        chunk.stop_string = delta.stop_reason
    elif delta.stop_reason is not None:
        chunk.stop_token_id = delta.stop_reason
    return pb.GenerateResponse(chunk=chunk)


def with_prompt_logprobs(
    message: pb.GenerateResponse, prompt: ScoredPrompt, token_text: TokenText
) -> pb.GenerateResponse:
    """``message`` (a Chunk) carrying the prompt's logprobs, as the stream's first Chunk does."""
    message.chunk.prompt_logprobs.CopyFrom(
        pb.PromptLogprobs(
            tokens=[
                pb.TokenLogprob(
                    token_id=token_id,
                    text=token_text(token_id),
                    logprob=logprob,
                    rank=rank,
                    top=[
                        pb.TopLogprob(token_id=t, text=token_text(t), logprob=v)
                        for t, v in zip(top_ids, top_logprobs)
                    ],
                )
                for token_id, logprob, rank, top_ids, top_logprobs in zip(
                    prompt.logprobs.token_ids,
                    prompt.logprobs.logprobs,
                    prompt.logprobs.ranks,
                    prompt.logprobs.top_token_ids,
                    prompt.logprobs.top_logprobs,
                )
            ]
        )
    )
    return message


def aborted_message(sample_index: int) -> pb.GenerateResponse:
    """The last chunk of a sample that an Abort call cut short."""
    return pb.GenerateResponse(
        chunk=pb.Chunk(index=sample_index, finish_reason=pb.FINISH_REASON_ABORT)
    )


def usage_message(usage: Usage) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        usage=pb.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
        )
    )


def _logprobs(
    logprobs: Sequence[TokenLogprobs], formatter: LogprobsFormatter | None
) -> list[pb.TokenLogprob]:
    if formatter is None:
        return []
    return [
        pb.TokenLogprob(
            token_id=lp.sampled_token_id,
            text=formatter.token_text(lp.sampled_token_id),
            logprob=lp.sampled_logprob,
            rank=lp.sampled_rank,
            top=[
                pb.TopLogprob(token_id=t, text=formatter.token_text(t), logprob=v)
                for t, v in zip(lp.top_token_ids, lp.top_logprobs)
            ],
        )
        for lp in logprobs
    ]
