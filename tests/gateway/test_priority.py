"""vLLM's request ``priority`` on both front doors, over a scripted cluster.

Under ``--scheduling-policy fcfs`` (the default) a priority other than 0 is refused with a 400
(gRPC: INVALID_ARGUMENT) naming the field and the flag it needs, as vLLM refuses it, and the
server serves on; under ``priority`` each prompt's job carries it to the cluster. Either way
it must be an integer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from engine.scheduler import SchedulingPolicy
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.service import Gateway
from tests.gateway.token_script import (
    USER_HI,
    ScriptedCluster,
    bad_request_error,
    both_doors,
    demo_model,  # noqa: F401 (the "model" fixture)
    post_json,
    script_answer,
    stream_chunks,
)

COMPLETION = ("/v1/completions", {"prompt": "Hello", "max_tokens": 4})
CHAT = ("/v1/chat/completions", {"messages": [USER_HI], "max_tokens": 4})


@dataclass
class Doors:
    cluster: ScriptedCluster
    http: httpx.Client
    grpc: pb_grpc.GenerationStub


def _doors(model: ServedModel, policy: SchedulingPolicy) -> Iterator[Doors]:
    cluster = ScriptedCluster()
    script_answer(cluster, model, "Hi there")
    limits = RequestLimits(max_model_len=model.max_model_len, scheduling_policy=policy)
    with both_doors(Gateway(cluster, model, limits, ApiKeys([]))) as (http, stub):
        yield Doors(cluster, http, stub)


@pytest.fixture(scope="module")
def fcfs(model: ServedModel) -> Iterator[Doors]:
    """A gateway over workers that serve in order of arrival (the default)."""
    yield from _doors(model, "fcfs")


@pytest.fixture(scope="module")
def by_priority(model: ServedModel) -> Iterator[Doors]:
    """A gateway over workers started with --scheduling-policy priority."""
    yield from _doors(model, "priority")


def _grpc_error(doors: Doors, **fields: Any) -> grpc.RpcError:
    request = pb.GenerateRequest(text="Hello", max_tokens=4, **fields)
    with pytest.raises(grpc.RpcError) as raised:
        list(doors.grpc.Generate(request, timeout=30))
    return raised.value


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("priority", [1, -1, 2.0])
def test_a_priority_under_fcfs_is_refused_naming_the_field_and_the_flag(
    fcfs: Doors, path: str, body: dict[str, Any], priority: float
) -> None:
    asked_before = len(fcfs.cluster.priorities)
    error = bad_request_error(fcfs.http.post(path, json={**body, "priority": priority}))
    assert error["param"] == "priority"
    assert error["message"].startswith(f"priority must be 0 on this server, got {int(priority)}")
    assert "--scheduling-policy priority" in error["message"]
    assert len(fcfs.cluster.priorities) == asked_before  # nothing reached the workers
    post_json(fcfs.http, path, body)  # the server serves on
    post_json(fcfs.http, path, {**body, "priority": 0})  # 0 (and null) is vLLM's default
    post_json(fcfs.http, path, {**body, "priority": None})
    assert fcfs.cluster.priorities[asked_before:] == [0, 0, 0]


def test_a_priority_under_fcfs_is_an_invalid_argument_on_grpc(fcfs: Doors) -> None:
    error = _grpc_error(fcfs, priority=3)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority must be 0 on this server, got 3" in str(error.details())
    assert "--scheduling-policy priority" in str(error.details())
    asked_before = len(fcfs.cluster.priorities)
    list(fcfs.grpc.Generate(pb.GenerateRequest(text="Hello", max_tokens=4), timeout=30))
    list(fcfs.grpc.Generate(pb.GenerateRequest(text="Hello", priority=0), timeout=30))
    assert fcfs.cluster.priorities[asked_before:] == [0, 0]


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("priority", ["1", True, 1.5, [1], {"level": 1}])
def test_a_priority_must_be_an_integer(
    fcfs: Doors, by_priority: Doors, path: str, body: dict[str, Any], priority: Any
) -> None:
    for doors in (fcfs, by_priority):
        error = bad_request_error(doors.http.post(path, json={**body, "priority": priority}))
        assert error["param"] == "priority"
        assert error["message"].startswith("priority must be an integer, got "), error


def test_a_priority_beyond_64_bits_is_refused(by_priority: Doors) -> None:
    path, body = COMPLETION
    for priority in (2**63, -(2**63) - 1):
        error = bad_request_error(by_priority.http.post(path, json={**body, "priority": priority}))
        assert error["param"] == "priority"
        assert "priority must fit in a signed 64-bit integer" in error["message"]
    post_json(by_priority.http, path, {**body, "priority": 2**63 - 1})
    post_json(by_priority.http, path, {**body, "priority": -(2**63)})
    assert by_priority.cluster.priorities[-2:] == [2**63 - 1, -(2**63)]


def test_under_priority_scheduling_every_prompt_goes_with_its_priority(
    by_priority: Doors,
) -> None:
    cluster, http = by_priority.cluster, by_priority.http
    asked_before = len(cluster.priorities)
    post_json(http, "/v1/completions", {"prompt": ["Hello", "Bye"], "priority": -5, "n": 2})
    post_json(http, "/v1/chat/completions", {"messages": [USER_HI], "priority": 7})
    stream_chunks(http, "/v1/chat/completions", {"messages": [USER_HI], "priority": 2.0})
    post_json(http, "/v1/completions", {"prompt": "Hello"})  # unset: 0
    assert cluster.priorities[asked_before:] == [-5, -5, 7, 2, 0]


def test_under_priority_scheduling_grpc_carries_the_priority(by_priority: Doors) -> None:
    cluster, stub = by_priority.cluster, by_priority.grpc
    asked_before = len(cluster.priorities)
    for priority in (-2, 2**31 - 1):
        list(stub.Generate(pb.GenerateRequest(text="Hello", priority=priority), timeout=30))
    list(stub.Generate(pb.GenerateRequest(text="Hello"), timeout=30))
    assert cluster.priorities[asked_before:] == [-2, 2**31 - 1, 0]
