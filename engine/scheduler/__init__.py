"""The per-worker batch scheduler: pure CPU logic, no torch."""

from engine.scheduler.outputs import (
    AppendedTokens,
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from engine.scheduler.scheduler import Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = [
    "AppendedTokens",
    "FinishReason",
    "ModelRunnerOutput",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
]
