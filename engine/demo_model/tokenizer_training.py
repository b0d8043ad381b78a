"""Byte-level BPE tokenizers trained offline, deterministically, in about a second.

By default the training text is the Python standard library's top-level sources (the tiny
tokenizer tests use); the bundled demo model passes its docstring corpus instead.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
_NUM_TRAINING_FILES = 40
_MAX_TRAINING_BYTES = 600_000


def train_bpe_tokenizer(
    out_dir: Path,
    vocab_size: int = 1024,
    texts: Iterable[str] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Train a byte-level BPE tokenizer; save it as a transformers tokenizer dir.

    ``texts`` defaults to stdlib sources. Ids 0, 1, 2 are ``<unk>``, ``<s>`` (bos) and ``</s>``
    (eos). No bos is added on encode, so ``decode(encode(text)) == text`` for any string, emoji
    and CJK included.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_stdlib_text() if texts is None else texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def _stdlib_text() -> Iterator[str]:
    """The first files, in sorted order, of the stdlib's top-level ``.py`` files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    remaining = _MAX_TRAINING_BYTES
    for path in sorted(stdlib.glob("*.py"))[:_NUM_TRAINING_FILES]:
        text = path.read_text(encoding="utf-8", errors="replace")[:remaining]
        remaining -= len(text)
        yield text
        if remaining <= 0:
            return
