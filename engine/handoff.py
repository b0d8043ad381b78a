"""The prefill result and its parts, under the name some modules import them by; they are
defined, with the rest of the hand-off protocol, in ``engine.messages.handoff``."""

from engine.messages.handoff import PrefillResult, Reservation, SampleStart

__all__ = ["PrefillResult", "Reservation", "SampleStart"]
