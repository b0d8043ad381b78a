"""The traffic ``pdserve plan`` sizes a cluster for: Poisson arrivals at a rate, prompt and
output lengths drawn log-normally around their medians (clipped), and prefix sharing (a share of
the requests start with one of a few system prompts, which the workers' prefix caches hold)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from router.planner.simulator import WorkloadRequest


@dataclass(frozen=True, slots=True)
class PlanWorkload:
    rate: float  # requests per second
    prompt_len: int = 512  # median prompt tokens
    output_len: int = 128  # median output tokens
    sigma: float = 0.5  # std-dev of ln(length), for both
    max_len: int = 8192  # lengths are clipped to [1, this]
    prefix_share: float = 0.0  # fraction of requests that start with a shared system prompt
    prefix_len: int = 0  # tokens of each shared system prompt (within the prompt's length)
    num_prefixes: int = 4
    num_requests: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if min(self.prompt_len, self.output_len, self.num_requests, self.num_prefixes) < 1:
            raise ValueError("--prompt-len, --output-len, --num-requests must be >= 1")
        if not 0 <= self.prefix_share <= 1:
            raise ValueError(f"--prefix-share must be in [0, 1], got {self.prefix_share}")
        if self.prefix_len < 0 or self.sigma < 0:
            raise ValueError("--prefix-len and --length-sigma must be >= 0")

    def at_rate(self, rate: float) -> PlanWorkload:
        return replace(self, rate=rate)

    def requests(self, vocab_size: int = 32000) -> list[WorkloadRequest]:
        """The workload's requests, the same for the same seed (token ids below ``vocab_size``)."""
        rng = random.Random(self.seed)
        prefixes = [
            tuple(rng.randrange(vocab_size) for _ in range(self.prefix_len))
            for _ in range(self.num_prefixes)
        ]
        requests, now = [], 0.0
        for _ in range(self.num_requests):
            now += rng.expovariate(self.rate)
            length = self._length(rng, self.prompt_len)
            output = self._length(rng, self.output_len)
            prompt: tuple[int, ...] = ()
            if self.prefix_len and rng.random() < self.prefix_share:
                prompt = rng.choice(prefixes)[: max(0, length - 1)]
            prompt += tuple(rng.randrange(vocab_size) for _ in range(length - len(prompt)))
            requests.append(WorkloadRequest(now, prompt, output))
        return requests

    def _length(self, rng: random.Random, median: int) -> int:
        drawn = median * math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else median
        return max(1, min(self.max_len, round(drawn)))
