"""The multi-turn chat workload: conversations that share one system prompt, each turn's prompt
the whole conversation so far.

A conversation's turn 0 sends the system prompt's tokens and then the turn's user tokens; turn
k+1 sends turn k's prompt, then the token ids of turn k's reply, then turn k+1's user tokens.
Every prompt therefore starts with the exact token ids of the one before it, and every prompt
of a run with the system prompt's: a prefix cache can serve all of a prompt but its newest reply
and user tokens. Prompts are vocabulary token ids sent as ids (no text round trip), drawn from
one ``random.Random(seed)``: a seed gives the same system prompt, user tokens and reply lengths
every run. The replies themselves come from the server at run time.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.serving.tokens import TokenCodec
from bench.serving.workloads import BenchRequest, WorkloadSpec


@dataclass(frozen=True, slots=True)
class Turn:
    user_token_ids: tuple[int, ...]  # the user's new tokens this turn
    reply_len: int  # tokens the reply is asked for (max_tokens, with ignore_eos)


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: int  # position in the workload, and in arrival order
    system_token_ids: tuple[int, ...]  # the system prompt, the same for every conversation
    turns: tuple[Turn, ...]  # in order; at least one

    def first_prompt(self) -> list[int]:
        """Turn 0's prompt: the system prompt, then the first user tokens."""
        return [*self.system_token_ids, *self.turns[0].user_token_ids]

    def request(self, turn_index: int, prompt_token_ids: Sequence[int]) -> BenchRequest:
        """Turn ``turn_index`` as a request with the prompt ``prompt_token_ids``; its index is
        its place among all turns of a workload, conversation by conversation."""
        return BenchRequest(
            index=self.conversation_id * len(self.turns) + turn_index,
            prompt="",
            prompt_len=len(prompt_token_ids),
            output_len=self.turns[turn_index].reply_len,
            prompt_token_ids=tuple(prompt_token_ids),
            conversation_id=self.conversation_id,
            turn_index=turn_index,
        )


def build_conversations(spec: WorkloadSpec, codec: TokenCodec, seed: int) -> list[Conversation]:
    """``spec.num_conversations`` conversations of ``spec.num_turns`` turns, the same for the
    same seed."""
    rng = random.Random(seed)
    vocabulary = codec.sampleable_token_ids
    system = tuple(rng.choices(vocabulary, k=spec.system_prompt_len))
    conversations = []
    for conversation_id in range(spec.num_conversations):
        turns = tuple(
            Turn(
                tuple(rng.choices(vocabulary, k=rng.randint(*spec.user_range))),
                rng.randint(*spec.reply_range),
            )
            for _ in range(spec.num_turns)
        )
        conversations.append(Conversation(conversation_id, system, turns))
    return conversations


def next_prompt(
    prompt_token_ids: Sequence[int], reply_token_ids: Sequence[int], turn: Turn
) -> list[int]:
    """The prompt of ``turn``: the previous turn's prompt, its reply, then the new user tokens."""
    return [*prompt_token_ids, *reply_token_ids, *turn.user_token_ids]


def max_context_len(spec: WorkloadSpec) -> int:
    """The most tokens a conversation of ``spec`` can reach: its last prompt and reply at the
    longest (the model's context must hold it)."""
    return spec.system_prompt_len + spec.num_turns * (spec.user_range[1] + spec.reply_range[1])
