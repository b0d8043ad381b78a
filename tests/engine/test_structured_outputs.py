"""Structured outputs in the engine: greedy decoding under a grammar gives Hugging Face's tokens
under the same grammar's masks, in every mode (batched beside unconstrained requests, chunked
prefill, preemption, n > 1, disaggregated); sampled outputs match their constraint; bad specs
are refused at add_request."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from engine import LLM, LLMEngine, SamplingParams
from engine.outputs import RequestOutput
from engine.structured.grammar import CompiledGrammar, GrammarCache
from engine.structured.spec import StructuredOutputSpec
from engine.structured.vocabulary import TokenVocabulary
from tests.engine.hf_reference import hf_greedy, hf_model
from tests.engine.test_parity import make_prompts
from tests.fixtures.tiny_tokenizer import EOS_TOKEN_ID

SPECS = {
    "regex": StructuredOutputSpec(regex=r"(ab|cd)+[0-9]{2,4}(\.[a-z]+)?"),
    "choice": StructuredOutputSpec(choice=("yes", "no", "not sure")),
    "json-schema": StructuredOutputSpec.from_json_schema(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "count": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            },
            "required": ["name", "count"],
        }
    ),
    "json-object": StructuredOutputSpec(json_object=True),
}


@pytest.fixture(scope="module")
def grammars(llama_dir: Path) -> GrammarCache:
    """The grammars the engine compiles, built the same way (the model's vocabulary size)."""
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir), local_files_only=True)
    vocabulary = TokenVocabulary.from_tokenizer(tokenizer, 1024, [EOS_TOKEN_ID])
    return GrammarCache(vocabulary)


class _GrammarMasks(LogitsProcessor):
    """transformers' side: -inf wherever the grammar forbids a token, given the tokens so far."""

    def __init__(self, grammar: CompiledGrammar, num_prompt_tokens: int) -> None:
        self.grammar = grammar
        self.num_prompt_tokens = num_prompt_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        state = self.grammar.initial_state()
        for token_id in input_ids[0, self.num_prompt_tokens :].tolist():
            state = self.grammar.advance(state, token_id)
        return scores.masked_fill(~self.grammar.allowed_tokens(state), float("-inf"))


def hf_constrained_greedy(
    model_dir: Path, prompt: list[int], max_new_tokens: int, grammar: CompiledGrammar
) -> list[int]:
    with torch.no_grad():
        out = hf_model(model_dir).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([_GrammarMasks(grammar, len(prompt))]),
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _llm(model_dir: Path, **kwargs: object) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=8, **kwargs)  # type: ignore[arg-type]


def _tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in output.outputs] for output in outputs]


@pytest.mark.parametrize(
    "mode",
    ["batched", "chunked", "preempted"],
)
def test_greedy_under_a_grammar_matches_transformers_under_its_masks(
    llama_dir: Path, grammars: GrammarCache, mode: str
) -> None:
    """Each spec twice (two prompts), beside two unconstrained requests that must not change."""
    llm_args = {
        "batched": {},
        "chunked": {"max_num_batched_tokens": 16},
        "preempted": {"num_kv_blocks": 42},
    }[mode]
    llm = _llm(llama_dir, **llm_args)
    prompts = make_prompts(seed=21) + make_prompts(seed=31)
    specs = [*SPECS.values(), *SPECS.values(), None, None]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec) for spec in specs
    ]
    outputs = llm.generate(prompts[: len(specs)], params)
    if mode == "preempted":
        assert llm.engine.num_preemptions > 0
    for prompt, spec, output in zip(prompts, specs, outputs):
        if spec is None:
            expected = hf_greedy(llama_dir, prompt, 24)
        else:
            expected = hf_constrained_greedy(llama_dir, prompt, 24, grammars.get(spec))
        assert output.outputs[0].token_ids == expected, spec


def test_a_finished_match_ends_with_eos_and_satisfies_its_constraint(
    llama_dir: Path, grammars: GrammarCache
) -> None:
    """Seeded sampling over many prompts: whatever ends with "stop" is a whole match."""
    llm = _llm(llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir), local_files_only=True)
    prompts = make_prompts(seed=22)[:6]
    for name in ("regex", "choice", "json-schema"):
        spec = SPECS[name]
        params = SamplingParams(
            temperature=1.0, max_tokens=48, n=3, seed=5, structured_outputs=spec
        )
        outputs = llm.generate(prompts, params)
        stopped = [s for o in outputs for s in o.outputs if s.finish_reason == "stop"]
        assert stopped, name  # the tiny model does end some
        for sample in stopped:
            assert sample.token_ids[-1] == EOS_TOKEN_ID
            text = tokenizer.decode(sample.token_ids[:-1])
            if name == "regex":
                assert re.fullmatch(r"(ab|cd)+[0-9]{2,4}(\.[a-z]+)?", text), text
            elif name == "choice":
                assert text in ("yes", "no", "not sure")
            else:
                value = json.loads(text)
                assert isinstance(value["name"], str) and len(value["name"]) <= 6
                assert isinstance(value["count"], int)
                assert set(value) <= {"name", "count", "tags"}


def test_parallel_samples_each_follow_the_grammar(llama_dir: Path, grammars: GrammarCache) -> None:
    """n = 3 forks share the prompt's first logits: each fork's own state from there on."""
    llm = _llm(llama_dir)
    prompt = make_prompts(seed=23)[4]
    spec = SPECS["json-schema"]
    (greedy,) = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=20, n=3, structured_outputs=spec)
    )
    expected = hf_constrained_greedy(llama_dir, prompt, 20, grammars.get(spec))
    assert [s.token_ids for s in greedy.outputs] == [expected] * 3


def test_min_tokens_yields_to_a_finished_match(llama_dir: Path) -> None:
    """min_tokens bans eos, but a choice that is complete allows nothing else: the grammar
    wins (no row may be left with every token masked)."""
    llm = _llm(llama_dir)
    spec = StructuredOutputSpec(choice=("yes", "no"))
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10, structured_outputs=spec)
    (output,) = llm.generate([make_prompts(seed=24)[2]], params)
    sample = output.outputs[0]
    assert sample.finish_reason == "stop" and sample.text in ("yes", "no")


def test_stop_token_ids_end_a_match_like_eos(llama_dir: Path) -> None:
    llm = _llm(llama_dir)
    spec = StructuredOutputSpec(choice=("yes", "no"))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        stop_token_ids=[7],
        logit_bias={7: 100.0},
        structured_outputs=spec,
    )
    (output,) = llm.generate([make_prompts(seed=25)[2]], params)
    assert output.outputs[0].token_ids[-1] == 7  # allowed once the choice is whole, and biased
    assert output.outputs[0].text in ("yes", "no")


def _disaggregated(
    model_dir: Path, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    """Each request prefilled (first token sampled) on one engine, decoded on another."""
    prefill: LLMEngine = _llm(model_dir).engine
    decode: LLMEngine = _llm(model_dir).engine
    for i, (prompt, request_params) in enumerate(zip(prompts, params)):
        prefill.add_request(f"r{i}", prompt, request_params, prefill_only=True)
    handed = []
    while len(handed) < len(prompts):
        handed += prefill.step().handed_off
    for result in handed:
        dst = decode.reserve_blocks(result.request_id, result.num_prompt_tokens)
        assert dst is not None
        decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, result.block_ids]
        decode.admit_prefilled(result, kv_received=True)
        prefill.release_lease(result.request_id)
    outputs = {}
    while decode.has_unfinished_requests():
        for out in decode.step().finished:
            outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def test_disaggregated_decode_continues_from_the_prefill_sides_first_token(
    llama_dir: Path, grammars: GrammarCache
) -> None:
    """The prefill engine samples the first token under the grammar; the decode engine replays
    it to find the state, and continues: the tokens of one engine."""
    prompts = make_prompts(seed=26)[:4]
    specs = list(SPECS.values())
    params = [SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=s) for s in specs]
    for prompt, spec, tokens in zip(prompts, specs, _disaggregated(llama_dir, prompts, params)):
        assert tokens == hf_constrained_greedy(llama_dir, prompt, 16, grammars.get(spec))


def test_bad_specs_are_refused_at_add_request(llama_dir: Path) -> None:
    engine = _llm(llama_dir).engine
    cases = [
        (StructuredOutputSpec(regex="(ab"), "structured_outputs.regex"),
        (
            StructuredOutputSpec.from_json_schema({"type": "object", "patternProperties": {}}),
            "patternProperties",
        ),
    ]
    for spec, named in cases:
        params = SamplingParams(max_tokens=4, structured_outputs=spec)
        with pytest.raises(ValueError, match=named):
            engine.add_request("bad", [5, 6, 7], params)
        assert not engine.has_request("bad")
    with pytest.raises(ValueError, match="structured_outputs cannot be combined with ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputSpec(regex="a+"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_tokens_are_the_cpu_engines(llama_dir: Path) -> None:
    """Masks copied to the GPU once per state (the cursors' device cache) mask as on CPU."""
    prompts = make_prompts(seed=27)[:4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec)
        for spec in SPECS.values()
    ]
    on_cpu = _llm(llama_dir).generate(prompts, params)
    gpu = LLM(str(llama_dir), dtype="float32", device="cuda", block_size=8)
    assert _tokens(gpu.generate(prompts, params)) == _tokens(on_cpu)
    assert _tokens(gpu.generate(prompts, params)) == _tokens(on_cpu)  # masks from the cache


def test_logprobs_are_those_of_the_masked_distribution(
    llama_dir: Path, grammars: GrammarCache
) -> None:
    """As vLLM (its grammar bitmask is applied before its sampler): each sampled token's
    logprob is log_softmax over the allowed tokens; a forbidden token in the top-N is -inf."""
    llm = _llm(llama_dir)
    prompt = make_prompts(seed=28)[3]
    spec = SPECS["json-schema"]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, structured_outputs=spec)
    (output,) = llm.generate([prompt], params)
    sample = output.outputs[0]
    grammar = grammars.get(spec)
    state = grammar.initial_state()
    with torch.no_grad():
        logits = hf_model(llama_dir)(torch.tensor([prompt + sample.token_ids])).logits[0].float()
    assert sample.logprobs is not None
    for step, (token_id, position) in enumerate(zip(sample.token_ids, sample.logprobs)):
        allowed = grammar.allowed_tokens(state)
        masked = logits[len(prompt) - 1 + step].masked_fill(~allowed, float("-inf"))
        expected = torch.log_softmax(masked, dim=-1)
        assert position[token_id].logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
        for top_id, top in position.items():  # fewer than N allowed: the rest show -inf
            assert bool(allowed[top_id]) or top.logprob == float("-inf")
        state = grammar.advance(state, token_id)


def test_after_token_ids_leave_the_reasoning_free_and_constrain_what_follows(
    llama_dir: Path, grammars: GrammarCache
) -> None:
    """vLLM's structured outputs under a reasoning parser: free until the end of thought (here
    the first two tokens greedy decoding writes), constrained from the token after it; a spec
    whose end never comes leaves the whole output free. Disaggregated too: the prefill side's
    first token is free, the decode side finds where the grammar starts by replaying."""
    llm = _llm(llama_dir)
    prompts = make_prompts(seed=29)[2:5]
    spec = SPECS["json-schema"]
    for prompt in prompts:
        free = hf_greedy(llama_dir, prompt, 20)
        end = tuple(free[:2])
        after = StructuredOutputSpec(json_schema=spec.json_schema, after_token_ids=end)
        params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=after)
        (output,) = llm.generate([prompt], params)
        constrained = hf_constrained_greedy(llama_dir, prompt + list(end), 18, grammars.get(spec))
        assert output.outputs[0].token_ids == list(end) + constrained
        (split,) = _disaggregated(llama_dir, [prompt], [params])
        assert split == output.outputs[0].token_ids
        never = StructuredOutputSpec(json_schema=spec.json_schema, after_token_ids=(3, 3, 3, 3))
        unconstrained = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=never)
        (free_output,) = llm.generate([prompt], unconstrained)
        assert free_output.outputs[0].token_ids == free


def test_the_end_of_thought_may_overlap_itself() -> None:
    """after (5, 5, 6): the output 5 5 5 6 ends with it (a naive match resets at the third 5)."""
    from engine.structured.cursors import _Cursor

    cursor = _Cursor(grammar=None, state=0, num_consumed=0, after_token_ids=(5, 5, 6))  # type: ignore[arg-type]
    for token_id in (5, 5, 5):
        cursor.consume(token_id)
        assert not cursor.started
    cursor.consume(6)
    assert cursor.started


def test_vllms_structured_outputs_params_reads_the_same(llama_dir: Path) -> None:
    """Code ported from vLLM: ``StructuredOutputsParams(json=..., regex=..., choice=[...],
    json_object=True)`` gives the spec of the same constraint; grammars are refused by name."""
    from engine import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert StructuredOutputsParams(json=schema) == StructuredOutputSpec.from_json_schema(schema)
    assert StructuredOutputsParams(
        json=json.dumps(schema)
    ) == StructuredOutputSpec.from_json_schema(schema)
    assert StructuredOutputsParams(regex="a+") == StructuredOutputSpec(regex="a+")
    assert StructuredOutputsParams(choice=["x", "y"]) == StructuredOutputSpec(choice=("x", "y"))
    assert StructuredOutputsParams(json_object=True) == StructuredOutputSpec(json_object=True)
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert compact == StructuredOutputSpec(
        json_schema=StructuredOutputSpec.from_json_schema(schema).json_schema, compact=True
    )
    with pytest.raises(ValueError, match="grammar is not supported"):
        StructuredOutputsParams(grammar="root ::= 'a'")
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["x", "y"])
    )
    (output,) = _llm(llama_dir).generate([[5, 6, 7]], params)
    assert output.outputs[0].text in ("x", "y")


def test_a_tokenizer_given_apart_from_the_model_compiles_the_grammars(
    llama_dir: Path, tmp_path: Path
) -> None:
    """``LLM(tokenizer=...)`` (vLLM's): a model directory without tokenizer files compiles
    structured outputs against the tokenizer given, as the one beside it would."""
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for item in llama_dir.iterdir():
        if item.suffix in (".json", ".safetensors") and "token" not in item.name:
            shutil.copy(item, bare / item.name)
    prompts = make_prompts(seed=29)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=SPECS["regex"])
    expected = _tokens(_llm(llama_dir).generate(prompts, params))
    without = LLM(str(bare), dtype="float32", device="cpu", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        without.generate(prompts, params)
    given = LLM(str(bare), dtype="float32", device="cpu", tokenizer=str(llama_dir))
    assert _tokens(given.generate(prompts, params)) == expected
