"""The usage's ``completion_tokens_details.reasoning_tokens`` under a reasoning parser: how many
completion tokens were the thought, up to and including the token that completed ``</think>``
(qwen3: those before a ``<tool_call>`` that ended it), all of them when no tag ended it, none
with thinking off; summed over the choices. In a stream's usage chunk (``include_usage``) and a
whole response's usage (``chat_response``); absent without a parser.

The demo model's tokenizer spells the tags with several tokens (``<``, ``/``, ``th``, ``ink``,
``>``); a copy of it has them as special tokens, as DeepSeek-R1's and Qwen3's have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from router.gateway.openai_response import ChoiceText, ResponseHeader, Usage, chat_response
from router.gateway.reasoning import ReasoningMode, num_thought_tokens
from router.gateway.served_model import ServedModel
from tests.gateway.test_reasoning_parsers import (
    ANSWER,
    CALL,
    OPENED_IN_PROMPT,
    THOUGHT,
    WITH_TAGS,
    _served,
)
from tests.gateway.token_script import (
    DEMO_MODEL,
    USER_HI,
    ScriptedCluster,
    http_client,
    script_answer,
    script_tokens,
    stream_chunks,
)

pytestmark = pytest.mark.timeout(120)


def _decoder(model: ServedModel) -> Any:
    """Token ids to text as the gateway decodes a reasoning parser's output: tags kept."""
    return lambda token_ids: model.tokenizer.decode(token_ids, skip_special_tokens=False)


def _fewest_holding(model: ServedModel, token_ids: Sequence[int], text: str) -> int:
    """The fewest of ``token_ids`` whose text starts with ``text``."""
    decode = _decoder(model)
    return next(k for k in range(len(token_ids) + 1) if decode(token_ids[:k]).startswith(text))


@pytest.mark.parametrize(
    ("parser", "text", "thought"),
    [
        ("deepseek_r1", OPENED_IN_PROMPT, f"{THOUGHT}\n</think>"),
        ("qwen3", WITH_TAGS, f"<think>\n{THOUGHT}\n</think>"),  # a <think> written is thought
        ("deepseek_r1", f"</think>{ANSWER}", "</think>"),
        ("qwen3", f"{THOUGHT}{CALL}", THOUGHT),  # <tool_call> ends it, the call's tokens not
        ("qwen3", CALL, ""),
        ("deepseek_r1", THOUGHT, None),  # no tag ended it: all thought
        ("deepseek_r1", f"{THOUGHT}{CALL}", None),
    ],
)
def test_the_thought_is_counted_through_the_token_that_ends_it(
    parser: str, text: str, thought: str | None
) -> None:
    model = _served(parser)
    token_ids = model.tokenizer.encode(text)
    expected = len(token_ids) if thought is None else _fewest_holding(model, token_ids, thought)
    mode = ReasoningMode(parser)
    assert num_thought_tokens(mode, text, token_ids, _decoder(model)) == expected
    if text == OPENED_IN_PROMPT:  # "The", " user", ... ".", "\n", "<", "/", "th", "ink", ">"
        assert expected == len(model.tokenizer.encode(f"{THOUGHT}\n")) + 5


def test_special_tags_count_as_one_token_each_and_thinking_off_counts_none() -> None:
    model = _served("qwen3", special_tags=True)
    start, end = model.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    thought, answer = model.tokenizer.encode(THOUGHT), model.tokenizer.encode(ANSWER)
    token_ids = [start, *thought, end, *answer]
    text = _decoder(model)(token_ids)
    count = num_thought_tokens(ReasoningMode("qwen3"), text, token_ids, _decoder(model))
    assert count == 1 + len(thought) + 1
    off = ReasoningMode("qwen3", thinking=False)
    assert num_thought_tokens(off, text, token_ids, _decoder(model)) == 0


def test_a_whole_response_reports_the_thought_s_tokens_of_all_choices() -> None:
    model = _served("deepseek_r1")
    cut = model.tokenizer.encode(THOUGHT)  # a choice cut in its thought: all of it
    whole = model.tokenizer.encode(OPENED_IN_PROMPT)
    choices = [
        ChoiceText(model.tokenizer.decode(ids), ids, finish_reason="stop") for ids in (cut, whole)
    ]
    usage = Usage(3, len(cut) + len(whole), 0)
    header = ResponseHeader("chatcmpl-1", 0, "pdserve-demo")
    mode = ReasoningMode("deepseek_r1")
    body = chat_response(header, choices, usage, None, reasoning=mode, decode=_decoder(model))
    thought = _fewest_holding(model, whole, f"{THOUGHT}\n</think>")
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(cut) + thought}
    assert body["usage"]["completion_tokens"] == len(cut) + len(whole)


def _usage_chunk(http: Any, **fields: Any) -> dict[str, Any]:
    body = {"messages": [USER_HI], **fields}
    chunks = stream_chunks(http, "/v1/chat/completions", body, include_usage=True)
    usage: dict[str, Any] = chunks[-1]["usage"]
    return usage


def test_a_stream_reports_them_in_its_usage_chunk() -> None:
    """Exact whatever the deltas hold: a stop string that might start with the tag's ``>``
    holds it back, to go out with the next tokens' text."""
    cluster, model = ScriptedCluster(), _served("deepseek_r1")
    script_answer(cluster, model, OPENED_IN_PROMPT)
    thought = _fewest_holding(model, cluster.tokens, f"{THOUGHT}\n</think>")
    with http_client(cluster, model) as http:
        usage = _usage_chunk(http, n=2, stop=[">\n\nX"])
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * thought}
        assert usage["completion_tokens"] == 2 * len(cluster.tokens)
        script_answer(cluster, model, THOUGHT, stop=False)  # cut in its thought: all of it
        usage = _usage_chunk(http, max_tokens=len(cluster.tokens))
        assert usage["completion_tokens_details"] == {"reasoning_tokens": len(cluster.tokens)}


def test_a_whole_response_over_http_reports_them_as_a_stream_does() -> None:
    cluster, model = ScriptedCluster(), _served("deepseek_r1")
    script_answer(cluster, model, OPENED_IN_PROMPT)
    thought = _fewest_holding(model, cluster.tokens, f"{THOUGHT}\n</think>")
    with http_client(cluster, model) as http:
        response = http.post("/v1/chat/completions", json={"messages": [USER_HI], "n": 2})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * thought}


def test_no_details_without_a_reasoning_parser() -> None:
    cluster, model = ScriptedCluster(), ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    script_tokens(cluster, model.tokenizer.encode(OPENED_IN_PROMPT), model)
    with http_client(cluster, model) as http:
        assert "completion_tokens_details" not in _usage_chunk(http)
