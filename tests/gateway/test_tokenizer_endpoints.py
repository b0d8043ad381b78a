"""vLLM's /tokenize, /detokenize and /version on the HTTP gateway: the text and chat forms give
the ids the tokenizer and the chat rendering give, which are the ones a completion or chat
completion sends to the workers and counts in ``usage.prompt_tokens``; ids decode back to the
text; bad fields are a 400 naming them; keys are asked as on /v1/*; none of it counts as a
generation request; and the tokenizer runs on the parser threads, never on the event loop.

The cluster here is a scripted ``GenerationBackend`` (it records the prompts it is sent); the
demo model's real tokenizer runs around it, made to add a BOS (so ``add_special_tokens`` shows)
and given a chat template that prints the tools and tool turns. The last tests run on the real
tiny-Llama cluster.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers.processors import TemplateProcessing

from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import INLINE_PARSE_MAX_BYTES, Gateway
from router.gateway.tokenizer_endpoints import _source_version, package_version
from tests.gateway.conftest import API_KEYS, MODEL_NAME
from tests.gateway.test_streams_on_a_scripted_cluster import _requests_by_status
from tests.gateway.token_script import (
    DEMO_MODEL,
    USER_HI,
    ScriptedCluster,
    bad_request_error,
    http_client,
    post_json,
)

pytestmark = pytest.mark.timeout(120)

TEMPLATE = (
    "{%- if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}Assistant calls:{% for call in message.tool_calls %} "
    "{{ call.function.name }}({{ call.function.arguments | tojson }}){% endfor %}"
    "{%- elif message.role == 'tool' %}Result of {{ message.tool_call_id }}: "
    "{{ message.content }}"
    "{%- else %}{{ message.role | capitalize }}: {{ message.content }}{% endif %}{{ '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}Assistant:{% endif %}"
    "{%- if greeting is defined %} {{ greeting }}{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_time"}},
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, 狐狸 🦊?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
]
TEXT = "def fibonacci(n):\n    return 狐狸 🦊"


@pytest.fixture(scope="module")
def model() -> ServedModel:
    """The demo model with this module's own tokenizer: it adds a BOS, renders TEMPLATE."""
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    tokenizer = served.tokenizer
    bos = (tokenizer.bos_token, tokenizer.bos_token_id)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos[0]} $A", special_tokens=[bos]
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.encode("warm-up")  # as ServedModel.load: settles its state before threads share it
    return served


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster([5, 6, 7])


@pytest.fixture
def http(cluster: ScriptedCluster, model: ServedModel) -> Iterator[httpx.Client]:
    with http_client(cluster, model) as client:
        yield client


def _rendered(model: ServedModel, messages: list[dict[str, Any]], **options: Any) -> str:
    """The conversation as the template renders it, tool-call arguments parsed as chat does."""
    messages = [dict(m, content=m["content"] or "") for m in copy.deepcopy(messages)]
    for message in messages:
        for call in message.get("tool_calls", ()):
            call["function"] = {**call["function"], "arguments": {"city": "Paris"}}
    return str(model.tokenizer.apply_chat_template(messages, tokenize=False, **options))


def test_the_text_form_is_the_completion_prompt(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    tokenized = post_json(http, "/tokenize", {"model": "pdserve-demo", "prompt": TEXT})
    expected = list(model.tokenizer.encode(TEXT))
    assert expected[0] == model.tokenizer.bos_token_id
    assert tokenized == {
        "count": len(expected),
        "max_model_len": model.max_model_len,
        "tokens": expected,
        "token_strs": None,  # vLLM's TokenizeResponse sends it null unless asked
    }
    completion = post_json(http, "/v1/completions", {"prompt": TEXT, "max_tokens": 2})
    assert cluster.prompts[-1] == expected
    assert completion["usage"]["prompt_tokens"] == tokenized["count"]


def test_the_text_form_without_special_tokens_and_with_token_strings(
    http: httpx.Client, model: ServedModel
) -> None:
    body = {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True}
    tokenized = post_json(http, "/tokenize", body)
    expected = list(model.tokenizer.encode(TEXT, add_special_tokens=False))
    assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)
    assert tokenized["token_strs"] == model.tokenizer.convert_ids_to_tokens(expected)


@pytest.mark.parametrize(
    "options",
    [{}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"greeting": "Hello"}}],
)
def test_the_chat_form_is_the_chat_completion_prompt(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel, options: dict[str, Any]
) -> None:
    """With tools, tool calls and results, template options: the ids a chat completion sends
    (``tool_choice: "none"`` still renders the tools) and counts."""
    body = {"messages": CONVERSATION, "tools": TOOLS, **options}
    tokenized = post_json(http, "/tokenize", body)
    kwargs = options.get("chat_template_kwargs", {})
    generation_prompt = options.get("add_generation_prompt", True)
    text = _rendered(
        model, CONVERSATION, tools=TOOLS, add_generation_prompt=generation_prompt, **kwargs
    )
    assert text.startswith("Tools: get_time get_weather\n") and "Result of call-1: sunny" in text
    expected = list(model.tokenizer.encode(text, add_special_tokens=False))
    assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)
    chat = post_json(http, "/v1/chat/completions", {**body, "tool_choice": "none", "max_tokens": 2})
    assert cluster.prompts[-1] == expected
    assert chat["usage"]["prompt_tokens"] == tokenized["count"]


def test_the_chat_form_continues_a_final_message_and_may_add_special_tokens(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    messages = [USER_HI, {"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokenized = post_json(http, "/tokenize", body)
    text = _rendered(model, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Assistant: Hel")
    assert tokenized["tokens"] == list(model.tokenizer.encode(text, add_special_tokens=False))
    post_json(http, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert cluster.prompts[-1] == tokenized["tokens"]
    with_bos = post_json(http, "/tokenize", {**body, "add_special_tokens": True})
    assert with_bos["tokens"] == [model.tokenizer.bos_token_id, *tokenized["tokens"]]


@pytest.mark.parametrize("text", [TEXT, "", "  two  spaces\n\ttab"])
def test_detokenize_gives_the_text_back(http: httpx.Client, model: ServedModel, text: str) -> None:
    token_ids = post_json(http, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert post_json(http, "/detokenize", {"tokens": token_ids["tokens"]}) == {"prompt": text}
    with_bos = post_json(http, "/tokenize", {"prompt": text})["tokens"]
    detokenized = post_json(http, "/detokenize", {"model": "pdserve-demo", "tokens": with_bos})
    assert detokenized["prompt"] == model.tokenizer.decode(with_bos)  # the BOS shown, as vLLM
    assert detokenized["prompt"] == model.tokenizer.bos_token + text


def test_version_is_the_package_version(http: httpx.Client) -> None:
    response = http.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": importlib.metadata.version("pdserve")}


def test_version_falls_back_on_the_source_trees_pyproject(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    repo_pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    version = _source_version(repo_pyproject)
    assert version is not None and package_version() == version
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "other"\nversion = "9.9"\n')
    assert _source_version(other) is None
    assert _source_version(tmp_path / "missing.toml") is None


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/tokenize", {}, "prompt", "is required"),
        ("/tokenize", {"prompt": 5}, "prompt", "must be a string"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "must be a string"),
        ("/tokenize", {"prompt": "a", "messages": [USER_HI]}, "messages", "not both"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "bool"),
        ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs", "boolean"),
        ("/tokenize", {"prompt": "a", "model": 3}, "model", "must be a string"),
        ("/tokenize", {"prompt": "x" * 20_000}, "prompt", "maximum context length"),
        ("/tokenize", {"messages": []}, "messages", "at least one"),
        ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "one"),
        (
            "/tokenize",
            {"messages": [USER_HI], "continue_final_message": True},
            "continue_final_message",
            "cannot both be true",
        ),
        (
            "/tokenize",
            {"messages": [USER_HI], "chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs",
            "may not set tools",
        ),
        ("/tokenize", {"messages": [USER_HI], "chat_template": "{{x}}"}, "chat_template", "own"),
        (
            "/tokenize",
            {"messages": [USER_HI], "tools": [{"function": {"name": "a b"}}]},
            "tools[0].function.name",
            "letters",
        ),
        ("/detokenize", {}, "tokens", "is required"),
        ("/detokenize", {"tokens": "1 2"}, "tokens", "must be a list"),
        ("/detokenize", {"tokens": [1, 2.5]}, "tokens", "tokens[1] must be an integer"),
        ("/detokenize", {"tokens": [True]}, "tokens", "tokens[0] must be an integer"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens", "[0, 4096)"),
        ("/detokenize", {"tokens": [4096]}, "tokens", "tokens[0] is 4096"),
        ("/detokenize", {"tokens": [10**30]}, "tokens", "[0, 4096)"),
    ],
)
def test_bad_fields_are_a_400_naming_them(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    error = bad_request_error(http.post(path, json=body))
    assert error["param"] == param
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"
    assert post_json(http, "/tokenize", {"prompt": "still up"})["count"] > 0


def test_bodies_that_are_not_objects_or_not_json_are_refused(http: httpx.Client) -> None:
    for path in ("/tokenize", "/detokenize"):
        assert bad_request_error(http.post(path, json=[1]))["param"] is None
        assert "not valid JSON" in bad_request_error(http.post(path, content=b"{"))["message"]
        too_large = http.post(path, content=b" " * (5 << 20))  # the default limit is 4 MiB
        assert too_large.status_code == 413, too_large.text


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_another_model_is_a_404(http: httpx.Client, path: str) -> None:
    response = http.post(path, json={"model": "gpt-4", "prompt": "a", "tokens": [1]})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["param"] == "model"


@contextlib.contextmanager
def _keyed_gateway(model: ServedModel) -> Iterator[tuple[Gateway, httpx.Client]]:
    keys = ApiKeys(["sk-test-0123456789"])
    gateway = Gateway(ScriptedCluster([5]), model, RequestLimits(model.max_model_len), keys)
    server = GatewayServer(gateway, "127.0.0.1", 0, None)
    server.start()
    try:
        with httpx.Client(base_url=server.http_url, timeout=30) as client:
            yield gateway, client
    finally:
        server.stop()


def test_keys_are_asked_and_nothing_counts_as_a_generation_request(model: ServedModel) -> None:
    key = {"Authorization": "Bearer sk-test-0123456789"}
    calls = [
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
        ("GET", "/version", None),
    ]
    with _keyed_gateway(model) as (gateway, http):
        for method, path, body in calls:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                response = http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
            assert http.request(method, path, json=body, headers=key).status_code == 200
        assert http.post("/tokenize", json={"prompt": 1}, headers=key).status_code == 400
        assert http.post("/detokenize", json={"model": "x"}, headers=key).status_code == 404
        assert _requests_by_status(gateway) == {}
        completion = http.post("/v1/completions", json={"prompt": "hi"}, headers=key)
        assert completion.status_code == 200  # while a generation request is counted
        assert _requests_by_status(gateway) == {"ok": 1.0}


class _ThreadRecordingTokenizer:
    """The model's tokenizer, noting the thread each encode, decode or render runs on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._tokenizer, name)
        if name not in ("encode", "decode", "apply_chat_template", "convert_ids_to_tokens"):
            return attribute

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            return attribute(*args, **kwargs)

        return recorded


def test_the_tokenizer_runs_on_the_parser_threads(model: ServedModel) -> None:
    tokenizer = _ThreadRecordingTokenizer(model.tokenizer)
    recorded = ServedModel(model.name, model.max_model_len, model.vocab_size, tokenizer)
    with http_client(ScriptedCluster([5]), recorded) as http:
        post_json(http, "/tokenize", {"prompt": "hi", "return_token_strs": True})
        post_json(http, "/tokenize", {"messages": [USER_HI]})
        post_json(http, "/detokenize", {"tokens": [1, 2]})
    assert len(tokenizer.threads) >= 5
    assert all(name.startswith("gateway-parse") for name in tokenizer.threads), tokenizer.threads


def test_a_small_completion_is_parsed_on_the_event_loop_a_large_one_on_a_parser_thread(
    model: ServedModel,
) -> None:
    """A body of a few KiB is parsed at once (a hand-off to a parser thread and back cost more
    than the parse); a larger one, which may take the tokenizer long, on a parser thread."""
    tokenizer = _ThreadRecordingTokenizer(model.tokenizer)
    recorded = ServedModel(model.name, model.max_model_len, model.vocab_size, tokenizer)
    large = "hi " * (INLINE_PARSE_MAX_BYTES // 3)
    with http_client(ScriptedCluster([5]), recorded) as http:
        post_json(http, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        small_threads = list(tokenizer.threads)
        tokenizer.threads.clear()
        http.post("/v1/completions", json={"prompt": large, "max_tokens": 1})
    assert small_threads and all(name == "gateway" for name in small_threads), small_threads
    assert tokenizer.threads, "the large prompt was never tokenized"
    assert tokenizer.threads[0].startswith("gateway-parse"), tokenizer.threads


# the real tiny-Llama cluster: the counts are the ones the workers were sent


@pytest.fixture(scope="module")
def keyed(gateway_server: GatewayServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
    with httpx.Client(base_url=gateway_server.http_url, headers=headers, timeout=60) as client:
        yield client


def test_counts_are_the_usage_of_the_real_clusters_requests(keyed: httpx.Client) -> None:
    prompt = "The quick brown fox 🦊 jumps"
    tokenized = post_json(keyed, "/tokenize", {"model": MODEL_NAME, "prompt": prompt})
    completion = post_json(keyed, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert completion["usage"]["prompt_tokens"] == tokenized["count"] > 0
    messages = [{"role": "system", "content": "Be brief."}, USER_HI]
    tokenized = post_json(keyed, "/tokenize", {"model": MODEL_NAME, "messages": messages})
    chat = post_json(keyed, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert chat["usage"]["prompt_tokens"] == tokenized["count"] > 0
    text = post_json(keyed, "/detokenize", {"tokens": tokenized["tokens"]})["prompt"]
    assert text == "System: Be brief.\nUser: hi\nAssistant:"


def test_the_real_gateway_asks_for_its_key(gateway_server: GatewayServer) -> None:
    with httpx.Client(base_url=gateway_server.http_url, timeout=30) as anonymous:
        assert anonymous.post("/tokenize", json={"prompt": "hi"}).status_code == 401
        assert anonymous.post("/detokenize", json={"tokens": [1]}).status_code == 401
        assert anonymous.get("/version").status_code == 401
        assert anonymous.get("/health").status_code == 200  # as before: no key needed
