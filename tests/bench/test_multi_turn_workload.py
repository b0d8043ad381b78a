"""The multi-turn workload: a shared system prompt, lengths within their ranges, each turn's
prompt the previous one plus its reply plus new user tokens, the same for the same seed; and
the request body that sends a prompt as token ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serving.client import EndpointConfig, chunk_token_ids, request_body
from bench.serving.conversations import (
    Conversation,
    build_conversations,
    max_context_len,
    next_prompt,
)
from bench.serving.tokens import TokenCodec
from bench.serving.workloads import WorkloadSpec, build_requests

SPEC = WorkloadSpec(
    kind="multi-turn",
    num_conversations=9,
    num_turns=4,
    system_prompt_len=120,
    user_range=(5, 20),
    reply_range=(3, 9),
)


@pytest.fixture(scope="module")
def codec(tokenizer_dir: Path) -> TokenCodec:
    return TokenCodec.load(tokenizer_dir)


def test_defaults_are_the_issues() -> None:
    spec = WorkloadSpec(kind="multi-turn")
    assert (spec.num_conversations, spec.num_turns, spec.system_prompt_len) == (64, 6, 1000)
    assert spec.user_range == (50, 200) and spec.reply_range == (100, 200)
    assert max_context_len(spec) == 1000 + 6 * (200 + 200)


def test_lengths_stay_in_their_ranges_and_the_system_prompt_is_shared(codec: TokenCodec) -> None:
    conversations = build_conversations(SPEC, codec, seed=1)
    assert [c.conversation_id for c in conversations] == list(range(9))
    system = conversations[0].system_token_ids
    assert len(system) == 120
    allowed = set(codec.sampleable_token_ids)
    assert set(system) <= allowed
    user_lens, reply_lens = set(), set()
    for conversation in conversations:
        assert conversation.system_token_ids == system
        assert len(conversation.turns) == 4
        assert conversation.first_prompt()[:120] == list(system)
        for turn in conversation.turns:
            assert 5 <= len(turn.user_token_ids) <= 20 and 3 <= turn.reply_len <= 9
            assert set(turn.user_token_ids) <= allowed
            user_lens.add(len(turn.user_token_ids))
            reply_lens.add(turn.reply_len)
    assert len(user_lens) > 5 and len(reply_lens) > 3  # drawn, not fixed


def _replayed(conversation: Conversation) -> list[list[int]]:
    """Each turn's prompt when every reply is ``reply_len`` made-up ids."""
    prompts = [conversation.first_prompt()]
    for index, turn in enumerate(conversation.turns[1:]):
        reply = [7000 + index * 10 + i for i in range(conversation.turns[index].reply_len)]
        prompts.append(next_prompt(prompts[-1], reply, turn))
    return prompts


def test_each_prompt_is_the_previous_one_its_reply_and_new_user_tokens(codec: TokenCodec) -> None:
    conversation = build_conversations(SPEC, codec, seed=2)[4]
    prompts = _replayed(conversation)
    assert prompts[0] == [*conversation.system_token_ids, *conversation.turns[0].user_token_ids]
    for index in range(1, len(prompts)):
        previous, turn = prompts[index - 1], conversation.turns[index]
        reply_len = conversation.turns[index - 1].reply_len
        reply = [7000 + (index - 1) * 10 + i for i in range(reply_len)]
        assert prompts[index] == [*previous, *reply, *turn.user_token_ids]
        request = conversation.request(index, prompts[index])
        assert request.prompt_token_ids == tuple(prompts[index])
        assert request.prompt_len == len(prompts[index])
        assert request.output_len == turn.reply_len
        assert (request.conversation_id, request.turn_index) == (4, index)
        assert request.index == 4 * 4 + index


def test_the_same_seed_gives_the_same_workload(codec: TokenCodec) -> None:
    first = build_conversations(SPEC, codec, seed=7)
    assert build_conversations(SPEC, codec, seed=7) == first
    other = build_conversations(SPEC, codec, seed=8)
    assert other != first
    assert other[0].system_token_ids != first[0].system_token_ids  # rates get their own prompt


def test_multi_turn_is_not_a_list_of_requests_and_bad_specs_are_refused(
    codec: TokenCodec,
) -> None:
    with pytest.raises(ValueError, match="build_conversations"):
        build_requests(SPEC, codec, 4, seed=0)
    with pytest.raises(ValueError, match="user_range"):
        WorkloadSpec(kind="multi-turn", user_range=(9, 3))
    with pytest.raises(ValueError, match="num_turns"):
        WorkloadSpec(kind="multi-turn", num_turns=0)
    with pytest.raises(ValueError, match="output lengths"):
        WorkloadSpec(kind="multi-turn", reply_range=(0, 4))


def test_token_id_prompts_go_to_completions_as_ints(codec: TokenCodec) -> None:
    conversation = build_conversations(SPEC, codec, seed=3)[0]
    request = conversation.request(0, conversation.first_prompt())
    body = request_body(EndpointConfig("http://h/v1", "m", return_token_ids=True), request)
    assert body["prompt"] == conversation.first_prompt()
    assert body["return_token_ids"] is True and body["max_tokens"] == request.output_len
    assert "return_token_ids" not in request_body(EndpointConfig("http://h/v1", "m"), request)
    with pytest.raises(ValueError, match="completions"):
        request_body(EndpointConfig("http://h/v1", "m", endpoint="chat"), request)


def test_chunk_token_ids_reads_every_choice() -> None:
    chunk = {"choices": [{"index": 0, "text": "a", "token_ids": [4, 5]}, {"token_ids": [6]}]}
    assert chunk_token_ids(chunk) == [4, 5, 6]
    assert chunk_token_ids({"choices": [{"text": "a"}]}) is None
    assert chunk_token_ids({"choices": [{"text": "", "token_ids": []}]}) == []
    assert chunk_token_ids({"choices": [], "usage": {}}) is None
