"""Tensor parallelism: which slice of the model a rank holds, and the collectives its ranks run."""
