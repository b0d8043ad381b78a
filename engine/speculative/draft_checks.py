"""Whether a draft model can draft for a target (``"method": "draft_model"``), checked before
anything loads; torch-free, so the router refuses a bad pair at start too."""

from __future__ import annotations

from engine.model_config import ModelConfig, load_model_config
from engine.speculative.config import SpeculativeConfig


def check_draft_model(
    speculative: SpeculativeConfig, target: ModelConfig, max_model_len: int
) -> ModelConfig:
    """The draft model's config; raises ValueError naming the field of a pair the drafter
    cannot run: it reads the target's block tables of one cache group whose blocks all stay
    (no sliding window, in either model), and drafts at every position the target may
    reach."""
    assert speculative.model is not None
    try:
        draft = load_model_config(speculative.model)
    except (OSError, ValueError) as error:
        raise ValueError(f"speculative_config.model: {error}") from None
    for name, config in (("the target model", target), ("speculative_config.model", draft)):
        if config.cache_groups.num_groups > 1 or any(config.cache_groups.windows):
            raise ValueError(
                f"speculative_config.method 'draft_model' needs models whose layers all attend "
                f"to the whole context; {name} ({config.architecture}) has sliding-window "
                f"layers (sliding_window / layer_types)"
            )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model's max_position_embeddings "
            f"({draft.max_position_embeddings}) must be >= the target's max_model_len "
            f"({max_model_len})"
        )
    return draft
