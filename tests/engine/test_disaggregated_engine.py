"""Prefill on one engine, decode on another: the same tokens as one engine, in every path."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.messages import PrefillResult, TokenEvent
from engine.outputs import PromptLogprobs, RequestOutput
from engine.request_state import prompt_position_logprobs
from tests.conftest import ARCHITECTURES
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_parity import OUTPUT_LENGTHS, make_prompts, reference


def _engine(model_dir: Path, **kwargs: object) -> LLMEngine:
    kwargs.setdefault("block_size", 8)
    return LLM(str(model_dir), dtype="float32", device="cpu", **kwargs).engine  # type: ignore[arg-type]


def _prefill_all(prefill: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):  # type: ignore[no-untyped-def]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        prefill.add_request(f"r{i}", prompt, p, prefill_only=True)
    handed: list[PrefillResult] = []
    finished = []
    while prefill.has_unfinished_requests() and len(handed) + len(finished) < len(prompts):
        step = prefill.step()
        handed += step.handed_off
        finished += step.finished
    return handed, finished


def _decode_all(
    prefill: LLMEngine, decode: LLMEngine, handed: list[PrefillResult], *, transfer: bool
) -> dict[str, list[list[int]]]:
    for result in handed:
        if transfer:
            dst = decode.reserve_blocks(result.request_id, result.num_prompt_tokens)
            assert dst is not None and len(dst) == len(result.block_ids)
            decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, result.block_ids]
        decode.admit_prefilled(result, kv_received=transfer)
        prefill.release_lease(result.request_id)
    outputs = {}
    while decode.has_unfinished_requests():
        for out in decode.step().finished:
            outputs[out.request_id] = [c.token_ids for c in out.outputs]
    return outputs


@pytest.mark.parametrize("transfer", [True, False], ids=["kv-transfer", "recompute"])
def test_split_greedy_matches_transformers(llama_dir: Path, transfer: bool) -> None:
    prompts = make_prompts(seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in OUTPUT_LENGTHS]
    prefill = _engine(llama_dir, max_num_batched_tokens=64)
    decode = _engine(llama_dir, num_kv_blocks=200)
    handed, finished = _prefill_all(prefill, prompts, params)
    assert [o.request_id for o in finished] == ["r3"]  # max_tokens=1 ends on the prefill side
    outputs = _decode_all(prefill, decode, handed, transfer=transfer)
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(llama_dir, prompt, OUTPUT_LENGTHS[i])
        if i == 3:
            assert finished[0].outputs[0].token_ids == expected
        else:
            assert outputs[f"r{i}"] == [expected]
    assert prefill.block_manager.usage == 0  # every lease released
    assert decode.block_manager.usage == 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_split_matches_transformers(
    model_dirs: dict[str, Path], arch: str
) -> None:
    """Each architecture's hand-off (its KV as it caches it: K and V per layer, a latent per
    layer, a table per group of sliding and full layers, whose windows of 24 these prompts
    outgrow), prefilled in chunks of 32 and decoded on another engine, equals transformers."""
    model_dir = model_dirs[arch]
    prompts = make_prompts(seed=1)[2:6]  # 17 to 100 tokens
    lengths = OUTPUT_LENGTHS[2:6]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths]
    prefill = _engine(model_dir, max_num_batched_tokens=32)
    decode = _engine(model_dir)
    handed, finished = _prefill_all(prefill, prompts, params)
    outputs = _decode_all(prefill, decode, handed, transfer=True)
    for out in finished:  # max_tokens=1 ends on the prefill side
        outputs[out.request_id] = [c.token_ids for c in out.outputs]
    expected = reference(model_dir, make_prompts(seed=1), "plain")[2:6]
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [[e] for e in expected]
    assert prefill.block_manager.usage == 0 and decode.block_manager.usage == 0


def test_split_seeded_samples_match_one_engine(llama_dir: Path) -> None:
    prompts = make_prompts(seed=12)[2:6]
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, n=3, seed=40 + i)
        for i in range(len(prompts))
    ]
    colocated = LLM(str(llama_dir), dtype="float32", device="cpu").generate(prompts, params)
    prefill = _engine(llama_dir)
    decode = _engine(llama_dir)
    handed, _ = _prefill_all(prefill, prompts, params)
    outputs = _decode_all(prefill, decode, handed, transfer=True)
    for i, out in enumerate(colocated):
        assert outputs[f"r{i}"] == [c.token_ids for c in out.outputs]


def test_lease_keeps_blocks_until_released_then_they_stay_cached(llama_dir: Path) -> None:
    prefill = _engine(llama_dir)
    prompt = make_prompts(seed=13)[5]  # 100 tokens: 12 full blocks of 8
    params = SamplingParams(temperature=0.0, max_tokens=8)
    (result,), _ = _prefill_all(prefill, [prompt], [params])
    assert prefill.block_manager.usage > 0
    assert len(result.block_ids) == 13
    assert [s.finish_reason for s in result.samples] == [None]
    prefill.release_lease(result.request_id)
    assert prefill.block_manager.usage == 0
    prefill.add_request("again", prompt, params, prefill_only=True)
    step = prefill.step()
    assert step.handed_off[0].num_cached_tokens == 96


def test_reservation_refused_when_blocks_run_out_and_cancel_frees(llama_dir: Path) -> None:
    decode = _engine(llama_dir, num_kv_blocks=20)
    assert decode.reserve_blocks("a", 100) is not None  # 13 blocks
    assert decode.reserve_blocks("b", 100) is None
    decode.cancel_reservation("a")
    assert decode.reserve_blocks("b", 100) is not None
    with pytest.raises(ValueError, match="already in use"):
        decode.reserve_blocks("b", 8)


def test_abort_of_a_handed_off_request_releases_its_lease(llama_dir: Path) -> None:
    prefill = _engine(llama_dir)
    (result,), _ = _prefill_all(prefill, [make_prompts(seed=14)[4]], [SamplingParams(max_tokens=5)])
    prefill.abort_request(result.request_id)
    assert prefill.block_manager.usage == 0
    assert not prefill.has_unfinished_requests()


def test_admit_without_reservation_is_refused(llama_dir: Path) -> None:
    prefill = _engine(llama_dir)
    decode = _engine(llama_dir)
    (result,), _ = _prefill_all(prefill, [make_prompts(seed=15)[4]], [SamplingParams(max_tokens=5)])
    with pytest.raises(ValueError, match="no reserved blocks"):
        decode.admit_prefilled(result, kv_received=True)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.9, top_k=50, max_tokens=20, n=2, seed=77),
    ],
    ids=["greedy", "seeded-n2"],
)
def test_resumed_request_continues_exactly(llama_dir: Path, params: SamplingParams) -> None:
    prompt = make_prompts(seed=16)[4]
    (full,) = LLM(str(llama_dir), dtype="float32", device="cpu").generate([prompt], params)
    engine = _engine(llama_dir)
    delivered = {c.index: c.token_ids[:7] for c in full.outputs}
    engine.add_request("resumed", prompt, params, resume_token_ids=delivered)
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step().finished
    (out,) = finished
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in full.outputs]
    with pytest.raises(ValueError, match="nothing left to generate"):
        engine.add_request("done", prompt, params, resume_token_ids={0: full.outputs[0].token_ids})


@pytest.mark.parametrize("chunk", [2048, 8], ids=["whole-prompt", "chunked"])
def test_received_kv_waiting_behind_a_recompute_does_not_hang(llama_dir: Path, chunk: int) -> None:
    """The head of the queue recomputes its prompt (its transfer failed) and needs 9 of the 10
    blocks; the request queued behind it holds 3, received. Nothing else runs, so those blocks
    come free only if the scheduler takes them back: every step ran nothing (the whole prompt
    never fit), or the head, chunk by chunk, filled the 7 free blocks, preempted itself and
    started again, for ever."""
    prompts = [make_prompts(seed=17)[4][:30], make_prompts(seed=17)[3][:12]]
    params = SamplingParams(temperature=0.0, max_tokens=5)
    prefill = _engine(llama_dir, block_size=4)
    handed, _ = _prefill_all(prefill, prompts, [params] * 2)
    decode = _engine(
        llama_dir,
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,  # a head admitted again would find its chunks cached
    )
    decode.admit_prefilled(handed[0], kv_received=False)
    dst = decode.reserve_blocks(handed[1].request_id, len(prompts[1]))
    assert dst is not None and len(dst) == 3
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, handed[1].block_ids]
    decode.admit_prefilled(handed[1], kv_received=True)
    outputs = {}
    for _ in range(100):
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in decode.step().finished)
        if not decode.has_unfinished_requests():
            break
    assert outputs == {f"r{i}": hf_greedy(llama_dir, p, 5) for i, p in enumerate(prompts)}
    assert decode.block_manager.usage == 0
    assert decode.num_preemptions > 0  # the received KV was dropped and recomputed


def test_split_honours_logit_bias_and_allowed_token_ids(llama_dir: Path) -> None:
    """The prefill side samples each first token and the decode side the rest, both with the
    same Sampler: a bias and an allowed set bind both sides, as on one engine."""
    prompts = make_prompts(seed=18)[2:5]
    forced, allowed = 77, [40, 41, 300, 777]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={forced: 100}),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(
            temperature=1.3,
            max_tokens=8,
            ignore_eos=True,
            n=2,
            seed=5,
            allowed_token_ids=allowed,
            logit_bias={300: -100, 41: 1.5},
        ),
    ]
    colocated = LLM(str(llama_dir), dtype="float32", device="cpu").generate(prompts, params)
    prefill = _engine(llama_dir)
    decode = _engine(llama_dir)
    handed, finished = _prefill_all(prefill, prompts, params)
    assert not finished and len(handed) == 3
    first_tokens = {r.request_id: [s.first_token_id for s in r.samples] for r in handed}
    assert first_tokens["r0"] == [forced]
    assert set(first_tokens["r1"] + first_tokens["r2"]) <= set(allowed)
    outputs = _decode_all(prefill, decode, handed, transfer=True)
    assert outputs["r0"] == [[forced] * 8]
    assert all(set(tokens) <= set(allowed) for tokens in outputs["r1"] + outputs["r2"])
    assert all(300 not in tokens for tokens in outputs["r2"])
    for i, out in enumerate(colocated):
        assert outputs[f"r{i}"] == [c.token_ids for c in out.outputs]


def test_split_bad_words_see_the_first_token_sampled_by_prefill(llama_dir: Path) -> None:
    """A bad word whose prefix is the first token (sampled on the prefill side) bans its last
    token at the decode side's first step: the decode side's history holds that first token."""
    prompts = make_prompts(seed=19)[1:3]
    common = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    colocated = LLM(str(llama_dir), dtype="float32", device="cpu")
    natural = [
        o.outputs[0].token_ids for o in colocated.generate(prompts, SamplingParams(**common))
    ]
    params = [
        SamplingParams(**common, bad_words_token_ids=[natural[0][:2]]),
        SamplingParams(**common, bad_words_token_ids=[natural[1][:2], [natural[1][3]]]),
    ]
    expected = [o.outputs[0].token_ids for o in colocated.generate(prompts, params)]
    prefill, decode = _engine(llama_dir), _engine(llama_dir)
    handed, finished = _prefill_all(prefill, prompts, params)
    assert not finished and len(handed) == 2
    outputs = _decode_all(prefill, decode, handed, transfer=True)
    assert [outputs["r0"][0], outputs["r1"][0]] == expected
    for out, free in zip(expected, natural, strict=True):
        assert out[0] == free[0] and out[1] != free[1]  # banned on the decode side's first step
    assert natural[1][3] not in expected[1]


def test_prefill_side_gives_the_prompt_logprobs_of_a_colocated_engine(llama_dir: Path) -> None:
    """Prefill only: the first-token event of sample 0 carries the prompt logprobs, once per
    request (what a prefill worker streams to the gateway), equal to a colocated engine's; a
    request that ends on its first token has them in its RequestOutput too."""
    prompts = make_prompts(seed=20)[2:6]  # 17, 40, 64 and 100 tokens: chunked by 32
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=3),
        SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=9, prompt_logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5),  # ends on prefill
        SamplingParams(temperature=0.0, max_tokens=6),  # does not ask
    ]
    colocated = LLM(
        str(llama_dir), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=32
    ).generate(prompts, params)
    prefill = _engine(llama_dir, max_num_batched_tokens=32)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        prefill.add_request(f"r{i}", prompt, p, prefill_only=True)
    events: list[TokenEvent] = []
    handed: list[PrefillResult] = []
    finished: list[RequestOutput] = []
    while len(handed) + len(finished) < len(prompts):
        step = prefill.step()
        events += step.new_tokens
        handed += step.handed_off
        finished += step.finished
    shipped = {e.request_id: e.prompt_logprobs for e in events if e.prompt_logprobs is not None}
    assert sorted(shipped) == ["r0", "r1", "r2"]
    for i in range(3):
        assert _logprob_values(prompt_position_logprobs(shipped[f"r{i}"])) == pytest.approx(
            _logprob_values(colocated[i].prompt_logprobs), abs=1e-5
        )
    (ended,) = finished
    assert ended.request_id == "r2" and ended.prompt_logprobs is not None
    assert _logprob_values(ended.prompt_logprobs) == _logprob_values(
        prompt_position_logprobs(shipped["r2"])
    )
    outputs = _decode_all(prefill, _engine(llama_dir), handed, transfer=True)
    for i in (0, 1, 3):
        assert outputs[f"r{i}"] == [c.token_ids for c in colocated[i].outputs]


def _logprob_values(prompt_logprobs: PromptLogprobs | None) -> list[object]:
    """Token ids, ranks and logprobs by position, without the decoded text."""
    assert prompt_logprobs is not None
    values: list[object] = []
    for position in prompt_logprobs:
        if position is None:
            values.append(None)
            continue
        for token_id, logprob in position.items():
            values += [token_id, logprob.rank, logprob.logprob]
    return values
