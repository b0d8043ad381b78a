"""Speculative decoding (ngram prompt lookup): the proposer, the draft check, and the engine.

Greedy output must be the tokens transformers' ``generate`` gives, in every engine mode, with
drafts that stand and drafts that fall; sampled output must follow the target's distribution
exactly. The engine tests use the bundled demo model: its text repeats, so prompt lookup
proposes drafts that often stand (the tiny random models almost never repeat themselves).
"""

from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.decode_graphs import DecodeGraphs, EagerCapturer
from engine.sampling import SamplingRow
from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer
from engine.speculative.rejection import NO_DRAFT, check_drafts
from engine.structured.spec import StructuredOutputSpec
from tests.engine.hf_reference import hf_greedy, hf_log_softmax
from tests.engine.test_sampler_statistics import LOGITS, VOCAB_SIZE, assert_matches, softmax

DEMO_MODEL = Path(__file__).resolve().parents[2] / "engine" / "demo_model" / "assets"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
TEXTS = (
    "Return a copy of the string with leading and trailing whitespace removed. Return a copy",
    "Open a file and return a stream. Open a file",
    "The os module provides a portable way of using operating system dependent functionality.",
    "Sort a list",
    "If the file is not specified, the file is returned.\n\nIf the file",
)
MAX_TOKENS = (48, 40, 33, 1, 64)


def proposer(num_tokens: int = 3, lookup_min: int = 1, lookup_max: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_tokens, lookup_max, lookup_min))


# ---- the proposer --------------------------------------------------------------------------
def test_the_longest_recurring_ngram_proposes_what_followed_its_latest_occurrence() -> None:
    context = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 5, 6, 7]
    # "5 6 7" (n = 3) occurred at 0 and is followed by 1 2 9; the shorter "6 7" later at 6 is
    # not used while a longer n-gram recurs
    assert proposer().propose(context, 8) == (1, 2, 9)
    # with n at most 2, "6 7" at 6 is the latest occurrence: 3 4 8 follow it
    assert proposer(lookup_max=2).propose(context, 8) == (3, 4, 8)


def test_proposals_stop_at_the_limits_and_the_end_of_the_context() -> None:
    context = [1, 2, 3, 4, 1, 2]
    assert proposer(num_tokens=5).propose(context, 8) == (3, 4, 1, 2)  # the context ends
    assert proposer(num_tokens=5).propose(context, 2) == (3, 4)  # room for 2
    assert proposer(num_tokens=1).propose(context, 8) == (3,)
    assert proposer().propose(context, 0) == ()


def test_no_proposal_without_a_recurring_ngram_of_the_allowed_sizes() -> None:
    assert proposer().propose([1, 2, 3, 4, 5], 4) == ()
    assert proposer(lookup_min=2).propose([1, 2, 3, 9, 1], 4) == ()  # only "1" recurs
    assert proposer().propose([7], 4) == ()
    assert proposer().propose([7, 7], 4) == (7,)


def test_a_match_across_token_boundaries_of_the_packed_context_is_not_an_occurrence() -> None:
    # packed little-endian, 256 then 0 reads 00 01 00 00 00 00 00 00: token 1's bytes
    # (01 00 00 00) sit at byte offset 1, inside no token
    assert proposer().propose([256, 0, 7, 1], 4) == ()
    assert proposer().propose([256, 0, 1, 7, 1], 4) == (7, 1)


def test_a_sequences_packed_context_is_kept_and_extended() -> None:
    """With a seq id the packed context carries over: proposals are those of the whole
    context packed afresh, as it grows; the least recently asked sequence's is dropped."""
    kept = NgramProposer(SpeculativeConfig(3, 3, 1), max_contexts=2)
    fresh = proposer()
    rng = np.random.default_rng(3)
    contexts = {seq_id: rng.integers(0, 6, size=4).tolist() for seq_id in (7, 8, 9)}
    for _ in range(30):
        for seq_id, context in contexts.items():
            context.extend(rng.integers(0, 6, size=int(rng.integers(1, 4))).tolist())
            assert kept.propose(context, 3, seq_id) == fresh.propose(context, 3)
    assert list(kept._packed) == [8, 9]  # 7 asked least recently: dropped
    assert bytes(kept._packed[9]) == array("I", contexts[9]).tobytes()


def test_speculative_config_takes_vllms_dict_and_names_bad_fields() -> None:
    config = SpeculativeConfig.from_mapping({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.from_mapping({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = SpeculativeConfig.from_mapping({"num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    assert config.disable_by_batch_size is None
    config = SpeculativeConfig.from_mapping(
        {"num_speculative_tokens": 3, "disable_by_batch_size": 8}
    )
    assert config.disable_by_batch_size == 8
    bad = [
        ({"prompt_lookup_max": 3}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 16\], got 0"),
        ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an int, got float"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be one of ngram, draft"),
        ({"num_speculative_tokens": 2, "draft": "x"}, "unknown key"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_max \(2\) must be >= prompt_lookup_min \(4\)",
        ),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": "4"}, "must be an int, got str"),
    ]
    for raw, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_mapping(raw)


# ---- the draft check -----------------------------------------------------------------------
def rows_of(params: SamplingParams, num_rows: int) -> list[SamplingRow]:
    return [SamplingRow(params, (), (), None) for _ in range(num_rows)]


def test_greedy_drafts_stand_exactly_where_they_are_the_argmax() -> None:
    logits = torch.randn(6, 50)
    argmax = logits.argmax(dim=-1).tolist()
    drafts = [argmax[0], (argmax[1] + 1) % 50, argmax[2], NO_DRAFT, argmax[4], 7]
    checked = check_drafts(logits, rows_of(SamplingParams(temperature=0.0), 6), drafts)
    assert checked.accepted == [True, False, True, False, True, argmax[5] == 7]
    assert checked.token_ids == argmax


@pytest.mark.parametrize("draft", [2, 9, 6, NO_DRAFT])  # most likely, 3rd, 1.3 %, none
@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)]
)
def test_each_rows_token_follows_the_target_distribution(
    params: SamplingParams, draft: int
) -> None:
    """Whatever the draft, a row's token (the draft where it stands, else the token drawn in
    its place) is distributed as the target's processed distribution; top-k 5 gives token 6
    probability 0, so there the draft always falls."""
    torch.manual_seed(7)
    num_rows, num_calls = 4000, 5
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(num_rows, VOCAB_SIZE)
    counts = np.zeros(VOCAB_SIZE, dtype=np.int64)
    num_accepted = 0
    for _ in range(num_calls):
        checked = check_drafts(logits, rows_of(params, num_rows), [draft] * num_rows)
        counts += np.bincount(checked.token_ids, minlength=VOCAB_SIZE)
        num_accepted += sum(checked.accepted)
    scaled = LOGITS / params.temperature
    if params.top_k > 0:
        scaled = np.where(scaled >= np.sort(scaled)[-params.top_k], scaled, -np.inf)
    expected = softmax(scaled)
    assert_matches(counts, expected)
    # a draft stands with the target's probability of it
    probability = 0.0 if draft == NO_DRAFT else expected[draft]
    assert abs(num_accepted / (num_rows * num_calls) - probability) < 0.02


def test_seeded_sampled_rows_are_refused() -> None:
    generator = torch.Generator().manual_seed(1)
    rows = [SamplingRow(SamplingParams(temperature=1.0), (), (), generator)]
    with pytest.raises(ValueError, match="seeded sampled rows cannot check drafts"):
        check_drafts(torch.randn(1, 8), rows, [3])


# ---- the engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    llm = LLM(str(DEMO_MODEL), dtype="float32", device="cpu", num_kv_blocks=8)
    assert llm.tokenizer is not None
    return [llm.tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def expected(prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(DEMO_MODEL, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]


def greedy(**extra: object) -> list[SamplingParams]:
    """Greedy params per prompt; a ``min_tokens`` is capped at each one's max_tokens."""
    params = []
    for max_tokens in MAX_TOKENS:
        fields = dict(extra)
        if "min_tokens" in fields:
            fields["min_tokens"] = min(max_tokens, fields["min_tokens"])  # type: ignore[call-overload]
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields))  # type: ignore[arg-type]
    return params


def speculating_llm(**engine_args: object) -> LLM:
    return LLM(
        str(DEMO_MODEL), dtype="float32", device="cpu", speculative_config=NGRAM, **engine_args
    )  # type: ignore[arg-type]


def assert_drafts_stood_and_fell(llm: LLM) -> None:
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens, stats
    # a sequence's step with drafts checks at most num_speculative_tokens of them
    assert 0 < stats.num_drafts <= llm.engine.scheduler.num_draft_attempts, stats
    assert stats.num_drafts <= stats.num_draft_tokens <= 4 * stats.num_drafts, stats


@pytest.mark.parametrize(
    "mode",
    ["batched", "chunked", "preempted", "prefix-cache", "one-at-a-time"],
)
def test_greedy_output_matches_transformers(
    prompts: list[list[int]], expected: list[list[int]], mode: str
) -> None:
    engine_args: dict[str, object] = {}
    if mode == "chunked":  # drafts compete with prompt chunks for a 12-token step
        engine_args = {"max_num_batched_tokens": 12}
    elif mode == "preempted":
        engine_args = {"block_size": 4, "num_kv_blocks": 40}
    llm = speculating_llm(**engine_args)
    if mode == "one-at-a-time":
        outputs = [llm.generate([p], [s])[0] for p, s in zip(prompts, greedy(), strict=True)]
    else:
        outputs = llm.generate(prompts, greedy())
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if mode == "prefix-cache":
        again = llm.generate(prompts, greedy())
        assert [o.outputs[0].token_ids for o in again] == expected
        assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 16)
    if mode == "preempted":
        assert llm.engine.num_preemptions > 0
    assert_drafts_stood_and_fell(llm)


def test_fewer_steps_than_tokens(prompts: list[list[int]]) -> None:
    """One request decoding alone: drafts that stand save steps (the reason for drafts)."""
    llm = speculating_llm()
    (out,) = llm.generate([prompts[4]], SamplingParams(temperature=0.0, max_tokens=64))
    stats = llm.engine.stats
    assert stats.num_generated_tokens == 64
    assert stats.num_steps == 64 - stats.num_accepted_draft_tokens
    assert stats.num_steps < 48


def test_parallel_greedy_samples_each_speculate(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    llm = speculating_llm(block_size=4)
    (out,) = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=48, n=3))
    assert [c.token_ids for c in out.outputs] == [expected[0]] * 3
    assert_drafts_stood_and_fell(llm)


@pytest.mark.parametrize(
    "extra",
    [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.8, "frequency_penalty": 0.4},
        {"min_tokens": 30},
        {"logit_bias": {198: -3.0}},
        {"bad_words": ["the file"]},
        {"ignore_eos": True},
    ],
    ids=["repetition", "presence-frequency", "min-tokens", "logit-bias", "bad-words", "ignore-eos"],
)
def test_each_draft_is_checked_with_the_history_before_it(
    prompts: list[list[int]], extra: dict[str, object]
) -> None:
    """Penalties, bans and bad words depend on the output so far: a draft's row sees the drafts
    before it as output. The engine without drafts (itself checked against transformers in
    tests/engine) gives the reference."""
    plain = LLM(str(DEMO_MODEL), dtype="float32", device="cpu")
    llm = speculating_llm()
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(**extra))]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(**extra))]
    assert got == expected
    assert llm.engine.stats.num_draft_tokens > 0


def test_stop_tokens_and_max_tokens_inside_drafts_end_the_output_there(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """A stop token or the last allowed token may come among the drafts that stand: the
    output ends there, the drafts after it are dropped, as without drafts."""
    llm = speculating_llm()
    stop_token = expected[4][20]
    stopped = expected[4][: expected[4].index(stop_token) + 1]
    (out,) = llm.generate(
        [prompts[4]], SamplingParams(temperature=0.0, stop_token_ids=[stop_token], max_tokens=64)
    )
    assert out.outputs[0].token_ids == stopped
    assert out.outputs[0].finish_reason == "stop"
    for max_tokens in (2, 5, 13, 29):
        (out,) = llm.generate([prompts[4]], SamplingParams(temperature=0.0, max_tokens=max_tokens))
        assert out.outputs[0].token_ids == expected[4][:max_tokens]
        assert out.outputs[0].finish_reason == "length"


def test_logprobs_of_tokens_from_drafts_are_the_models(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    llm = speculating_llm()
    (out,) = llm.generate([prompts[4]], SamplingParams(temperature=0.0, max_tokens=40, logprobs=2))
    tokens = out.outputs[0].token_ids
    assert tokens == expected[4][:40]
    reference = hf_log_softmax(DEMO_MODEL, prompts[4] + tokens)[len(prompts[4]) - 1 :]
    assert out.outputs[0].logprobs is not None and len(out.outputs[0].logprobs) == 40
    for position, (token, logprobs) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        assert logprobs[token].logprob == pytest.approx(float(reference[position, token]), abs=1e-4)
        assert len(logprobs) in (2, 3)
    assert_drafts_stood_and_fell(llm)


def test_seeded_sampling_does_not_speculate(prompts: list[list[int]]) -> None:
    llm = speculating_llm()
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=24)
    plain = LLM(str(DEMO_MODEL), dtype="float32", device="cpu")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, seeded)
    ]
    assert llm.engine.stats.num_draft_tokens == 0


STRUCTURED = {
    # the text repeats what the prompt holds: prompt lookup drafts it, the grammar allows it
    "regex": StructuredOutputSpec(regex=r"( and return a stream\. Open a file)+"),
    "choice": StructuredOutputSpec(
        choice=(" and return a stream. Open a file and return", " and close it")
    ),
    "json": StructuredOutputSpec.from_json_schema(
        {
            "type": "object",
            "properties": {"file": {"type": "string"}, "stream": {"type": "string"}},
            "required": ["file", "stream"],
        }
    ),
}


@pytest.mark.parametrize("kind", sorted(STRUCTURED))
def test_structured_outputs_speculate_within_their_grammar(
    prompts: list[list[int]], kind: str
) -> None:
    """Drafts are cut to what the grammar allows and each row is masked by the state its
    drafts lead to: the output is the engine's without drafts, token for token, and the
    drafts that stood are the grammar's."""
    spec = STRUCTURED[kind]
    params = SamplingParams(temperature=0.0, structured_outputs=spec, max_tokens=40)
    llm = speculating_llm()
    plain = LLM(str(DEMO_MODEL), dtype="float32", device="cpu")
    got = llm.generate([prompts[1]], params)[0].outputs[0]
    want = plain.generate([prompts[1]], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert llm.engine.stats.num_accepted_draft_tokens > 0, llm.engine.stats


def test_a_grammar_whose_states_grow_between_runner_and_scheduler() -> None:
    """A schema with enough states that its table grows while the runner masks (in torch's
    inference mode) and is filled further while the scheduler cuts drafts (not): torch refused
    the second ("Inplace update to inference tensor outside InferenceMode")."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "path": {"type": "string", "maxLength": 30},
            "mode": {"enum": ["read", "write", "append"]},
        },
        "required": ["name", "path", "mode"],
    }
    spec = StructuredOutputSpec.from_json_schema(schema)
    text = (
        'Open a file. {"name": "open", "path": "/tmp/file.txt", "mode": "read"} Close a '
        'file. {"name": "close", "path": "/tmp/file.txt", "mode": "write"} Read a file.'
    )
    params = SamplingParams(temperature=0.0, structured_outputs=spec, max_tokens=64)
    llm = speculating_llm()
    plain = LLM(str(DEMO_MODEL), dtype="float32", device="cpu")
    assert llm.tokenizer is not None
    prompt = llm.tokenizer.encode(text)
    got = llm.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == plain.generate([prompt], params)[0].outputs[0].token_ids
    assert llm.engine.stats.num_accepted_draft_tokens > 0


def test_drafts_are_cut_where_the_grammar_forbids_them_or_the_output_ends() -> None:
    llm = speculating_llm()
    assert llm.tokenizer is not None
    cursors = llm.engine.runner.grammar_cursors
    assert cursors is not None
    eos = next(iter(llm.engine.model_config.eos_token_ids))
    spec = StructuredOutputSpec(regex="(ab)+")
    params = SamplingParams(structured_outputs=spec, stop_token_ids=[7])
    seq = Sequence(0, "r", [5, 6], params, 64)

    def ids(text: str) -> tuple[int, ...]:
        assert llm.tokenizer is not None
        return tuple(llm.tokenizer.encode(text))

    ab, c = ids("ab"), ids("c")
    assert cursors.valid_drafts(seq, (*ab, *ab)) == (*ab, *ab)
    assert cursors.valid_drafts(seq, (*ab, *c, *ab)) == ab
    assert cursors.valid_drafts(seq, ()) == ()
    # eos where the output is complete: kept, and nothing after it; where it is not: cut
    assert cursors.valid_drafts(seq, (*ids("ab"), eos, *ids("ab"))) == (*ids("ab"), eos)
    assert cursors.valid_drafts(seq, (*ids("a"), eos)) == ids("a")
    assert cursors.valid_drafts(seq, (*ids("ab"), 7, *ids("ab"))) == (*ids("ab"), 7)
    unconstrained = Sequence(1, "s", [5, 6], SamplingParams(), 64)
    assert cursors.valid_drafts(unconstrained, (eos, 9, 9)) == (eos, 9, 9)


def test_sampled_output_follows_the_models_distribution(prompts: list[list[int]]) -> None:
    """Three tokens of top-k 2 sampling: eight possible outputs, whose probabilities come
    from transformers. Many requests at once, each sampled with drafts from its context
    (unseeded: seeded requests do not speculate), must hit them in those proportions."""
    # the model's top two tokens after "the" are " file" and " it"; after " the file", prompt
    # lookup drafts " is", one of the model's top two there
    prompt = prompts[4] + prompts[4][3:8]  # "... If the file is not specified, the"
    torch.manual_seed(11)
    assert_samples_follow_top2_outcomes(speculating_llm(max_num_seqs=512), prompt)


def assert_samples_follow_top2_outcomes(llm: LLM, prompt: list[int]) -> None:
    """2 x 1000 requests of three tokens of top-k 2 sampling after ``prompt`` hit the eight
    outputs in the proportions transformers' probabilities give them; some drafts stood."""
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)
    expected: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, probability in expected.items():
            logprobs = hf_log_softmax(DEMO_MODEL, prompt + list(prefix))[-1]
            top = logprobs.topk(2)
            kept = top.values.softmax(dim=-1)
            for token, p in zip(top.indices.tolist(), kept.tolist(), strict=True):
                grown[(*prefix, token)] = probability * p
        expected = grown
    outcomes = sorted(expected)
    counts = np.zeros(len(outcomes), dtype=np.int64)
    for _ in range(2):
        for out in llm.generate([prompt] * 1000, params):
            counts[outcomes.index(tuple(out.outputs[0].token_ids))] += 1
    assert_matches(counts, np.array([expected[o] for o in outcomes]))
    assert_drafts_stood_and_fell(llm)


def masked_outcome_probabilities(
    llm: LLM, prompt: list[int], params: SamplingParams
) -> dict[tuple[int, ...], float]:
    """Every output ``params`` can give after ``prompt``, with its probability: at each step the
    model's logits (transformers) masked to what the engine's compiled grammar allows (eos
    where the output is a whole match), then temperature and top-k over what is left; a path
    ends at eos or at max_tokens."""
    assert params.structured_outputs is not None and params.max_tokens is not None
    grammar = llm.engine.grammars(params.structured_outputs)
    eos_token_ids = llm.engine.model_config.eos_token_ids
    ended: dict[tuple[int, ...], float] = {}
    # (output so far, its grammar state) -> probability
    growing: dict[tuple[tuple[int, ...], int], float] = {((), grammar.initial_state()): 1.0}
    for _ in range(params.max_tokens):
        grown: dict[tuple[tuple[int, ...], int], float] = {}
        for (output, state), probability in growing.items():
            logits = hf_log_softmax(DEMO_MODEL, prompt + list(output))[-1] / params.temperature
            logits = logits.masked_fill(~grammar.allowed_tokens(state), float("-inf"))
            kth = logits.topk(params.top_k).values[-1]
            probs = logits.masked_fill(logits < kth, float("-inf")).softmax(dim=-1)
            for token in probs.nonzero().flatten().tolist():
                path, p = (*output, token), probability * float(probs[token])
                if token in eos_token_ids:
                    ended[path] = p
                else:
                    grown[(path, grammar.advance(state, token))] = p
        growing = grown
    return ended | {output: p for (output, _), p in growing.items()}


def test_sampled_structured_output_follows_the_masked_distribution() -> None:
    """Three tokens of top-k 2 sampling under a grammar: at each step the model's distribution
    masked to what the grammar allows, then temperature and top-k. Drafts come from the prompt
    (" and" -> " return", " or" -> " close"); a draft row is masked by the state the drafts
    before it lead to, so a draft stands with its masked probability, and the token drawn where
    it falls is one the grammar allows. Unseeded: seeded requests do not speculate."""
    llm = speculating_llm(max_num_seqs=512)
    assert llm.tokenizer is not None
    prompt = llm.tokenizer.encode(
        "Open a file and return a stream. Open a file or close it. Open a file"
    )
    spec = StructuredOutputSpec(regex=r"( and| or)( return| close)( it)?")
    params = SamplingParams(temperature=1.5, top_k=2, max_tokens=3, structured_outputs=spec)
    expected = masked_outcome_probabilities(llm, prompt, params)
    # the model's top two allowed first tokens are " or" and " and"; after " or" its top two
    # allowed are " return" and " c" (the draft " close" always falls), after " and" " return"
    # and " close"; eos may end the output after two tokens
    eos_token_ids = llm.engine.model_config.eos_token_ids
    assert len(expected) == 8 and any(o[-1] in eos_token_ids for o in expected)
    outcomes = sorted(expected)
    torch.manual_seed(11)
    counts = np.zeros(len(outcomes) + 1, dtype=np.int64)  # the last: outputs it cannot give
    for _ in range(2):
        for out in llm.generate([prompt] * 2000, params):
            token_ids = tuple(out.outputs[0].token_ids)
            counts[outcomes.index(token_ids) if token_ids in expected else -1] += 1
    assert_matches(counts, np.array([expected[o] for o in outcomes] + [0.0]))
    assert_drafts_stood_and_fell(llm)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_other_attention_backends_check_drafts_too(
    prompts: list[list[int]], expected: list[list[int]], backend: str
) -> None:
    """The torch reference and Triton (its interpreter without a GPU) run a sequence's token
    and drafts through their prefill path, over its paged context."""
    llm = speculating_llm(attention_backend=backend)
    assert llm.engine.runner.attn_backend.name == backend
    (out,) = llm.generate([prompts[4]], SamplingParams(temperature=0.0, max_tokens=24))
    assert out.outputs[0].token_ids == expected[4][:24]
    assert_drafts_stood_and_fell(llm)


def test_steps_with_drafts_replay_decode_graphs(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """A verify step runs from the decode graphs (EagerCapturer standing in for CUDA graphs,
    Triton's interpreter for the GPU): a row per token, drafts included, each attending to its
    own context through the decode kernel, which takes a sequence's rows together."""
    llm = speculating_llm(attention_backend="triton", max_model_len=128)
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.model,
        engine.kv_cache,
        engine.runner.attn_backend,
        max_model_len=engine.max_model_len,
        batch_sizes=(1, 2, 4, 6, 8, 10),  # 2 sequences of 1 + 4 rows at most
        capturer=EagerCapturer(),
        max_rows_per_seq=1 + NGRAM["num_speculative_tokens"],
    )
    engine.runner.decode_graphs = graphs
    chosen = (0, 4)
    params = [SamplingParams(temperature=0.0, max_tokens=32) for _ in chosen]
    outputs = llm.generate([prompts[i] for i in chosen], params)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[i][:32] for i in chosen]
    assert_drafts_stood_and_fell(llm)
    # every step after the one of the prompts replays a graph, some with more rows than the
    # 2 sequences (a plain decode step's rows)
    assert sum(graphs.num_replays.values()) == engine.stats.num_steps - 1
    assert max(graphs.num_replays) > 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_drafts_give_the_tokens_of_the_engine_without_them(
    prompts: list[list[int]],
) -> None:
    """Every step after the prompts' replays a CUDA graph, those with drafts included: with 5
    sequences at most, the buckets reach 5 x (1 + 4) rows."""
    plain = LLM(str(DEMO_MODEL), dtype="float32", device="cuda")
    llm = LLM(
        str(DEMO_MODEL),
        dtype="float32",
        device="cuda",
        speculative_config=NGRAM,
        max_num_seqs=len(prompts),
    )
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy())]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())] == expected
    assert_drafts_stood_and_fell(llm)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None
    assert sum(graphs.num_replays.values()) == llm.engine.stats.num_steps - 1
    assert max(graphs.num_replays) > 8
