"""The projections' matmul: oneDNN with prepacked weights against torch's ``F.linear`` (MKL).

    .venv/bin/python -m bench.linear_backends [--threads 1] [--out bench/results/linear.json]

For the demo model's projection shapes (qkv 256->768, o 256->256, gate_up 256->1408,
down 704->256, logits 256->4096) and token counts from a decode step to a long prefill, times
every shape with both backends in the same run, with the weights of all six layers cycled so
they stream from memory as in a real step (not one hot weight in cache). Prints a table and
writes JSON; the ratio column is the baseline's time over oneDNN's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.results_json import write_json
from bench.timing import median_seconds
from engine.kernels.linear import PackedLinear, onednn_supports

SHAPES = {  # name -> (in_features, out_features)
    "qkv": (256, 768),
    "o": (256, 256),
    "gate_up": (256, 1408),
    "down": (704, 256),
}
NUM_LAYERS = 6
LOGITS = (256, 4096)


def _step_runners(
    num_tokens: int, dtype: torch.dtype
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Both backends' passes over every projection of the model at this token count."""
    generator = torch.Generator().manual_seed(num_tokens)
    weights = [
        torch.randn(out_f, in_f, generator=generator).to(dtype)
        for _ in range(NUM_LAYERS)
        for in_f, out_f in SHAPES.values()
    ]
    logits_rows = min(num_tokens, 64)  # logits only for the rows that sample
    inputs = {
        in_f: torch.randn(num_tokens, in_f, generator=generator).to(dtype)
        for in_f, _ in SHAPES.values()
    }
    logits_weight = torch.randn(LOGITS[1], LOGITS[0], generator=generator).to(dtype)
    logits_input = inputs[LOGITS[0]][:logits_rows]
    packed = [PackedLinear(w, None) for w in weights]
    packed_logits = PackedLinear(logits_weight, None)

    def torch_pass() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        F.linear(logits_input, logits_weight)

    def onednn_pass() -> None:
        for p in packed:
            p(inputs[p.in_features])
        packed_logits(logits_input)

    return torch_pass, onednn_pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", default="1,2,8,32,64,192,512,2048")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results/linear_backends.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not onednn_supports(torch.device("cpu"), dtype):
        raise SystemExit(f"oneDNN's packed linear does not run here for {args.dtype}")
    rows = []
    print(f"{'tokens':>6} {'torch ms':>9} {'onednn ms':>10} {'speed-up':>8} {'onednn GFLOP/s':>15}")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        torch_pass, onednn_pass = _step_runners(num_tokens, dtype)
        flops = 2 * num_tokens * NUM_LAYERS * sum(i * o for i, o in SHAPES.values())
        flops += 2 * min(num_tokens, 64) * LOGITS[0] * LOGITS[1]
        with torch.inference_mode():
            baseline = median_seconds(torch_pass, args.repeats)
            onednn = median_seconds(onednn_pass, args.repeats)
        rows.append(
            {
                "num_tokens": num_tokens,
                "torch_ms": baseline * 1e3,
                "onednn_ms": onednn * 1e3,
                "speedup": baseline / onednn,
                "onednn_gflops": flops / onednn / 1e9,
                "torch_gflops": flops / baseline / 1e9,
            }
        )
        r = rows[-1]
        print(
            f"{num_tokens:>6} {r['torch_ms']:>9.3f} {r['onednn_ms']:>10.3f} "
            f"{r['speedup']:>7.2f}x {r['onednn_gflops']:>15.1f}"
        )
    result = {
        "benchmark": "linear_backends",
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "rows": rows,
    }
    print(f"-> {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
