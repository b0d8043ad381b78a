"""A step runs with its engine's CUDA device current: Triton launches on the current device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import engine.model_runner
from engine.model_runner import ModelRunner
from engine.scheduler.outputs import ModelRunnerOutput, SchedulerOutput


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

    def step(output: SchedulerOutput) -> ModelRunnerOutput:
        seen.append(list(current))
        return ModelRunnerOutput({}, {}, 0.0)

    monkeypatch.setattr(runner, "_execute", step)
    runner.execute(SchedulerOutput([], [], 0, 0))
    assert seen == [[torch.device("cuda", 1)]]
