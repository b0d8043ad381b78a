"""One GPU, one run: the device's ceilings, pdserve against them, transformers and KV transfer.

    python -m bench.gpu [--quick] [--models 8b,1b] [--batch-sizes 1,8,64,256]
        [--no-transformers] [--no-transfer] [--out bench/results/gpu.json]
    python -m bench.gpu --device cpu --preset tiny     # CPU smoke run of the same code
    python -m bench.gpu --only quantized               # ceilings, then the quantized paths

What it measures, in order: what the targets need first, then what picks defaults, so a run
that a lease's time box ends early still has the verdicts (the full preset is meant to fit one
10-minute call on an H100; ``--quick`` is the 8B model at batch 1 and 64, the 1k-token transfer
only, and transformers ``generate`` without continuous batching, for about 4 minutes;
bench/gpu/shapes.py has the presets). The JSON, verdicts included, is rewritten after every
section, so a run cut short keeps what it measured, and a section that fails (out of memory,
say) is recorded under "errors" and the rest go on.

1. Ceilings. Device-to-device copy: ``dst.copy_(src)`` of 1 GiB, median of CUDA-event times;
   reported as read+write bytes per second (2 x size / time; "copied" GB/s is half that). Matmul:
   an 8192^3 bf16 ``torch.mm`` after warm-up, median, as FLOP/s (2 n^3 / time).
2. Per model (Llama-3-8B and Llama-3.2-1B shapes, dummy bf16 weights from a written
   config.json), pdserve (``engine.LLM``, Triton attention): the median decode step at batch 1,
   8, 64, 256 with 1k-token prompts (all prompts prefilled first, a few warm-up steps, then
   decode-only steps, synchronised around each); the prefill of one 1k and one 8k prompt (one
   engine step each).
3. The same model in transformers (``from_config``, random bf16 weights, same GPU): ``generate``
   on 64 1k-token prompts, greedy, ``min_new_tokens = max_new_tokens``; its decode throughput is
   64 x N tokens over the time from its first new token to its last (a per-token clock,
   fastest of three runs). With ``generate_batch``
   (continuous batching) where this transformers has it: tokens after the last request's first
   token over that window (from its per-token timestamps).
4. KV transfer: ``cuda_ipc`` between this process and a spawned one on the same GPU, random
   block lists of 1k- and 8k-token prompts in the first model's KV layout, through
   ``bench.kv_transfer`` (the receiver copies the blocks straight out of the sender's mapped
   cache; timed by the sender, until the receiver's DONE), beside a
   ``copy_`` of the same payload. Both as payload bytes per second.
5. Per model, its elementwise steps alone (``elementwise``): one forward's RMSNorms, rotary,
   residual adds and SiLU * up at 1, 64 and 8192 tokens, the model's torch ops against the
   fused Triton kernels, each replayed from one CUDA graph, beside the bytes the fused kernels
   move over the read bandwidth. This is what says where the fused kernels pay off. Then the
   Triton attention kernels alone under a few tilings each (``attention_tiling``): decode at
   each batch size and the preset's context as KV GB/s, prefill of each prompt length as causal
   FLOP/s, the engine's default tiling marked.
6. Per model, the quantized paths (``quantized``), last: each projection's GEMM for W4A16,
   W8A16, FP8 blocks, W8A8 int8 and FP8 (``_scaled_mm`` and the Triton kernel) against bf16
   ``F.linear``, and decode attention over fp8 and int8 KV caches against bf16, each beside its
   bytes floor.

Rooflines:
- decode step: (weight bytes read + KV bytes read) / read bandwidth. Weight bytes: every
  projection, norm and the full lm_head (bf16); KV bytes: batch x mean attended context x KV
  bytes per token over the timed steps. The read bandwidth is the copy's read+write rate: HBM
  traffic in either direction shares one bus, so a copy's total bytes per second is the best
  streaming rate measured here, and a decode step's traffic is almost all reads.
- prefill: (2 x projection params x tokens + causal attention 2 x layers x heads x head_dim x
  T(T+1) + one lm_head row) / measured matmul FLOP/s; the efficiency is that ideal time over the
  measured one (model FLOP utilisation against the measured, not the datasheet, peak).

Targets (printed with pass/fail): batch-1 decode within 1.15x of its roofline; batch-64 decode
throughput >= 3x transformers ``generate``; prefill >= 60 % of measured peak at 8k tokens;
cuda_ipc >= 80 % of the same-size device copy. On ``--device cpu`` the same code runs with
float32, the torch attention backend, the ``shm`` transport instead of ``cuda_ipc`` and
wall-clock timers instead of CUDA events; its numbers only show that the script works.

Modules: ``__main__`` flags, presets and the order of sections; ``timing`` timers and the
device's ceilings; ``transfer`` the KV-transfer section; ``elementwise`` torch ops against the
fused kernels; ``attention_tiling`` the attention kernels' tilings; ``quantized`` the 4- and 8-bit GEMMs and
the 8-bit KV cache's attention; ``engine_runs`` pdserve's
decode and prefill; ``hf_baseline`` transformers' ``generate`` / ``generate_batch``;
``shapes`` model shapes, presets and their byte / FLOP counts (no torch); ``targets`` the goals
and verdicts; ``report`` the machine and the printed tables. The JSON goes through
``bench.results_json``.
"""
