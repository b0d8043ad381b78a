"""Quantized checkpoints: what a ``quantization_config`` asks for, and the layers that hold
quantized weights."""
