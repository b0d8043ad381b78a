"""The traffic ``pdserve plan`` sizes a cluster for: Poisson arrivals at a rate, prompt and
output lengths drawn log-normally around their medians (clipped), prefix sharing (a share of
the requests start with one of a few system prompts, which the workers' prefix caches hold),
and conversations of several turns: each next turn's prompt is the one before, its reply and a
new message (``prompt_len``'s draw), sent a think time (exponential around ``think_s``) after
that reply ended; conversations start at ``rate / turns`` a second, so that about ``rate``
requests a second are sent. A conversation ends at the turn whose prompt and reply would pass
``max_len``."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from router.planner.simulator import SAMPLED_TOKEN, WorkloadRequest


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
    turns: int = 1  # a conversation's requests
    think_s: float = 5.0  # mean time between a reply's end and the next turn

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if min(self.prompt_len, self.output_len, self.num_requests, self.num_prefixes) < 1:
            raise ValueError("--prompt-len, --output-len, --num-requests must be >= 1")
        if not 0 <= self.prefix_share <= 1:
            raise ValueError(f"--prefix-share must be in [0, 1], got {self.prefix_share}")
        if self.prefix_len < 0 or self.sigma < 0:
            raise ValueError("--prefix-len and --length-sigma must be >= 0")
        if self.turns < 1 or self.think_s < 0:
            raise ValueError(
                f"--turns must be >= 1 and --think-s >= 0, got {self.turns} and {self.think_s}"
            )

    def at_rate(self, rate: float) -> PlanWorkload:
        return replace(self, rate=rate)

    def requests(self, vocab_size: int = 32000) -> list[WorkloadRequest]:
        """The workload's requests, the same for the same seed (token ids below ``vocab_size``),
        a conversation's turns in order."""
        rng = random.Random(self.seed)
        prefixes = [
            tuple(rng.randrange(vocab_size) for _ in range(self.prefix_len))
            for _ in range(self.num_prefixes)
        ]
        requests: list[WorkloadRequest] = []
        now = 0.0
        while len(requests) < self.num_requests:
            now += rng.expovariate(self.rate / self.turns)
            length = self._length(rng, self.prompt_len)
            output = self._length(rng, self.output_len)
            prompt: tuple[int, ...] = ()
            if self.prefix_len and rng.random() < self.prefix_share:
                prompt = rng.choice(prefixes)[: max(0, length - 1)]
            prompt += tuple(rng.randrange(vocab_size) for _ in range(length - len(prompt)))
            turn = WorkloadRequest(now, prompt, output)
            requests.append(turn)
            for _ in range(self.turns - 1):
                if len(requests) >= self.num_requests:
                    break
                message = self._length(rng, self.prompt_len)
                output = self._length(rng, self.output_len)
                prompt = (
                    turn.prompt_token_ids
                    + (SAMPLED_TOKEN,) * turn.output_len
                    + tuple(rng.randrange(vocab_size) for _ in range(message))
                )
                if len(prompt) + output > self.max_len:
                    break
                think = rng.expovariate(1 / self.think_s) if self.think_s else 0.0
                turn = WorkloadRequest(now, prompt, output, follows=turn, think_s=think)
                requests.append(turn)
        return requests

    def _length(self, rng: random.Random, median: int) -> int:
        drawn = median * math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else median
        return max(1, min(self.max_len, round(drawn)))
