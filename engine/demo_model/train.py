"""Train the bundled demo model: ``python -m engine.demo_model.train [--out DIR] [--threads T]``.

Steps, in order:

1. corpus: the standard library's docstrings (``engine.demo_model.corpus``); every
   ``HELD_OUT_EVERY``-th document is held out for the evaluation loss.
2. tokenizer: byte-level BPE with ``VOCAB_SIZE`` ids trained on the training documents, saved
   as a transformers tokenizer with a plain-text chat template.
3. model: a small ``LlamaForCausalLM`` (``model_config``) trained from a fixed seed with AdamW
   and a warm-up + cosine schedule on 256-token windows of the documents joined by eos, the
   windows shuffled per epoch by a seeded generator.
4. save: bfloat16 safetensors, tokenizer, generation config and ``training.json`` (the command,
   versions, step count, losses, wall time, thread count and a few greedy samples).

Training runs a fixed number of steps, never a time limit, with
``torch.use_deterministic_algorithms(True)``, so a rerun gives the same bytes for the same
thread count and the same Python patch version (the corpus is that interpreter's stdlib) and
torch version. ``--minutes`` picks the step count from ``STEPS_PER_MINUTE``, the rate measured
with one thread on the 2-core reference CPU, so it too is deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from engine.demo_model import DEMO_MODEL_DIR
from engine.demo_model.corpus import corpus_documents
from engine.demo_model.tokenizer_training import train_bpe_tokenizer

SEED = 1234
VOCAB_SIZE = 4096
SEQ_LEN = 256
BATCH_SIZE = 8  # sequences per step
HELD_OUT_EVERY = 50  # documents
PEAK_LR = 2e-3
MIN_LR_FRACTION = 0.1
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
STEPS_PER_MINUTE = 56.0  # one thread on the 2-core reference CPU
DEFAULT_MINUTES = 25.0
LOG_EVERY = 20
EVAL_EVERY = 200
SAMPLE_PROMPTS = ("Return the", "This module provides", "The default value is")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}Assistant:{% endif %}"
)


def model_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )


@dataclass(frozen=True, slots=True)
class TokenData:
    train_windows: torch.Tensor  # [num_train_windows, SEQ_LEN + 1] int64
    held_out_windows: torch.Tensor  # [num_held_out_windows, SEQ_LEN + 1] int64
    num_train_tokens: int
    num_held_out_tokens: int


def split_documents(documents: tuple[str, ...]) -> tuple[list[str], list[str]]:
    train = [d for i, d in enumerate(documents) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held_out = [d for i, d in enumerate(documents) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return train, held_out


def to_windows(
    tokenizer: PreTrainedTokenizerFast, documents: list[str]
) -> tuple[torch.Tensor, int]:
    """Documents each followed by eos, concatenated, cut into non-overlapping windows."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    num_windows = (len(stream) - 1) // SEQ_LEN
    # window i covers tokens [i * SEQ_LEN, (i + 1) * SEQ_LEN]: inputs plus shifted targets
    tokens = torch.tensor(stream[: num_windows * SEQ_LEN + 1], dtype=torch.long)
    starts = torch.arange(num_windows) * SEQ_LEN
    windows = tokens[starts[:, None] + torch.arange(SEQ_LEN + 1)[None, :]]
    return windows, len(stream)


def prepare(out_dir: Path) -> tuple[PreTrainedTokenizerFast, TokenData]:
    train_docs, held_out_docs = split_documents(corpus_documents())
    train_bpe_tokenizer(out_dir, VOCAB_SIZE, texts=train_docs, chat_template=CHAT_TEMPLATE)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    train_windows, num_train = to_windows(tokenizer, train_docs)
    held_out_windows, num_held_out = to_windows(tokenizer, held_out_docs)
    data = TokenData(train_windows, held_out_windows, num_train, num_held_out)
    return tokenizer, data


def batch_order(num_windows: int, num_steps: int) -> torch.Tensor:
    """[num_steps, BATCH_SIZE] window indices: a seeded permutation per epoch, concatenated."""
    generator = torch.Generator().manual_seed(SEED)
    needed = num_steps * BATCH_SIZE
    epochs = [
        torch.randperm(num_windows, generator=generator) for _ in range(needed // num_windows + 1)
    ]
    return torch.cat(epochs)[:needed].view(num_steps, BATCH_SIZE)


def lr_factor(step: int, num_steps: int) -> float:
    warmup = max(1, int(WARMUP_FRACTION * num_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * cosine


def make_optimizer(model: LlamaForCausalLM) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8)


def window_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits  # [batch, SEQ_LEN, vocab]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1)
    )


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    model.eval()
    total = 0.0
    for start in range(0, len(windows), BATCH_SIZE):
        batch = windows[start : start + BATCH_SIZE]
        total += float(window_loss(model, batch)) * len(batch)
    model.train()
    return total / len(windows)


def train(model: LlamaForCausalLM, data: TokenData, num_steps: int) -> dict[str, Any]:
    optimizer = make_optimizer(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, num_steps))
    order = batch_order(len(data.train_windows), num_steps)
    recent: list[float] = []
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    model.train()
    for step in range(num_steps):
        loss = window_loss(model, data.train_windows[order[step]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-LOG_EVERY:]
        if (step + 1) % LOG_EVERY == 0 or step + 1 == num_steps:
            elapsed = time.perf_counter() - started
            mean = sum(recent) / len(recent)
            entry = {"step": step + 1, "train_loss": round(mean, 4)}
            if (step + 1) % EVAL_EVERY == 0:
                entry["held_out_loss"] = round(held_out_loss(model, data.held_out_windows), 4)
            history.append(entry)
            print(
                f"step {step + 1}/{num_steps} loss {mean:.4f} "
                f"held-out {entry.get('held_out_loss', float('nan')):.4f} "
                f"lr {schedule.get_last_lr()[0]:.2e} {elapsed:.0f}s "
                f"({(step + 1) / elapsed * 60:.1f} steps/min)",
                flush=True,
            )
    return {
        "train_seconds": round(time.perf_counter() - started, 1),
        "final_train_loss": round(sum(recent) / len(recent), 4),
        "loss_history": history,
    }


def greedy_samples(out_dir: Path, max_new_tokens: int = 40) -> dict[str, str]:
    """Greedy continuations of ``SAMPLE_PROMPTS`` by the saved (bfloat16) weights."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    model = LlamaForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        samples[prompt] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return samples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.demo_model.train")
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT_MINUTES,
        help=f"training budget, turned into steps at {STEPS_PER_MINUTE} steps/min",
    )
    parser.add_argument("--steps", type=int, default=None, help="step count (overrides --minutes)")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    num_steps = args.steps if args.steps is not None else round(args.minutes * STEPS_PER_MINUTE)
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    out_dir: Path = args.out
    tokenizer, data = prepare(out_dir)
    print(
        f"corpus: {data.num_train_tokens} train tokens ({len(data.train_windows)} windows), "
        f"{data.num_held_out_tokens} held-out tokens; {num_steps} steps",
        flush=True,
    )
    model = LlamaForCausalLM(model_config())
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    result = train(model, data, num_steps)
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers mistypes .to
    model.generation_config.pad_token_id = None
    model.save_pretrained(str(out_dir), safe_serialization=True)
    bf16 = LlamaForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    held_out = held_out_loss(bf16, data.held_out_windows)
    print(f"final train loss {result['final_train_loss']:.4f}, held-out loss {held_out:.4f}")
    record = {
        "command": "python -m engine.demo_model.train "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "seed": SEED,
        "num_steps": num_steps,
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
        "peak_lr": PEAK_LR,
        "num_train_tokens": data.num_train_tokens,
        "num_held_out_tokens": data.num_held_out_tokens,
        "final_train_loss": result["final_train_loss"],
        "held_out_loss": round(held_out, 4),
        "train_seconds": result["train_seconds"],
        "wall_seconds": round(time.perf_counter() - started, 1),
        "greedy_samples": greedy_samples(out_dir),
        "loss_history": result["loss_history"],
    }
    (out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    for prompt, text in record["greedy_samples"].items():
        print(f">>> {prompt!r} -> {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
