"""The transformers baseline: ``generate`` and ``generate_batch`` on the same config and device.

``generate`` runs one static batch; ``generate_batch`` (continuous batching) runs where this
transformers has it, and any failure of it is recorded rather than raised.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.shapes import ModelSpec, Preset, random_prompt
from bench.gpu.timing import log, synchronize, timed_wall

_TIMED_RUNS = 3  # runs of each timed generate call; the fastest counts


def measure_transformers(
    spec: ModelSpec, model_dir: Path, device: torch.device, dtype: str, preset: Preset
) -> dict[str, Any]:
    """transformers on the same config and device: ``generate``, then ``generate_batch``."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    build_s = time.perf_counter() - started
    log(f"{spec.name}: transformers {transformers.__version__} model built in {build_s:.1f} s")
    rng = random.Random(f"transformers-{spec.name}")
    prompts = [
        random_prompt(rng, preset.context_len, spec.vocab_size) for _ in range(preset.hf_batch_size)
    ]
    result: dict[str, Any] = {"build_s": build_s}
    result["generate"] = hf_generate(model, prompts, preset.hf_new_tokens, device)
    log(f"{spec.name}: transformers generate {result['generate']['decode_tokens_per_s']:.0f} tok/s")
    if preset.hf_continuous_batching:
        result["generate_batch"] = hf_generate_batch(model, prompts, preset.hf_new_tokens, device)
        log(f"{spec.name}: transformers generate_batch: {result['generate_batch']}")
    del model
    return result


def hf_generate(
    model: Any, prompts: list[list[int]], num_new: int, device: torch.device
) -> dict[str, Any]:
    """Decode throughput of one static batch: from its first new token to its last, read by a
    clock ``generate`` calls after each token (``_TokenClock``), the fastest of
    ``_TIMED_RUNS`` runs. The decode time is measured, never a difference of two runs (which a
    busy machine could make negative)."""
    input_ids = torch.tensor(prompts, device=device)  # [batch, prompt_len]
    attention_mask = torch.ones_like(input_ids)  # equal lengths: nothing to pad, all attended

    def generate(max_new: int, clock: _TokenClock | None = None) -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                stopping_criteria=None if clock is None else [clock],
            )
        if out.shape[1] != input_ids.shape[1] + max_new:
            raise RuntimeError(f"generate made {out.shape[1] - input_ids.shape[1]} tokens")

    generate(2)  # warm-up
    runs = []
    for _ in range(_TIMED_RUNS):
        clock = _TokenClock(device)
        synchronize(device)
        started = time.perf_counter()
        generate(1 + num_new, clock)
        runs.append((clock.times[0] - started, clock.times[-1] - clock.times[0]))
    first_s, decode_s = min(runs, key=lambda run: run[1])
    return {
        "batch_size": len(prompts),
        "prompt_len": input_ids.shape[1],
        "new_tokens": num_new,
        "prefill_and_first_token_s": first_s,
        "total_s": first_s + decode_s,
        "decode_step_ms": decode_s / num_new * 1e3,
        "decode_tokens_per_s": len(prompts) * num_new / decode_s,
    }


class _TokenClock:
    """A stopping criterion that never stops: the time each new token of a ``generate`` call
    was made (after the device finished it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_generate_batch(
    model: Any, prompts: list[list[int]], num_new: int, device: torch.device
) -> dict[str, Any]:
    """transformers' continuous batching, where it exists; any failure is reported, not raised.

    Decode throughput: tokens stamped after the last request's first token, over that window.
    """
    if not hasattr(model, "generate_batch"):
        return {"ran": False, "error": "this transformers has no generate_batch"}
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    kwargs, options = generate_batch_kwargs(model, config, device, prompts, num_new)
    try:
        wall_s, outputs = timed_wall(lambda: model.generate_batch(prompts, **kwargs), device)
    except Exception as exc:  # an optional baseline: report why it did not run
        return {"ran": False, "options": options, "error": f"{type(exc).__name__}: {exc}"}
    finished = list(outputs.values())
    num_tokens = sum(len(o.generated_tokens) for o in finished)
    return {
        "ran": True,
        "options": options,
        "complete": len(finished) == len(prompts) and num_tokens == len(prompts) * num_new,
        "errors": sorted({str(o.error) for o in finished if o.error is not None}),
        "generated_tokens": num_tokens,
        "wall_s": wall_s,  # includes its warm-up (graph capture) and the prefills
        "decode_tokens_per_s": steady_decode_rate(finished),
    }


def generate_batch_kwargs(
    model: Any, config: Any, device: torch.device, prompts: list[list[int]], num_new: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What this transformers' ``generate_batch`` accepts of what we want, and a record of it.

    Per-token timestamps; no automatic switch to flash attention (the static baseline runs
    SDPA, and finding flash kernels may mean a Hub download, which the GPU machine cannot
    make). Off CUDA: no warm-up (it captures CUDA graphs) and a cache sized for the batch
    (sizing it from host memory takes seconds); on CUDA it sizes itself from free memory.
    """
    import transformers

    accepted = inspect.signature(model.generate_batch).parameters
    kwargs: dict[str, Any] = {"generation_config": config, "progress_bar": False}
    if "record_timestamps" in accepted:
        kwargs["record_timestamps"] = True
    if "warmup" in accepted and device.type != "cuda":
        kwargs["warmup"] = False
    options: dict[str, Any] = {"auto_switch_to_flash": False}
    if device.type != "cuda":
        pages_per_request = -(-(len(prompts[0]) + num_new) // 256)  # 256: its default page
        num_layers = model.config.num_hidden_layers
        options.update(num_blocks=4 * len(prompts) * pages_per_request * num_layers)
        options.update(max_batch_tokens=1024)
    config_class = getattr(transformers, "ContinuousBatchingConfig", None)
    if "continuous_batching_config" in accepted and config_class is not None:
        with contextlib.suppress(TypeError):  # older versions: no such field
            kwargs["continuous_batching_config"] = config_class(**options)
    used = options if "continuous_batching_config" in kwargs else None
    return kwargs, {"kwargs": sorted(kwargs), "continuous_batching_config": used}


def steady_decode_rate(outputs: list[Any]) -> float | None:
    stamps = [list(o.timestamps) for o in outputs if getattr(o, "timestamps", None)]
    if not stamps or len(stamps) != len(outputs):
        return None
    ready, end = max(s[0] for s in stamps), max(s[-1] for s in stamps)
    num_tokens = sum(1 for s in stamps for t in s if t > ready)
    return num_tokens / (end - ready) if end > ready and num_tokens else None
