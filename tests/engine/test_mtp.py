"""Speculative decoding with the model's own multi-token-prediction layer (``"method": "mtp"``,
engine/speculative/mtp.py): greedy output is transformers' token for token, and every draft the
layer makes is the one transformers' modules compute on the checkpoint's weights with the whole
context recomputed (tests/engine/mtp_reference.py), in every engine mode: so its KV cache slot
holds, position by position, what the layer computes from the target's hidden states, whatever
the step that computed them (prompt chunks, decodes, drafts checked and standing or falling,
recomputation after preemption, prefix-cache hits).

Checkpoints: DeepSeek-V3 whose decoder layers add nothing (its next token a function of the
current one) and whose prediction layer, but for a perturbation of its attention, predicts the
token after the next from that token's embedding (bench/mtp.py's ``predictable``): about half
the drafts stand; the same exact: every draft stands; the same in DeepSeek-V3's published FP8
layout (float8 blocks); and a random GLM-4.5 (grouped-query attention rather than latent), whose
drafts fall.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.mtp import predictable
from engine import LLM, SamplingParams
from engine.kv_cache.kv_quantization import storage_dtype
from engine.model_config import load_model_config
from engine.model_loader import load_prediction_layer
from engine.models.prediction_layer import prediction_layer_config
from engine.parallel.shard import TensorParallelShard
from engine.quantization.config import Fp8BlockWeights, PackedIntWeights
from engine.quantization.fp8_linear import Fp8BlockLinear
from engine.speculative.config import SpeculativeConfig
from engine.speculative.mtp import MtpDrafter
from engine.speculative.prediction_checks import check_prediction_layer
from tests.engine.hf_reference import hf_greedy
from tests.engine.mtp_reference import reference_drafts
from tests.engine.quantized_kv_reference import transformers_quantized_kv_greedy
from tests.fixtures.quantized_models import QUANTIZABLE_LLAMA, write_fp8_blocks
from tests.fixtures.tiny_models import make_tiny_model, make_tiny_mtp_model

V3, GLM = "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"
MAX_TOKENS = 24
K = 3  # drafts per step
PERTURBATION = 0.01  # of the tiny model's prediction layer's o_proj: about half the drafts stand
GLM_PERTURBATION = 0.03  # GLM-4.5's (of wider heads), which reads the hidden state too
HIDDEN_SHARE = 0.2  # of GLM-4.5's layer's input, from the hidden state: about half stand


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    made = make_tiny_mtp_model(tmp_path_factory.mktemp("mtp-v3"), V3)
    return predictable(made, perturbation=PERTURBATION)


@pytest.fixture(scope="module")
def exact_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The prediction layer predicts the token after the next exactly: every draft stands."""
    made = make_tiny_mtp_model(tmp_path_factory.mktemp("mtp-exact"), V3)
    return predictable(made, perturbation=0.0)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bigram_dir``'s kind in DeepSeek-V3's published FP8 layout (blocks of 8 here, whole
    over the tiny widths): every decoder projection, the prediction layer's too, in float8
    blocks; its ``eh_proj``, norms, embeddings and head float."""
    root = tmp_path_factory.mktemp("mtp-fp8")
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_key_value_heads": 4, "head_dim": 8}
    made = make_tiny_mtp_model(root / "float", V3, **{**QUANTIZABLE_LLAMA, **sizes})
    return write_fp8_blocks(predictable(made, perturbation=PERTURBATION), root / "fp8", (8, 8))


@pytest.fixture(scope="module")
def glm_bigram_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bigram_dir``'s kind of GLM-4.5 (grouped-query attention), whose layer reads the
    target's hidden states too (a wrong row of them moves its drafts)."""
    made = make_tiny_mtp_model(tmp_path_factory.mktemp("mtp-glm-bigram"), GLM)
    return predictable(made, perturbation=GLM_PERTURBATION, hidden_share=HIDDEN_SHARE)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mtp_model(tmp_path_factory.mktemp("mtp-glm"), GLM)


@pytest.fixture
def drafts_made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[list[int], tuple]]]:
    """(a sequence's tokens, the drafts made to follow them) for each draft the engine made."""
    made: list[tuple[list[int], tuple]] = []
    draft_after = MtpDrafter.draft_after

    def recording(self: MtpDrafter, output, step) -> None:  # type: ignore[no-untyped-def]
        draft_after(self, output, step)
        for entry in step.ordered:
            drafted = self._drafts.get(entry.seq.seq_id)
            if drafted is not None:
                made.append((list(entry.seq.token_ids), drafted[1]))

    monkeypatch.setattr(MtpDrafter, "draft_after", recording)
    yield made


def _prompts(num: int, length: int = 13) -> list[list[int]]:
    return [[(37 * i + 11 * j + 5) % 1000 + 3 for j in range(length + 3 * i)] for i in range(num)]


def _mtp_llm(model_dir: Path, **kwargs: object) -> LLM:
    options: dict = {"dtype": "float32", "device": "cpu", "block_size": 8, **kwargs}
    options.setdefault("speculative_config", {"method": "mtp", "num_speculative_tokens": K})
    return LLM(str(model_dir), **options)


def _assert_as_transformers(
    model_dir: Path, llm: LLM, prompts: list[list[int]], made: list[tuple[list[int], tuple]]
) -> None:
    """Greedy tokens are transformers'; every draft the one transformers' modules make."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)
    assert made, "no drafts made"
    for tokens, drafts in made:
        assert list(drafts) == reference_drafts(model_dir, tokens, len(drafts)), len(tokens)


MODES = {
    "batched": {},
    "chunked": {"max_num_batched_tokens": 16},  # prompts of 13 to 22 tokens in pieces
    "preempted": {"num_kv_blocks": 12},  # recomputed from its tokens when it runs again
}


@pytest.mark.parametrize("mode", list(MODES))
def test_drafts_are_the_prediction_layers_and_output_is_transformers(
    bigram_dir: Path, drafts_made: list, mode: str
) -> None:
    llm = _mtp_llm(bigram_dir, **MODES[mode])
    _assert_as_transformers(bigram_dir, llm, _prompts(4), drafts_made)
    stats = llm.engine.stats
    # about half the drafts stand: the layer's attention (and so its KV) moves the others
    assert 0.3 < stats.num_accepted_draft_tokens / stats.num_draft_tokens < 1.0
    if mode == "preempted":
        assert llm.engine.num_preemptions > 0


@pytest.mark.parametrize("mode", ["batched", "preempted"])
def test_an_exact_prediction_layer_has_every_draft_stand(exact_dir: Path, mode: str) -> None:
    """Each step of a decoding sequence gives it K + 1 tokens: the drafts made into the
    lookahead slots past its step, every one standing."""
    llm = _mtp_llm(exact_dir, **MODES[mode])
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(exact_dir, prompt, MAX_TOKENS)
    stats = llm.engine.stats
    assert stats.num_accepted_draft_tokens == stats.num_draft_tokens > 0
    if mode == "batched":  # the prompts' step, then K + 1 tokens a step
        assert stats.num_steps <= 1 + MAX_TOKENS // (K + 1) + 1


def test_prefix_cache_hits_keep_the_layers_kv(bigram_dir: Path, drafts_made: list) -> None:
    """A prompt sent again takes its blocks from the prefix cache, the layer's KV in them."""
    llm = _mtp_llm(bigram_dir, enable_prefix_caching=True)
    prompts = _prompts(2, length=21)
    _assert_as_transformers(bigram_dir, llm, prompts, drafts_made)
    drafts_made.clear()
    hits_before = llm.engine.block_manager.pool.num_cache_hits
    _assert_as_transformers(bigram_dir, llm, prompts, drafts_made)
    assert llm.engine.block_manager.pool.num_cache_hits > hits_before


def test_greedy_samples_of_one_request_draft_after_they_fork(
    bigram_dir: Path, drafts_made: list
) -> None:
    """n = 3 greedy: the samples fork at the prompt's last position (whose layer KV, computed
    with the first sample's token, is every sample's here), then each drafts on its own."""
    llm = _mtp_llm(bigram_dir)
    (prompt,) = _prompts(1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    (output,) = llm.generate([prompt], params)
    assert [c.token_ids for c in output.outputs] == [hf_greedy(bigram_dir, prompt, MAX_TOKENS)] * 3
    assert len({tuple(tokens) for tokens, _ in drafts_made}) < len(drafts_made)  # each sample
    for tokens, drafts in drafts_made:
        assert list(drafts) == reference_drafts(bigram_dir, tokens, len(drafts))


def test_latent_free_attention_drafts_fall_and_output_is_transformers(
    glm_dir: Path, drafts_made: list
) -> None:
    """GLM-4.5's prediction layer (grouped-query attention with biases and q/k norms), random:
    its drafts are transformers' and, but for chance, fall."""
    llm = _mtp_llm(glm_dir)
    _assert_as_transformers(glm_dir, llm, _prompts(3), drafts_made)
    assert llm.engine.stats.num_draft_tokens > 0


def test_no_drafts_above_disable_by_batch_size_yet_the_layer_keeps_up(
    bigram_dir: Path, drafts_made: list
) -> None:
    """Three running: no drafts, but the layer's KV still written; once two finish, the last
    one's drafts are what the whole context gives."""
    speculative = {"method": "mtp", "num_speculative_tokens": K, "disable_by_batch_size": 1}
    llm = _mtp_llm(bigram_dir, speculative_config=speculative)
    prompts = _prompts(3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 6, MAX_TOKENS)
    ]
    outputs = llm.generate(prompts, params)
    assert outputs[2].outputs[0].token_ids == hf_greedy(bigram_dir, prompts[2], MAX_TOKENS)
    assert drafts_made and all(len(tokens) > len(prompts[2]) + 6 for tokens, _ in drafts_made)
    for tokens, drafts in drafts_made:
        assert list(drafts) == reference_drafts(bigram_dir, tokens, len(drafts))


def test_the_config_names_the_layers_and_vllms_older_method_names() -> None:
    assert SpeculativeConfig.from_mapping(
        {"method": "deepseek_mtp", "num_speculative_tokens": 1}
    ) == SpeculativeConfig(1, method="mtp")
    with pytest.raises(ValueError, match="speculative_config.model is required by method"):
        SpeculativeConfig.from_mapping(
            {"method": "mtp", "model": "/m", "num_speculative_tokens": 1}
        )


def test_the_prediction_layers_are_read_from_the_config(bigram_dir: Path, glm_dir: Path) -> None:
    assert load_model_config(bigram_dir).num_prediction_layers == 1
    assert load_model_config(glm_dir).num_prediction_layers == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"async_scheduling": True}, "async_scheduling does not combine"),
    ],
)
def test_what_the_layer_cannot_run_with_is_refused_naming_the_field(
    bigram_dir: Path, options: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _mtp_llm(bigram_dir, **options)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("checkpoint", "expert_parallel"),
    [("bigram_dir", False), ("glm_bigram_dir", False), ("glm_bigram_dir", True)],
    ids=["deepseek-v3", "glm-4.5", "glm-4.5-expert-parallel"],
)
def test_under_tensor_parallelism_each_rank_holds_its_shard_of_the_layer(
    checkpoint: str, expert_parallel: bool, request: pytest.FixtureRequest, drafts_made: list
) -> None:
    """Two ranks, preempting: each holds half the layer's heads (DeepSeek-V3: its query heads,
    the latent slot whole on each; GLM-4.5: its KV heads' slot too) and half its experts'
    columns, or half its experts whole, and runs each of its forwards; output and drafts are
    transformers' (the bigram targets have no near-ties the ranks' summation order could
    flip)."""
    model_dir = request.getfixturevalue(checkpoint)
    llm = _mtp_llm(
        model_dir, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
        **MODES["preempted"],
    )  # fmt: skip
    try:
        drafter = llm.engine.runner.drafter
        assert isinstance(drafter, MtpDrafter)
        shard, config = drafter.predictor.shard, drafter.predictor.config
        assert (shard.size, len(shard.q_heads)) == (2, config.num_heads // 2)
        assert shard.expert_parallel is expert_parallel
        _assert_as_transformers(model_dir, llm, _prompts(4), drafts_made)
        assert llm.engine.num_preemptions > 0
        stats = llm.engine.stats
        assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    finally:
        llm.close()


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_a_rank_loads_its_slice_of_the_layer(glm_bigram_dir: Path, load_format: str) -> None:
    """Rank 1 of 2: the second half of the vocabulary's rows of the layer's embeddings and
    head, of its query heads' rows of q_proj, and the whole of eh_proj and the norms: as the
    whole layer holds them (dummy weights too: the whole's, sliced)."""
    config = prediction_layer_config(glm_bigram_dir)
    shard = TensorParallelShard.of(config, 1, 2)
    options: dict = {"load_format": load_format, "linear_backend": "torch"}
    cpu, f32 = torch.device("cpu"), torch.float32
    whole = load_prediction_layer(glm_bigram_dir, f32, cpu, **options).layer
    mine = load_prediction_layer(glm_bigram_dir, f32, cpu, **options, shard=shard).layer
    vocab = slice(shard.vocab.start, min(shard.vocab.stop, config.vocab_size))
    held = vocab.stop - vocab.start
    assert torch.equal(mine.embed_tokens.weight[:held], whole.embed_tokens.weight[vocab])
    assert torch.equal(mine.shared_head.head.weight[:held], whole.shared_head.head.weight[vocab])
    assert torch.equal(mine.eh_proj.weight, whole.eh_proj.weight)
    assert torch.equal(mine.hnorm.weight, whole.hnorm.weight)
    q_rows = slice(shard.q_heads.start * config.head_dim, shard.q_heads.stop * config.head_dim)
    q_size = len(shard.q_heads) * config.head_dim
    assert torch.equal(
        mine.self_attn.qkv_proj.weight[:q_size], whole.self_attn.qkv_proj.weight[q_rows]
    )


@pytest.mark.parametrize(
    ("checkpoint", "kv_cache_dtype"), [("bigram_dir", "fp8_e4m3"), ("glm_bigram_dir", "int8")]
)
def test_a_quantized_kv_cache_holds_the_layers_slot_by_its_own_scales(
    checkpoint: str, kv_cache_dtype: str, request: pytest.FixtureRequest, drafts_made: list
) -> None:
    """The layer's slot is calibrated with the model's (the last scales) and stored quantized;
    every draft is what transformers' modules compute with every layer's K/V (the layer's by
    its slot's scales) stored and read back as the cache does."""
    model_dir = request.getfixturevalue(checkpoint)
    llm = _mtp_llm(model_dir, kv_cache_dtype=kv_cache_dtype, **MODES["chunked"])
    scales = llm.engine.kv_cache_scales
    assert scales is not None
    assert scales.num_layers == load_model_config(model_dir).num_layers + 1
    assert llm.engine.kv_cache.dtype == storage_dtype(kv_cache_dtype, torch.float32)
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    expected = transformers_quantized_kv_greedy(model_dir, scales, prompts, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert drafts_made
    for tokens, drafts in drafts_made:
        assert list(drafts) == reference_drafts(model_dir, tokens, len(drafts), scales)
    stats = llm.engine.stats
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens


def test_a_prediction_layer_in_fp8_blocks_drafts_as_transformers(
    fp8_dir: Path, drafts_made: list
) -> None:
    """The layer's attention and MLP projections stay float8 in memory, as the model's do; its
    drafts are what transformers' modules compute on the same files (dequantizing them)."""
    llm = _mtp_llm(fp8_dir, **MODES["chunked"])
    drafter = llm.engine.runner.drafter
    assert isinstance(drafter, MtpDrafter)
    layer = drafter.predictor.layer
    assert isinstance(layer.self_attn.o_proj, Fp8BlockLinear)
    assert layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert not isinstance(layer.eh_proj, Fp8BlockLinear)  # float (packed for oneDNN)
    _assert_as_transformers(fp8_dir, llm, _prompts(4), drafts_made)
    stats = llm.engine.stats
    assert 0.3 < stats.num_accepted_draft_tokens / stats.num_draft_tokens < 1.0


def test_a_checkpoint_without_its_prediction_layers_tensors_is_refused(tmp_path: Path) -> None:
    """Its config counts one (as llm-compressor's re-saved DeepSeek-V3 keeps it), its tensors
    are gone."""
    model_dir = make_tiny_model(tmp_path, V3)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers is 1, but the checkpoint"):
        _mtp_llm(model_dir)


def test_quantized_layouts_other_than_fp8_blocks_are_refused_naming_the_method(
    bigram_dir: Path,
) -> None:
    config = load_model_config(bigram_dir)
    w4a16 = dataclasses.replace(config, quantization=PackedIntWeights(4, 128, symmetric=True))
    with pytest.raises(ValueError, match="quant_method 'fp8'.*got compressed-tensors w4a16"):
        check_prediction_layer(w4a16)
    fp8 = dataclasses.replace(config, quantization=Fp8BlockWeights(128, 128))
    check_prediction_layer(fp8)


def test_a_model_without_prediction_layers_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has none \(config.json's num_nextn"):
        _mtp_llm(llama_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_layer_drafts_and_the_tokens_are_the_engines_without_it(
    exact_dir: Path, bigram_dir: Path
) -> None:
    """The layer's forwards (eager, on the Triton latent attention) beside the model's steps:
    the exact layer's drafts all stand, the perturbed one's not all, the tokens unchanged."""
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for model_dir, all_stand in ((exact_dir, True), (bigram_dir, False)):
        plain = LLM(str(model_dir), dtype="float32", device="cuda")
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        llm = _mtp_llm(model_dir, device="cuda")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        stats = llm.engine.stats
        assert (stats.num_accepted_draft_tokens == stats.num_draft_tokens > 0) is all_stand
