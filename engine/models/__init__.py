"""Model implementations: one decoder-only transformer, selected by architecture name."""

from engine.models.llama import LlamaForCausalLM
from engine.models.registry import CausalLM, get_model_class

__all__ = ["CausalLM", "LlamaForCausalLM", "get_model_class"]
