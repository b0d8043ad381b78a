"""``LLM.chat``, vLLM's offline chat: each conversation rendered by the tokenizer's own chat
template (transformers' ``apply_chat_template``, no special tokens added) and generated as
``generate`` generates those tokens; one output per conversation, its prompt the rendered text."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.demo_model import DEMO_MODEL_DIR

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HELLO = [{"role": "user", "content": "def add(a, b):"}]
TWO_TURNS = [
    {"role": "system", "content": "Answer in Python."},
    {"role": "user", "content": "Sort a list."},
    {"role": "assistant", "content": "sorted(xs)"},
    {"role": "user", "content": "In place?"},
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(DEMO_MODEL_DIR), dtype="float32", device="cpu")


def _rendered(conversation: list[dict[str, Any]], **options: Any) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **options)
    return list(ids)


def test_each_conversation_is_generated_from_its_rendered_template(llm: LLM) -> None:
    outputs = llm.chat([HELLO, TWO_TURNS], GREEDY)
    assert len(outputs) == 2
    for conversation, output in zip([HELLO, TWO_TURNS], outputs, strict=True):
        expected = _rendered(conversation, add_generation_prompt=True)
        assert output.prompt_token_ids == expected
        assert output.prompt is not None and output.prompt.endswith("Assistant:")
        (same,) = llm.generate([expected], GREEDY)
        assert output.outputs[0].token_ids == same.outputs[0].token_ids
        assert output.outputs[0].text == same.outputs[0].text != ""
    # one conversation alone is one output
    (alone,) = llm.chat(HELLO, GREEDY)
    assert alone.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_the_template_options_reach_the_template(llm: LLM) -> None:
    prefill = [*HELLO, {"role": "assistant", "content": "    return"}]
    (continued,) = llm.chat(
        prefill, GREEDY, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.prompt_token_ids == _rendered(prefill, continue_final_message=True)
    assert continued.prompt is not None and continued.prompt.endswith("    return")
    (plain,) = llm.chat(HELLO, GREEDY, add_generation_prompt=False)
    assert plain.prompt is not None and not plain.prompt.endswith("Assistant:")


def test_bad_conversations_are_refused_naming_what_is_wrong(llm: LLM) -> None:
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(HELLO, continue_final_message=True)
    with pytest.raises(ValueError, match=r"messages\[1\] must be a conversation"):
        llm.chat([HELLO, "hi"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="messages must hold a conversation"):
        llm.chat([])
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.chat([HELLO], [GREEDY, GREEDY])
    (after,) = llm.chat(HELLO, GREEDY)  # nothing was left behind in the engine
    assert after.prompt_token_ids == _rendered(HELLO, add_generation_prompt=True)
