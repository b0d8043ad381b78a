"""A step runs with its engine's CUDA device current: Triton launches on the current device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

import engine.model_runner
from engine.model_runner import ModelRunner
from engine.scheduler.outputs import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence


def test_a_step_on_cuda_1_runs_with_cuda_1_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without it, an engine on cuda:1 launched every Triton kernel on cuda:0 (the thread's
    current device), which cannot reach cuda:1's tensors. No GPU here: the device switch is
    recorded, and the step itself stands in."""
    current: list[torch.device] = []
    seen: list[list[torch.device]] = []

    @contextlib.contextmanager
    def switch_to(device: torch.device) -> Iterator[None]:
        current.append(device)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(engine.model_runner.torch.cuda, "device", switch_to)
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cuda", 1)
    runner._drawn = None
    runner.drafter = None

    def prepare_forward(
        prefills: list[ScheduledSequence],
        decodes: list[ScheduledSequence],
        ordered: list[ScheduledSequence],
    ) -> Callable[[], torch.Tensor]:
        seen.append(list(current))
        return lambda: torch.empty(0, 8)

    def sample_rows(ordered: list[ScheduledSequence]) -> tuple[list[int], list[Sequence]]:
        seen.append(list(current))
        return [], []

    monkeypatch.setattr(runner, "_prepare_forward", prepare_forward)
    monkeypatch.setattr(runner, "_sample_rows", sample_rows)
    runner.execute(SchedulerOutput([], [], 0, 0))  # the launch, then the sampling
    assert seen == [[torch.device("cuda", 1)]] * 2
