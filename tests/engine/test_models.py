"""Our model + loader + torch attention backend against Hugging Face forward, logit by logit.

Every scenario runs the tokens through the paged KV cache in some split (one-shot prefill,
chunked prefill, mixed prefill/decode batches, decode steps) and compares each computed
token's logits with one full-sequence Hugging Face forward (causal, so row p only depends on
tokens <= p).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.model_config import SUPPORTED_ARCHITECTURES, load_model_config
from engine.model_loader import load_model
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import get_model_class
from tests.engine.hf_reference import hf_model
from tests.engine.paged_runner import PagedRunner, PagedSeq
from tests.fixtures.tiny_models import make_tiny_model, tiny_hf_config

ATOL = 1e-4
CPU = torch.device("cpu")


def _tokens(num: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1024, (num,), generator=generator).tolist()


def _load(model_dir: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(model_dir, load_model_config(model_dir), dtype, CPU)


def _runner(model_dir: Path, dtype: torch.dtype = torch.float32) -> PagedRunner:
    return PagedRunner(_load(model_dir, dtype), load_model_config(model_dir), dtype=dtype)


def _assert_matches_hf(model_dir: Path, seqs: list[PagedSeq], atol: float = ATOL) -> None:
    for seq in seqs:
        ours = torch.stack(seq.logits)  # [num_computed, vocab]
        with torch.no_grad():
            ref = hf_model(model_dir)(torch.tensor([seq.token_ids[: seq.num_computed]])).logits[0]
        torch.testing.assert_close(ours, ref.float(), atol=atol, rtol=0)


@pytest.fixture(params=SUPPORTED_ARCHITECTURES)
def arch_dir(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Path:
    return model_dirs[request.param]


def test_one_shot_prefill(arch_dir: Path) -> None:
    runner = _runner(arch_dir)
    seq = runner.new_seq(_tokens(40, seed=1))
    runner.step([(seq, 40)])
    _assert_matches_hf(arch_dir, [seq])


def test_chunked_prefill_with_cached_prefix(arch_dir: Path) -> None:
    runner = _runner(arch_dir)
    seq = runner.new_seq(_tokens(40, seed=2))
    for chunk in (15, 13, 12):
        runner.step([(seq, chunk)])
    _assert_matches_hf(arch_dir, [seq])


def test_mixed_prefill_and_decode_batch_then_decode_steps(arch_dir: Path) -> None:
    runner = _runner(arch_dir)
    chunked, fresh, short, long = (runner.new_seq(_tokens(n, seed=n)) for n in (40, 29, 18, 31))
    runner.step([(short, 13), (long, 26), (chunked, 20)])
    # one step: a prefill with cached prefix, a fresh prefill, two decodes (order shuffled)
    runner.step([(short, 1), (chunked, 16), (long, 1), (fresh, 25)])
    for _ in range(4):  # decode steps for all four at different context lengths
        runner.step([(seq, 1) for seq in (chunked, fresh, short, long)])
    _assert_matches_hf(arch_dir, [chunked, fresh, short, long])


def test_greedy_decode_steps(arch_dir: Path) -> None:
    runner = _runner(arch_dir)
    seq = runner.new_seq(_tokens(40, seed=3) + [0] * 8)
    runner.step([(seq, 40)])
    for _ in range(8):  # feed back our own greedy token, as generation does
        seq.token_ids[seq.num_computed] = int(seq.logits[-1].argmax())
        runner.step([(seq, 1)])
    _assert_matches_hf(arch_dir, [seq])


def test_sharded_checkpoint(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen2ForCausalLM", seed=5, max_shard_size="60KB")
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert not (model_dir / "model.safetensors").exists()
    _check_prefill(model_dir)


def _check_prefill(model_dir: Path, num_tokens: int = 40) -> None:
    runner = _runner(model_dir)
    seq = runner.new_seq(_tokens(num_tokens, seed=4))
    runner.step([(seq, num_tokens - 5)])
    runner.step([(seq, 5)])
    _assert_matches_hf(model_dir, [seq])


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tmp_path: Path, tied: bool) -> None:
    model_dir = make_tiny_model(tmp_path, "LlamaForCausalLM", tie_word_embeddings=tied)
    model = _load(model_dir)
    assert (model.lm_head is None) == tied
    _check_prefill(model_dir)


def test_missing_lm_head_ties_to_embeddings(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "LlamaForCausalLM", tie_word_embeddings=False)
    tensors = load_file(model_dir / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    del tensors["lm_head.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    model = _load(model_dir)
    assert model.lm_head is None
    torch.testing.assert_close(model.model.embed_tokens.weight, embedding)


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_norm\.weight.*self_attn\.extra\.weight"):
        _load(model_dir)


@pytest.mark.parametrize(("arch", "head_dim"), [("LlamaForCausalLM", 32), ("Qwen3ForCausalLM", 8)])
def test_explicit_head_dim(tmp_path: Path, arch: str, head_dim: int) -> None:
    model_dir = make_tiny_model(tmp_path, arch, head_dim=head_dim)
    assert load_model_config(model_dir).head_dim == head_dim != 64 // 4
    _check_prefill(model_dir)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_gqa_ratios(tmp_path: Path, num_kv_heads: int) -> None:
    model_dir = make_tiny_model(tmp_path, "LlamaForCausalLM", num_key_value_heads=num_kv_heads)
    runner = _runner(model_dir)
    first, second = runner.new_seq(_tokens(30, seed=6)), runner.new_seq(_tokens(22, seed=7))
    runner.step([(first, 24), (second, 17)])
    for _ in range(4):
        runner.step([(first, 1), (second, 1)])
    runner.step([(first, 2), (second, 1)])
    _assert_matches_hf(model_dir, [first, second])


ROPE_SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,  # < positions used: all three regimes active
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
@pytest.mark.parametrize("key_style", ["rope_parameters", "classic"])
def test_rope_scaling_matches_hf(tmp_path: Path, scaling: str, key_style: str) -> None:
    params = ROPE_SCALINGS[scaling]
    model_dir = make_tiny_model(tmp_path, "LlamaForCausalLM", rope_parameters=dict(params))
    if key_style == "classic":  # rewrite config.json the way pre-v5 checkpoints spell it
        config = json.loads((model_dir / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model_config(model_dir).rope.scaling_type == scaling
    _check_prefill(model_dir, num_tokens=120)


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        load_model_config(tmp_path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(error.value)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_dummy_load_format_needs_no_weights(tmp_path: Path) -> None:
    tiny_hf_config("Qwen3ForCausalLM", num_hidden_layers=3).save_pretrained(str(tmp_path))
    assert not list(tmp_path.glob("*.safetensors"))
    config = load_model_config(tmp_path)
    model = load_model(tmp_path, config, torch.float32, CPU, load_format="dummy", seed=1)
    runner = PagedRunner(model, config)
    seq = runner.new_seq(_tokens(20, seed=8))
    runner.step([(seq, 19)])
    runner.step([(seq, 1)])
    logits = torch.stack(seq.logits)
    assert logits.shape == (20, config.vocab_size) and torch.isfinite(logits).all()
    again = load_model(tmp_path, config, torch.float32, CPU, load_format="dummy", seed=1)
    other = load_model(tmp_path, config, torch.float32, CPU, load_format="dummy", seed=2)
    weight = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(weight, again.model.layers[0].self_attn.qkv_proj.weight)
    assert not torch.equal(weight, other.model.layers[0].self_attn.qkv_proj.weight)
    assert torch.equal(model.model.norm.weight, torch.ones(config.hidden_size))


def test_bfloat16_loads_and_runs(model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["Qwen2ForCausalLM"]
    runner = _runner(model_dir, torch.bfloat16)
    assert runner.model.compute_logits(torch.zeros(1, 64, dtype=torch.bfloat16)).dtype == (
        torch.float32
    )
    seq = runner.new_seq(_tokens(40, seed=9))
    runner.step([(seq, 30)])
    for _ in range(10):
        runner.step([(seq, 1)])
    ours = torch.stack(seq.logits)
    assert torch.isfinite(ours).all()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([seq.token_ids])).logits[0].float()
    # bf16 keeps ~3 significant digits; logits are O(5) here
    torch.testing.assert_close(ours, ref, atol=0.25, rtol=0)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.9
