"""Compute kernels the engine calls through narrow interfaces (never from the scheduler)."""
