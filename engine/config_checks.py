"""The engine's configs checked against the model and each other, before any rank starts (a
bad field is refused by name, not by a rank process that failed)."""

from __future__ import annotations

from engine.engine_config import CacheConfig, LoadConfig, ParallelConfig
from engine.model_config import ModelConfig, load_model_config
from engine.parallel.rank_model import check_max_model_len
from engine.parallel.shard import TensorParallelShard
from engine.scheduler import SchedulerConfig
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_checks import check_draft_model
from engine.speculative.prediction_checks import check_prediction_layer


def check_configs(
    load: LoadConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    speculative: SpeculativeConfig | None,
    parallel: ParallelConfig,
) -> ModelConfig:
    """The model's config, once the engine's configs are checked against it and each other;
    raises ValueError naming the field (before any rank process starts)."""
    model_config = load_model_config(load.model_dir)
    max_model_len = check_max_model_len(load, model_config)
    if not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({scheduler.max_num_batched_tokens}) must be >= "
            f"max_model_len ({max_model_len}) when chunked prefill is disabled"
        )
    if scheduler.async_scheduling and speculative is not None:
        raise ValueError(
            "async_scheduling does not combine with speculative decoding "
            "(num_speculative_tokens): drafts are proposed from the tokens of the step before"
        )
    if speculative is not None and speculative.method == "draft_model":
        check_draft_model(speculative, model_config, max_model_len)
    if speculative is not None and speculative.method == "mtp":
        check_prediction_layer(model_config)
    # heads (and experts, or their columns) divide
    TensorParallelShard.of(model_config, 0, parallel.tensor_parallel_size, parallel.expert_parallel)
    return model_config
