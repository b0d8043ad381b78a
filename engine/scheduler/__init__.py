"""The per-worker batch scheduler: pure CPU logic, no torch."""

from engine.scheduler.outputs import (
    AppendedTokens,
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from engine.scheduler.scheduler import (
    SCHEDULING_POLICIES,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
)
from engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = [
    "SCHEDULING_POLICIES",
    "AppendedTokens",
    "FinishReason",
    "ModelRunnerOutput",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
    "Sequence",
    "SequenceStatus",
]
