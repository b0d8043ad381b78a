"""The gRPC API (``pdserve.v1.Generation``) end to end, through a client built from the stubs.

Greedy outputs are compared token for token with the offline ``engine.LLM`` on the same model;
long requests (abort, cancel, deadline) must leave the cluster idle afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from tests.gateway.conftest import API_KEYS, LIMITS, MODEL_NAME

pytestmark = pytest.mark.timeout(300)

ALICE = (("authorization", f"Bearer {API_KEYS[0]}"),)
BOB = (("authorization", f"Bearer {API_KEYS[1]}"),)
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog, and then"
PROMPT_TOKEN_IDS = [1, 17, 230, 45, 678, 99, 400, 12, 901, 33, 5, 64]
FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}
IDLE_TIMEOUT_S = 10.0
LONG_N = 4
LONG_MAX_TOKENS = 512 - len(PROMPT_TOKEN_IDS)


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Result:
    request_id: str
    samples: dict[int, Sample]
    usage: pb.Usage


@pytest.fixture(scope="module")
def llm(chat_model_dir: Path) -> LLM:
    return LLM(str(chat_model_dir), dtype="float32", device="cpu", block_size=8)


@pytest.fixture(scope="module")
def stub(gateway_server: GatewayServer) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(gateway_server.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


def collect(responses: Iterable[pb.GenerateResponse]) -> Result:
    """Read a whole Generate stream, checking its shape: Started, Chunks, then one Usage."""
    messages = list(responses)
    assert messages[0].WhichOneof("event") == "started", messages[0]
    assert messages[-1].WhichOneof("event") == "usage", messages[-1]
    samples: dict[int, Sample] = {}
    for message in messages[1:-1]:
        assert message.WhichOneof("event") == "chunk", message
        chunk = message.chunk
        sample = samples.setdefault(chunk.index, Sample())
        assert sample.finish_reason is None, f"sample {chunk.index} got a chunk after its last"
        sample.token_ids += chunk.token_ids
        sample.text += chunk.text
        sample.logprobs += chunk.logprobs
        sample.finish_reason = FINISH_NAMES.get(chunk.finish_reason)
    assert all(s.finish_reason is not None for s in samples.values())
    return Result(messages[0].started.request_id, samples, messages[-1].usage)


def generate(stub: pb_grpc.GenerationStub, metadata: Any = ALICE, **fields: Any) -> Result:
    return collect(stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=60))


def offline(llm: LLM, prompt: list[int], **params: Any) -> list[list[int]]:
    [output] = llm.generate([prompt], SamplingParams(**params))
    return [sample.token_ids for sample in output.outputs]


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def cluster_is_idle(server: GatewayServer) -> bool:
    statuses = server.gateway.backend.worker_statuses()
    return server.gateway.num_in_flight == 0 and all(
        s.load is not None and s.load.num_running == 0 and s.load.num_waiting == 0
        for s in statuses
        if s.alive
    )


def wait_for_idle(server: GatewayServer) -> None:
    wait_until(lambda: cluster_is_idle(server), IDLE_TIMEOUT_S, "the cluster to go idle")


def long_request() -> pb.GenerateRequest:
    """The longest request there is: 4 samples to the context length (the tiny model's 512).

    On 2 CPU cores it runs about 0.6 s: long enough to abort or cancel while it runs.
    """
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT_TOKEN_IDS),
        n=LONG_N,
        max_tokens=LONG_MAX_TOKENS,
        ignore_eos=True,
    )


def run_time(stub: pb_grpc.GenerationStub) -> float:
    """Seconds the long request takes to run to its end."""
    started = time.monotonic()
    collect(stub.Generate(long_request(), metadata=ALICE, timeout=60))
    return time.monotonic() - started


def num_aborted(server: GatewayServer) -> float:
    value = server.gateway.metrics.registry.get_sample_value(
        "pdserve:requests_total", {"status": "aborted"}
    )
    return value or 0.0


def wait_for_aborted(server: GatewayServer, before: float) -> None:
    """Wait until the gateway counted one more aborted request (its handler was cancelled)."""
    wait_until(lambda: num_aborted(server) == before + 1, IDLE_TIMEOUT_S, "the abort to count")


# ---------------------------------------------------------------- generation


def test_greedy_text_prompt_matches_offline_engine(
    stub: pb_grpc.GenerationStub, llm: LLM, served_model: ServedModel
) -> None:
    prompt = list(served_model.tokenizer.encode(PROMPT_TEXT))
    result = generate(stub, model=MODEL_NAME, text=PROMPT_TEXT, max_tokens=24, temperature=0)
    [expected] = offline(llm, prompt, temperature=0.0, max_tokens=24)
    [sample] = result.samples.values()
    assert sample.token_ids == expected
    assert sample.text == served_model.tokenizer.decode(expected, skip_special_tokens=True)
    assert sample.finish_reason == ("length" if len(expected) == 24 else "stop")
    assert result.request_id.startswith("gen-")
    assert result.usage.prompt_tokens == len(prompt)
    assert result.usage.completion_tokens == len(expected)


def test_greedy_token_id_prompt_matches_offline_engine(
    stub: pb_grpc.GenerationStub, llm: LLM, served_model: ServedModel
) -> None:
    result = generate(
        stub,
        token_ids=pb.TokenIds(ids=PROMPT_TOKEN_IDS),
        max_tokens=32,
        temperature=0,
        ignore_eos=True,
    )
    [expected] = offline(llm, PROMPT_TOKEN_IDS, temperature=0.0, max_tokens=32, ignore_eos=True)
    assert result.samples[0].token_ids == expected
    assert result.samples[0].text == served_model.tokenizer.decode(
        expected, skip_special_tokens=True
    )
    assert result.samples[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        len(PROMPT_TOKEN_IDS),
        32,
    )
    assert 0 <= result.usage.cached_tokens <= len(PROMPT_TOKEN_IDS)


def test_seeded_parallel_samples(stub: pb_grpc.GenerationStub, llm: LLM) -> None:
    fields: dict[str, Any] = {
        "token_ids": pb.TokenIds(ids=PROMPT_TOKEN_IDS),
        "n": 2,
        "seed": 1234,
        "temperature": 1.0,
        "max_tokens": 16,
        "ignore_eos": True,
    }
    first = generate(stub, **fields)
    second = generate(stub, **fields)
    assert sorted(first.samples) == [0, 1]
    assert [s.token_ids for s in first.samples.values()] == [
        s.token_ids for s in second.samples.values()
    ]
    expected = offline(
        llm, PROMPT_TOKEN_IDS, n=2, seed=1234, temperature=1.0, max_tokens=16, ignore_eos=True
    )
    assert [first.samples[i].token_ids for i in (0, 1)] == expected
    assert first.usage.completion_tokens == 32


def test_logprobs(stub: pb_grpc.GenerationStub, llm: LLM, served_model: ServedModel) -> None:
    result = generate(
        stub,
        token_ids=pb.TokenIds(ids=PROMPT_TOKEN_IDS),
        max_tokens=8,
        temperature=0,
        logprobs=3,
        ignore_eos=True,
    )
    [output] = llm.generate(
        [PROMPT_TOKEN_IDS],
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True),
    )
    expected = output.outputs[0]
    sample = result.samples[0]
    assert expected.logprobs is not None
    assert len(sample.logprobs) == len(sample.token_ids) == 8
    for token_id, entry, position in zip(sample.token_ids, sample.logprobs, expected.logprobs):
        assert entry.token_id == token_id
        assert entry.rank == 1  # greedy: the sampled token is the most likely one
        assert entry.text == served_model.tokenizer.decode([token_id])
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert len(entry.top) == 3
        assert entry.top[0].token_id == token_id
        assert [t.logprob for t in entry.top] == sorted(
            (t.logprob for t in entry.top), reverse=True
        )
        for top in entry.top:
            assert top.logprob == pytest.approx(position[top.token_id].logprob, abs=1e-4)


def test_prompt_logprobs_come_on_the_first_chunk_as_offline(
    stub: pb_grpc.GenerationStub, llm: LLM, served_model: ServedModel
) -> None:
    """Each prompt token from the second: its logprob, rank and the top 3, as the offline
    engine's prompt_logprobs; once, on the stream's first Chunk."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT_TOKEN_IDS), max_tokens=4, n=2, prompt_logprobs=3
    )
    messages = list(stub.Generate(request, metadata=ALICE, timeout=60))
    chunks = [m.chunk for m in messages if m.WhichOneof("event") == "chunk"]
    assert chunks[0].HasField("prompt_logprobs")
    assert not any(c.HasField("prompt_logprobs") for c in chunks[1:])
    [output] = llm.generate([PROMPT_TOKEN_IDS], SamplingParams(max_tokens=1, prompt_logprobs=3))
    assert output.prompt_logprobs is not None
    tokens = chunks[0].prompt_logprobs.tokens
    assert len(tokens) == len(PROMPT_TOKEN_IDS) - 1
    for entry, token_id, position in zip(tokens, PROMPT_TOKEN_IDS[1:], output.prompt_logprobs[1:]):
        assert position is not None
        assert entry.token_id == token_id
        assert entry.text == served_model.tokenizer.decode([token_id])
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert entry.rank == position[token_id].rank
        top = sorted((lp.rank, t) for t, lp in position.items() if lp.rank <= 3)
        assert [t.token_id for t in entry.top] == [t for _, t in top]
        for t in entry.top:
            assert t.logprob == pytest.approx(position[t.token_id].logprob, abs=1e-4)
            assert t.text == served_model.tokenizer.decode([t.token_id])
    plain = list(
        stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2), metadata=ALICE, timeout=60)
    )
    assert not any(m.chunk.HasField("prompt_logprobs") for m in plain)


@pytest.mark.parametrize("include", [False, True], ids=["trimmed", "include_stop_str_in_output"])
def test_a_stop_string_ends_the_text(stub: pb_grpc.GenerationStub, include: bool) -> None:
    """The stop string is trimmed from the text, or kept at its end with
    ``include_stop_str_in_output`` (what follows it is dropped either way)."""
    fields: dict[str, Any] = {
        "token_ids": pb.TokenIds(ids=PROMPT_TOKEN_IDS),
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = generate(stub, **fields).samples[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick another slice of {full!r}"
    if include:
        fields["include_stop_str_in_output"] = True
    result = generate(stub, stop=[stop], **fields)
    assert result.samples[0].text == full[: full.index(stop) + (len(stop) if include else 0)]
    assert result.samples[0].finish_reason == "stop"
    assert result.usage.completion_tokens == len(result.samples[0].token_ids) < 40


def test_truncated_prompt_generates_from_its_last_tokens(
    stub: pb_grpc.GenerationStub, llm: LLM, served_model: ServedModel
) -> None:
    """A prompt longer than the context is accepted once cut to fit (-1: the context less
    max_tokens); usage counts the tokens kept."""
    fields: dict[str, Any] = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    [expected] = offline(llm, PROMPT_TOKEN_IDS[-5:], temperature=0.0, max_tokens=8, ignore_eos=True)
    for prompt in ({"token_ids": pb.TokenIds(ids=PROMPT_TOKEN_IDS)}, {"text": PROMPT_TEXT}):
        result = generate(stub, truncate_prompt_tokens=5, **prompt, **fields)
        if "text" in prompt:
            [expected] = offline(
                llm,
                list(served_model.tokenizer.encode(PROMPT_TEXT))[-5:],
                temperature=0.0,
                max_tokens=8,
                ignore_eos=True,
            )
        assert result.samples[0].token_ids == expected
        assert result.usage.prompt_tokens == 5
    result = generate(
        stub, token_ids=pb.TokenIds(ids=TOO_LONG), truncate_prompt_tokens=-1, **fields
    )
    assert result.usage.prompt_tokens == 512 - 8
    assert len(result.samples[0].token_ids) == 8


def test_repeated_prompt_reports_cached_tokens(stub: pb_grpc.GenerationStub) -> None:
    prompt = list(range(100, 140))  # 5 full blocks of 8
    fields: dict[str, Any] = {"token_ids": pb.TokenIds(ids=prompt), "max_tokens": 2}
    generate(stub, **fields)
    again = generate(stub, **fields)
    assert again.usage.prompt_tokens == 40
    assert 0 < again.usage.cached_tokens < 40


# ---------------------------------------------------------------- abort, cancel, deadline


def test_abort_ends_the_stream_and_only_its_tenant_may_abort(
    stub: pb_grpc.GenerationStub, gateway_server: GatewayServer
) -> None:
    aborted_before = num_aborted(gateway_server)
    call = stub.Generate(long_request(), metadata=ALICE, timeout=60)
    first = next(call)
    request_id = first.started.request_id
    assert not stub.Abort(pb.AbortRequest(request_id=request_id), metadata=BOB).aborted
    assert not stub.Abort(pb.AbortRequest(request_id="gen-unknown"), metadata=ALICE).aborted
    assert stub.Abort(pb.AbortRequest(request_id=request_id), metadata=ALICE).aborted
    result = collect([first, *call])  # the stream ends normally, with every sample aborted
    assert sorted(result.samples) == list(range(LONG_N))
    assert {s.finish_reason for s in result.samples.values()} == {"abort"}
    num_tokens = sum(len(s.token_ids) for s in result.samples.values())
    assert result.usage.completion_tokens == num_tokens < LONG_N * LONG_MAX_TOKENS
    wait_for_aborted(gateway_server, aborted_before)
    wait_for_idle(gateway_server)
    assert not stub.Abort(pb.AbortRequest(request_id=request_id), metadata=ALICE).aborted


def test_cancelled_call_is_aborted_in_the_cluster(
    stub: pb_grpc.GenerationStub, gateway_server: GatewayServer
) -> None:
    aborted_before = num_aborted(gateway_server)
    call = stub.Generate(long_request(), metadata=ALICE, timeout=60)
    assert next(call).WhichOneof("event") == "started"
    assert next(call).WhichOneof("event") == "chunk"  # it runs in the cluster now
    call.cancel()
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    assert raised.value.code() == grpc.StatusCode.CANCELLED
    wait_for_aborted(gateway_server, aborted_before)
    wait_for_idle(gateway_server)


def test_deadline_expiry_aborts_the_request(
    stub: pb_grpc.GenerationStub, gateway_server: GatewayServer
) -> None:
    deadline_s = min(run_time(stub) for _ in range(2)) / 3  # inside its run on any host
    aborted_before = num_aborted(gateway_server)
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(long_request(), metadata=ALICE, timeout=deadline_s))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the handler was cancelled mid-run (not left to finish), and the cluster let go of it
    wait_for_aborted(gateway_server, aborted_before)
    wait_for_idle(gateway_server)


def test_overload_is_resource_exhausted_with_retry_after(
    stub: pb_grpc.GenerationStub, gateway_server: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = gateway_server.gateway
    monkeypatch.setattr(gateway, "limits", replace(gateway.limits, max_concurrent_requests=1))
    call = stub.Generate(long_request(), metadata=ALICE, timeout=60)
    request_id = next(call).started.request_id  # admitted: it holds the only slot
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=BOB, timeout=10))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "concurrent requests" in raised.value.details()
    assert ("retry-after", "1") in raised.value.trailing_metadata()
    assert stub.Abort(pb.AbortRequest(request_id=request_id), metadata=ALICE).aborted
    collect([pb.GenerateResponse(started=pb.Started(request_id=request_id)), *call])
    wait_for_idle(gateway_server)


# ---------------------------------------------------------------- auth, health, models


def test_health_needs_no_key(stub: pb_grpc.GenerationStub) -> None:
    health = stub.Health(pb.HealthRequest(), timeout=10)
    assert health.serving
    assert (health.num_prefill_workers, health.num_decode_workers) == (1, 1)


def test_list_models(stub: pb_grpc.GenerationStub, served_model: ServedModel) -> None:
    [model] = stub.ListModels(pb.ListModelsRequest(), metadata=BOB, timeout=10).models
    assert (model.name, model.max_model_len) == (MODEL_NAME, served_model.max_model_len)


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer sk-wrong"),), (("authorization", API_KEYS[0]),)],
    ids=["missing", "wrong", "no-bearer"],
)
def test_calls_without_a_valid_key_are_unauthenticated(
    stub: pb_grpc.GenerationStub, metadata: Any
) -> None:
    calls: list[Callable[[], object]] = [
        lambda: list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=metadata, timeout=10)),
        lambda: stub.Abort(pb.AbortRequest(request_id="gen-x"), metadata=metadata, timeout=10),
        lambda: stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in raised.value.details() or "Bearer" in raised.value.details()


def test_server_reflection_lists_the_service(gateway_server: GatewayServer) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(gateway_server.grpc_target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "pdserve.v1.Generation" in database.get_services()
        found = database.FindFileContainingSymbol("pdserve.v1.GenerateRequest")
        assert found.package == "pdserve.v1"


@pytest.mark.parametrize(
    "constraint",
    [{"logit_bias": {77: 100.0}}, {"allowed_token_ids": [40, 41, 300, 777]}],
    ids=["logit_bias", "allowed_token_ids"],
)
def test_logit_bias_and_allowed_token_ids_bind_every_token(
    stub: pb_grpc.GenerationStub, llm: LLM, constraint: dict[str, Any]
) -> None:
    common: dict[str, Any] = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    result = generate(stub, token_ids=pb.TokenIds(ids=PROMPT_TOKEN_IDS), **common, **constraint)
    [expected] = offline(llm, PROMPT_TOKEN_IDS, **common, **constraint)
    [free] = offline(llm, PROMPT_TOKEN_IDS, **common)
    assert result.samples[0].token_ids == expected != free
    if "logit_bias" in constraint:
        assert expected == [77] * 8
    else:
        assert set(expected) <= set(constraint["allowed_token_ids"])


def test_bad_words_are_tokenized_as_offline_and_never_completed(
    stub: pb_grpc.GenerationStub, llm: LLM
) -> None:
    assert llm.tokenizer is not None
    common: dict[str, Any] = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    [free] = offline(llm, PROMPT_TOKEN_IDS, **common)
    words = [llm.tokenizer.decode(free[:1]), llm.tokenizer.decode(free[3:5])]
    result = generate(stub, token_ids=pb.TokenIds(ids=PROMPT_TOKEN_IDS), **common, bad_words=words)
    [expected] = offline(llm, PROMPT_TOKEN_IDS, **common, bad_words=words)
    assert result.samples[0].token_ids == expected != free
    assert free[0] not in expected


# ---------------------------------------------------------------- bad input

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NAN = float("nan")
TOO_LONG = list(range(3, 3 + 512))  # max_model_len tokens: no room for one output token


def bad(case: str, names: str, code: grpc.StatusCode = INVALID, **fields: Any) -> Any:
    """A refused request: ``fields`` of GenerateRequest, the code, and what the details name."""
    return pytest.param(fields, code, names, id=case)


BAD_REQUESTS = [
    bad("unknown-model", "model", grpc.StatusCode.NOT_FOUND, model="gpt-9", text="hi"),
    bad("no-prompt", "prompt"),
    bad("empty-text", "text", text=""),
    bad("empty-token-ids", "token_ids", token_ids=pb.TokenIds()),
    bad("n-over-cap", "n must be", text="hi", n=LIMITS["max_n"] + 1),
    bad("logprobs-21", "logprobs", text="hi", logprobs=21),
    bad("logprobs-negative", "logprobs", text="hi", logprobs=-1),
    bad(
        "prompt-logprobs-21",
        "prompt_logprobs must be an integer in [0, 20], got 21",
        text="hi",
        prompt_logprobs=21,
    ),
    bad(
        "prompt-logprobs-minus-1",
        "prompt_logprobs must be an integer in [0, 20], got -1 (vLLM's -1",
        text="hi",
        prompt_logprobs=-1,
    ),
    bad(
        "prompt-logprobs-negative",
        "prompt_logprobs must be an integer in [0, 20], got -3",
        text="hi",
        prompt_logprobs=-3,
    ),
    bad(
        "priority-under-fcfs",
        "priority must be 0 on this server, got 1",
        text="hi",
        priority=1,
    ),
    bad("max-tokens-0", "max_tokens", text="hi", max_tokens=0),
    bad("max-tokens-negative", "max_tokens", text="hi", max_tokens=-5),
    bad("max-tokens-huge", "max_tokens", text="hi", max_tokens=2**31 - 1),
    bad("prompt-too-long", "token_ids", token_ids=pb.TokenIds(ids=TOO_LONG)),
    bad("too-many-stops", "stop", text="hi", stop=["a", "b", "c", "d", "e"]),
    bad("stop-too-long", "stop[0]", text="hi", stop=["x" * 257]),
    bad("token-out-of-vocab", "token_ids", token_ids=pb.TokenIds(ids=[1, 5000])),
    bad("negative-token-id", "token_ids", token_ids=pb.TokenIds(ids=[1, -3])),
    bad("stop-id-out-of-vocab", "stop_token_ids", text="hi", stop_token_ids=[99999]),
    bad("temperature-negative", "temperature", text="hi", temperature=-1.0),
    bad("top-p-zero", "top_p", text="hi", top_p=0.0),
    bad("min-over-max-tokens", "min_tokens", text="hi", max_tokens=4, min_tokens=8),
    bad("penalty-out-of-range", "presence_penalty", text="hi", presence_penalty=3.0),
    bad(
        "logit-bias-out-of-vocab",
        "logit_bias[5000] is outside the vocabulary [0, 1024)",
        text="hi",
        logit_bias={5: 1.0, 5000: 1.0},
    ),
    bad("logit-bias-negative-id", "logit_bias[-3]", text="hi", logit_bias={-3: 1.0}),
    bad(
        "logit-bias-over-100",
        "logit_bias[5] must be in [-100, 100], got 100.5",
        text="hi",
        logit_bias={5: 100.5},
    ),
    bad("logit-bias-nan", "logit_bias[5] must be in [-100, 100]", text="hi", logit_bias={5: NAN}),
    bad(
        "logit-bias-too-many",
        "logit_bias holds 1025 entries; at most 1024 are allowed",
        text="hi",
        logit_bias={i: 1.0 for i in range(1025)},
    ),
    bad(
        "allowed-out-of-vocab",
        "allowed_token_ids[1] is token id 5000, outside the vocabulary [0, 1024)",
        text="hi",
        allowed_token_ids=[5, 5000],
    ),
    bad("allowed-negative", "allowed_token_ids[0]", text="hi", allowed_token_ids=[-1]),
    bad(
        "bad-words-too-many",
        "bad_words holds 129 words; at most 128 are allowed",
        text="hi",
        bad_words=["a"] * 129,
    ),
    bad(
        "bad-words-too-long",
        "bad_words[0] is 257 characters; at most 256 are allowed",
        text="hi",
        bad_words=["x" * 257],
    ),
    bad(
        "bad-words-empty",
        "bad_words[1] ('') must encode to at least one token",
        text="hi",
        bad_words=["a", ""],
    ),
    bad(
        "bad-words-too-many-tokens",
        "at most 128 sequences and 1024 tokens are allowed",
        text="hi",
        bad_words=["x" * 200] * 10,
    ),
    bad(
        "truncate-0",
        "truncate_prompt_tokens must be >= 1, or -1 for the context less max_tokens; got 0",
        text="hi",
        truncate_prompt_tokens=0,
    ),
    bad(
        "truncate-negative",
        "truncate_prompt_tokens must be >= 1",
        text="hi",
        truncate_prompt_tokens=-2,
    ),
    bad(
        "truncate-beyond-context",
        "truncate_prompt_tokens must be <= 508 (the context length of 512 tokens less "
        "max_tokens (4)), got 509",
        text="hi",
        max_tokens=4,
        truncate_prompt_tokens=509,
    ),
]


@pytest.mark.parametrize(("fields", "code", "names"), BAD_REQUESTS)
def test_bad_request_is_refused_naming_the_field(
    stub: pb_grpc.GenerationStub, fields: dict[str, Any], code: grpc.StatusCode, names: str
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(pb.GenerateRequest(**fields), metadata=ALICE, timeout=10))
    assert raised.value.code() == code
    assert names in raised.value.details()


def test_well_formed_request_succeeds_after_bad_ones(stub: pb_grpc.GenerationStub) -> None:
    result = generate(stub, text="hi", max_tokens=3, ignore_eos=True)
    assert len(result.samples[0].token_ids) == 3
    assert result.samples[0].finish_reason == "length"


def test_requests_from_threads_run_concurrently(stub: pb_grpc.GenerationStub) -> None:
    results: dict[int, Result] = {}

    def run(i: int) -> None:
        results[i] = generate(
            stub, token_ids=pb.TokenIds(ids=[1, 10 + i, 20 + i]), max_tokens=8, ignore_eos=True
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results) == [0, 1, 2]
    assert len({r.request_id for r in results.values()}) == 3


def test_undecodable_requests_are_invalid_arguments(gateway_server: GatewayServer) -> None:
    """Bytes that are no GenerateRequest (a text field that is not UTF-8), or more than the
    server's limit, or no message of any method, get INVALID_ARGUMENT naming why (not UNKNOWN, nor RESOURCE_EXHAUSTED, which
    tells a client to retry), and the server serves the next call."""
    not_utf8 = bytes([2 << 3 | 2, 2, 0xFF, 0xFE])  # field 2 (text), length 2, invalid UTF-8
    too_large = pb.GenerateRequest(text="x" * (LIMITS["max_body_bytes"] + 1)).SerializeToString()
    with grpc.insecure_channel(gateway_server.grpc_target) as channel:
        generate_raw = channel.unary_stream(
            "/pdserve.v1.Generation/Generate",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        for raw, words in ((not_utf8, "not a valid GenerateRequest"), (too_large, "limit")):
            with pytest.raises(grpc.RpcError) as raised:
                list(generate_raw(raw, metadata=ALICE, timeout=10))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in raised.value.details()
        abort_raw = channel.unary_unary(
            "/pdserve.v1.Generation/Abort",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.AbortResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as raised:
            abort_raw(bytes([1 << 3 | 2, 1, 0xFF]), metadata=ALICE, timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for method, response in (
            ("Health", pb.HealthResponse),
            ("ListModels", pb.ListModelsResponse),
        ):
            call_raw = channel.unary_unary(  # a truncated varint: no message at all (was UNKNOWN)
                f"/pdserve.v1.Generation/{method}",
                request_serializer=lambda raw: raw,
                response_deserializer=response.FromString,
            )
            with pytest.raises(grpc.RpcError) as raised:
                call_raw(b"\x08", metadata=ALICE, timeout=10)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert f"not a valid {method}Request" in raised.value.details()
        served = generate(pb_grpc.GenerationStub(channel), text="hi", max_tokens=1)
        assert served.usage.completion_tokens == 1
