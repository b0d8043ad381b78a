"""gpt-oss's harmony replies read as chat messages (``--reasoning-parser openai_gptoss``, a
gpt_oss model's default, and ``--tool-call-parser openai``): the analysis channel as
``reasoning``, the final channel and commentary preambles as ``content``, messages to
``functions.NAME`` as tool calls; whole and streamed alike, split at any point.

The cluster is a scripted ``GenerationBackend`` answering the tokens a test chooses; the demo
model's byte-level BPE tokenizer runs around it, with harmony's tags added as special tokens,
as gpt-oss's tokenizer has them.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.gateway.harmony import FINAL_START, HARMONY_PARSER, read_harmony
from router.gateway.reasoning import ReasoningMode, num_thought_tokens
from router.gateway.served_model import ServedModel
from router.gateway.tool_calls import AutoToolCalls, ChatDeltas, ToolCallMode, chat_message
from tests.fixtures.tiny_models import tiny_hf_config
from tests.gateway.token_script import (
    DEMO_MODEL,
    USER_HI,
    ScriptedCluster,
    bad_request_error,
    http_client,
    post_json,
    stream_chunks,
)

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
TAGS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
THOUGHT = "The user asks for the weather. I should call get_weather."
ANSWER = "It is sunny in Paris."
ARGUMENTS = '{"city": "Paris"}'
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
FINAL = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    f"<|message|>{ARGUMENTS}"
)
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def model() -> ServedModel:
    """The demo model served as gpt-oss is: harmony's tags special tokens, its replies read as
    harmony, its calls returned under tool_choice "auto"."""
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    served.tokenizer.add_special_tokens({"additional_special_tokens": TAGS})
    return dataclasses.replace(served, reasoning_parser=HARMONY_PARSER, tool_call_parser="openai")


@pytest.fixture(scope="module")
def http(cluster: ScriptedCluster, model: ServedModel) -> Iterator[httpx.Client]:
    with http_client(cluster, model) as client:
        yield client


def _script(cluster: ScriptedCluster, model: ServedModel, text: str, stop: bool = True) -> None:
    """Script ``text`` as gpt-oss's tokens (each tag one special token), ended by a stop token
    (``<|call|>``, as gpt-oss's generation config lists it) or by max_tokens."""
    tokens = list(model.tokenizer.encode(text))
    call = model.tokenizer.convert_tokens_to_ids("<|call|>")
    cluster.tokens = [*tokens, call] if stop else tokens
    cluster.finish_reason = "stop" if stop else "length"


def _chat(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    return post_json(http, CHAT, {"messages": [USER_HI], **fields})


def _stream(http: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    return stream_chunks(http, CHAT, {"messages": [USER_HI], **fields})


@dataclasses.dataclass
class _Streamed:
    """One choice's stream put together as a client does."""

    reasoning: str | None  # None: no reasoning delta came
    content: str
    calls: list[tuple[str, str]]  # (name, arguments) each
    finish_reason: str | None


def _streamed(chunks: list[dict[str, Any]], index: int = 0) -> _Streamed:
    reasoning: str | None = None
    content, calls, finish_reason = "", [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            if "reasoning" in delta:
                reasoning = (reasoning or "") + delta["reasoning"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(calls) and call["type"] == "function"
                    calls.append([call["function"]["name"], ""])
                calls[call["index"]][1] += call["function"]["arguments"]
            finish_reason = choice["finish_reason"] or finish_reason
    return _Streamed(reasoning, content, [(n, a) for n, a in calls], finish_reason)


def _expected_stream(message: dict[str, Any], finish_reason: str | None) -> _Streamed:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    return _Streamed(message["reasoning"], message["content"] or "", calls, finish_reason)


# ---------------------------------------------------------------- the reply, whole


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "calls"),
    [
        (ANALYSIS + FINAL, THOUGHT, ANSWER, []),
        (ANALYSIS + CALL, THOUGHT, None, [("get_weather", ARGUMENTS)]),
        # the recipient before the channel, and a preamble shown to the user
        (
            ANALYSIS + PREAMBLE + "<|start|>assistant to=functions.get_weather<|channel|>"
            f"commentary json<|message|>{ARGUMENTS}",
            THOUGHT,
            "Let me look.",
            [("get_weather", ARGUMENTS)],
        ),
        # two calls, then a second analysis and the final answer: messages of a kind joined
        (
            f"{ANALYSIS}{CALL}<|end|>{CALL}<|end|>{ANALYSIS}{FINAL}",
            f"{THOUGHT}\n{THOUGHT}",
            ANSWER,
            [("get_weather", ARGUMENTS)] * 2,
        ),
        # cut in the analysis; cut in a header (nothing of it shown)
        (f"<|channel|>analysis<|message|>{THOUGHT}", THOUGHT, None, []),
        (f"{ANALYSIS}<|start|>assistant<|channel|>fin", THOUGHT, None, []),
        ("", None, None, []),
        # a channel tag inside a body starts an assistant message; a tool's reply is dropped,
        # as is a built-in tool's call and text between messages
        (f"<|channel|>analysis<|message|>a<|channel|>final<|message|>{ANSWER}", "a", ANSWER, []),
        (
            f"{ANALYSIS}\n<|start|>functions.get_weather to=assistant<|channel|>commentary"
            f"<|message|>sunny<|end|><|start|>assistant<|channel|>commentary to=browser.search"
            f"<|message|>x<|end|>{FINAL}",
            THOUGHT,
            ANSWER,
            [],
        ),
    ],
)
def test_a_reply_is_read_message_by_message(
    text: str, reasoning: str | None, content: str | None, calls: list[tuple[str, str]]
) -> None:
    reply = read_harmony(text)
    assert (reply.reasoning, reply.content, reply.calls) == (reasoning, content, calls)
    tools: ToolCallMode = AutoToolCalls("openai")
    message, finish_reason = chat_message(text, "stop", tools, ReasoningMode(HARMONY_PARSER))
    assert (message["reasoning"], message["content"]) == (reasoning, content)
    names = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert names == calls
    assert finish_reason == ("tool_calls" if calls else "stop")
    # without "auto", the calls are dropped (vLLM's reply without its openai tool parser)
    plain, _ = chat_message(text, "stop", None, ReasoningMode(HARMONY_PARSER))
    assert plain == {"role": "assistant", "content": content, "reasoning": reasoning}


_TEXTS = [
    ANALYSIS + FINAL,
    ANALYSIS + PREAMBLE + CALL + "<|end|>" + CALL,
    f"<|channel|>analysis<|message|>a<|channel|>final<|message|>b<|end|>x{FINAL}",
    f"{ANALYSIS}<|start|>assistant<|channel|>fin",
    f"{ANALYSIS}<|start|>assistant<|chan",  # a tag that never completes is header text
    "<|channel|>final<|message|>1 <| 2 <|e",  # ... or body text
]


@pytest.mark.parametrize("text", _TEXTS)
@pytest.mark.parametrize("tools", [AutoToolCalls("openai"), None])
def test_any_split_of_the_text_streams_what_the_whole_text_holds(
    text: str, tools: ToolCallMode | None
) -> None:
    """Two deltas, split at every point, then one per character: the reasoning, content and
    calls of the whole response, no tag shown."""
    mode = ReasoningMode(HARMONY_PARSER)
    for finish in ("stop", "length"):
        message, finish_reason = chat_message(text, finish, tools, mode)
        message.setdefault("tool_calls", [])
        expected = _expected_stream(message, finish_reason)
        splits = [[text[:at], text[at:]] for at in range(len(text) + 1)] + [list(text)]
        for pieces in splits:
            deltas = ChatDeltas(tools, mode)
            chunks = []
            for i, piece in enumerate(pieces):
                delta, shown = deltas.delta(0, piece, finish if i == len(pieces) - 1 else None)
                shown_text = delta.get("reasoning", "") + delta.get("content", "")
                assert not any(tag in shown_text for tag in TAGS), pieces
                chunks.append({"choices": [{"index": 0, "delta": delta, "finish_reason": shown}]})
            assert _streamed(chunks) == expected, pieces


def test_a_call_cut_by_max_tokens_finishes_with_length() -> None:
    mode, tools = ReasoningMode(HARMONY_PARSER), AutoToolCalls("openai")
    message, finish_reason = chat_message(ANALYSIS + CALL, "length", tools, mode)
    assert message["tool_calls"][0]["function"]["arguments"] == ARGUMENTS
    assert finish_reason == "length"
    message, finish_reason = chat_message(ANALYSIS + CALL + "<|end|>", "length", tools, mode)
    assert finish_reason == "tool_calls"


# ---------------------------------------------------------------- over HTTP


def test_the_analysis_is_reasoning_and_the_final_answer_content(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    _script(cluster, model, ANALYSIS + FINAL)
    body = _chat(http)
    (whole,) = body["choices"]
    assert whole["message"] == {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT}
    assert whole["finish_reason"] == "stop"
    assert cluster.params[-1].skip_special_tokens is False  # the tags stay in the text read
    # the analysis message's tokens, its tags in, are the reasoning's
    analysis_tokens = len(model.tokenizer.encode(ANALYSIS))
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": analysis_tokens}
    chunks = _stream(http, stream_options={"include_usage": True})
    assert _streamed(chunks) == _Streamed(THOUGHT, ANSWER, [], "stop")
    usage = chunks[-1]["usage"]["completion_tokens_details"]
    assert usage == {"reasoning_tokens": analysis_tokens}
    # include_reasoning false: no reasoning, no reasoning deltas
    (hidden,) = _chat(http, include_reasoning=False)["choices"]
    assert hidden["message"] == {"role": "assistant", "content": ANSWER, "reasoning": None}
    streamed = _streamed(_stream(http, include_reasoning=False))
    assert streamed == _Streamed(None, ANSWER, [], "stop")


def test_auto_tool_choice_returns_the_calls_gpt_oss_makes(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    _script(cluster, model, ANALYSIS + PREAMBLE + CALL)
    (whole,) = _chat(http, tools=TOOLS)["choices"]
    message = whole["message"]
    assert (message["reasoning"], message["content"]) == (THOUGHT, "Let me look.")
    (call,) = message["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    assert whole["finish_reason"] == "tool_calls"
    streamed = _streamed(_stream(http, tools=TOOLS))
    assert streamed == _Streamed(
        THOUGHT, "Let me look.", [("get_weather", ARGUMENTS)], "tool_calls"
    )
    # tool_choice "none": the call is not returned (as vLLM without its tool parser)
    (plain,) = _chat(http, tools=TOOLS, tool_choice="none")["choices"]
    assert plain["message"] == {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning": THOUGHT,
    }


def test_a_constraint_starts_after_the_final_answers_header(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """As vLLM's gpt-oss reasoning parser ends the reasoning: the analysis and the header are
    free, the final answer constrained."""
    _script(cluster, model, ANALYSIS + "<|start|>assistant<|channel|>final<|message|>{}")
    end = tuple(model.tokenizer.encode(FINAL_START, add_special_tokens=False))
    assert len(end) == 3  # <|channel|>, "final", <|message|>
    (whole,) = _chat(http, response_format={"type": "json_object"})["choices"]
    spec = cluster.params[-1].structured_outputs
    assert spec is not None and spec.after_token_ids == end
    assert whole["message"]["content"] == "{}"
    # a named tool_choice: the final answer is the call's arguments
    named = {"type": "function", "function": {"name": "get_weather"}}
    (forced,) = _chat(http, tools=TOOLS, tool_choice=named)["choices"]
    assert [c["function"] for c in forced["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": "{}"}
    ]
    # "required": the final answer is the calls' array, streamed as calls too
    array = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    _script(cluster, model, ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + array)
    (required,) = _chat(http, tools=TOOLS, tool_choice="required")["choices"]
    assert required["message"]["reasoning"] == THOUGHT
    assert [c["function"] for c in required["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": ARGUMENTS}
    ]
    streamed = _streamed(_stream(http, tools=TOOLS, tool_choice="required"))
    assert streamed == _Streamed(THOUGHT, "", [("get_weather", ARGUMENTS)], "tool_calls")


def test_reasoning_effort_and_earlier_reasoning_reach_the_template(
    cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM's ``reasoning_effort`` is a template variable (gpt-oss's template writes it into
    the system message), with enable_thinking false for "none" unless the kwargs set it; an
    assistant message's ``reasoning`` (or ``reasoning_content``) reaches it as ``reasoning``,
    ``reasoning_content`` and ``thinking`` (gpt-oss's template's name)."""
    template = (
        "effort={{ reasoning_effort | default('unset') }} thinking={{ enable_thinking | "
        "default('unset') }}{% for m in messages %}|{{ m.role }}:{{ m.content }}"
        "{% if m.thinking is defined %}/{{ m.thinking }}/{{ m.reasoning }}/"
        "{{ m.reasoning_content }}{% endif %}{% endfor %}"
    )
    tokenizer = model.tokenizer
    templated = dataclasses.replace(model, tokenizer=_with_template(tokenizer, template))
    _script(cluster, model, ANALYSIS + FINAL)
    earlier = {"role": "assistant", "content": "Hello.", "reasoning": "Greet back."}
    old_name = {"role": "assistant", "content": "Hi.", "reasoning_content": "Again."}
    with http_client(cluster, templated) as http:
        for fields, shown in [
            ({}, "effort=unset thinking=unset"),
            ({"reasoning_effort": "low"}, "effort=low thinking=True"),
            ({"reasoning_effort": "none"}, "effort=none thinking=False"),
            (
                {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
                "effort=high thinking=False",
            ),
        ]:
            _chat(http, messages=[USER_HI, earlier, old_name, USER_HI], **fields)
            prompt = tokenizer.decode(cluster.prompts[-1])
            assert prompt.startswith(shown), prompt
            assert "|assistant:Hello./Greet back./Greet back./Greet back." in prompt
            assert "|assistant:Hi./Again./Again./Again.|user:hi" in prompt
        # calls, content and reasoning: the content (a preamble) dropped, as gpt-oss's
        # template refuses it beside the reasoning
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        both = {**earlier, "tool_calls": [call]}
        alone = {**earlier, "content": "", "tool_calls": [call]}
        calls = "|assistant:/Greet back./Greet back./Greet back.|tool:1"
        for message, shown in [(both, calls), (alone, calls)]:
            _chat(
                http,
                messages=[USER_HI, message, {"role": "tool", "content": "1", "tool_call_id": "c1"}],
            )
            assert shown in tokenizer.decode(cluster.prompts[-1])
        error = bad_request_error(
            http.post(CHAT, json={"messages": [USER_HI], "reasoning_effort": "big"})
        )
        assert error["param"] == "reasoning_effort" and "low, medium, high" in error["message"]
        bad = {"role": "assistant", "content": "x", "reasoning": 3}
        error = bad_request_error(http.post(CHAT, json={"messages": [USER_HI, bad]}))
        assert error["param"] == "messages[1].reasoning"


def _with_template(tokenizer: Any, template: str) -> Any:
    copied = tokenizer.__class__.from_pretrained(str(DEMO_MODEL))
    copied.add_special_tokens({"additional_special_tokens": TAGS})
    copied.chat_template = template
    assert copied.convert_tokens_to_ids(TAGS) == tokenizer.convert_tokens_to_ids(TAGS)
    return copied


# ---------------------------------------------------------------- serving gpt-oss


def test_a_gpt_oss_model_is_read_as_harmony_unless_told_otherwise(tmp_path: Path) -> None:
    model_dir = tmp_path / "gpt-oss"
    shutil.copytree(DEMO_MODEL, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    tiny_hf_config("GptOssForCausalLM").save_pretrained(model_dir)
    served = ServedModel.load(str(model_dir), None, None)
    assert served.reasoning_parser == HARMONY_PARSER
    assert served.reasoning_end_token_ids == tuple(
        served.tokenizer.encode(FINAL_START, add_special_tokens=False)
    )
    with_tools = ServedModel.load(str(model_dir), None, None, tool_call_parser="openai")
    assert with_tools.tool_call_parser == "openai"
    told = ServedModel.load(str(model_dir), None, None, reasoning_parser="deepseek_r1")
    assert told.reasoning_parser == "deepseek_r1"
    # the demo (a llama) is not read as harmony, and its calls cannot be read as gpt-oss's
    assert ServedModel.load(str(DEMO_MODEL), None, None).reasoning_parser is None
    with pytest.raises(
        ValueError, match="--tool-call-parser openai .* --reasoning-parser openai_gptoss"
    ):
        ServedModel.load(str(DEMO_MODEL), None, None, tool_call_parser="openai")


def test_reasoning_tokens_count_every_analysis_message() -> None:
    """Each analysis message's tokens from its start tag to its end tag, decoded as the
    stream decodes them; none of the final answer's."""
    served = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    served.tokenizer.add_special_tokens({"additional_special_tokens": TAGS})
    text = f"{ANALYSIS}{FINAL}<|end|>{ANALYSIS.replace('<|channel|>', '<|start|>assistant<|channel|>', 1)}"
    tokens = served.tokenizer.encode(text)

    def decode(ids: Any) -> str:
        return str(served.tokenizer.decode(ids, skip_special_tokens=False))

    assert decode(tokens) == text
    first = len(served.tokenizer.encode(ANALYSIS))
    second = len(served.tokenizer.encode("<|start|>assistant" + ANALYSIS))
    count = num_thought_tokens(ReasoningMode(HARMONY_PARSER), text, tokens, decode)
    assert count == first + second
