"""Training documents from files or `datasets`: text to teacher-force, packed into sequences, and prompts to continue.

Files are read lazily, one document at a time (`utils.data_sources`). Documents are split between training and
held-out data by a hash of their text, so the split is the same on every run and every process, and no held-out text is
ever trained on.
"""

import os
import zlib
from collections.abc import Iterable, Iterator

import torch
from transformers.utils import logging

from ..utils.batching import left_padded
from ..utils.data_sources import iter_documents

logger = logging.get_logger(__name__)


def is_held_out(document: str, eval_fraction: float) -> bool:
    """Whether a document belongs to the held-out split: decided by a hash of its text, the same on every run."""
    return zlib.crc32(document.encode("utf-8")) / 2**32 < eval_fraction


def tokenize(document: str, tokenizer) -> list[int]:
    """
    The document's token ids, with the tokenizer's special tokens unless the text already starts with its BOS token
    (text rendered by a chat template usually does, and a second BOS would be out of distribution).
    """
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer(document, add_special_tokens=not (bos and document.startswith(bos)))["input_ids"]


def pack(documents: Iterable[str], tokenizer, seq_length: int) -> Iterator[torch.LongTensor]:
    """
    Tokenizes documents and packs them back to back into sequences of exactly `seq_length` tokens, with the
    tokenizer's end-of-sequence token after each document. The incomplete last sequence is dropped.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buffer = []
    for document in documents:
        buffer.extend(tokenize(document, tokenizer) + eos)
        while len(buffer) >= seq_length:
            yield torch.tensor(buffer[:seq_length], dtype=torch.long)
            del buffer[:seq_length]


class Corpus:
    """The documents of a list of data sources, split into training and held-out documents."""

    def __init__(self, sources, tokenizer, eval_fraction: float = 0.05, text_field: str = "text"):
        if isinstance(sources, (str, os.PathLike)):
            sources = [sources]
        if not sources:
            raise ValueError("No data given: pass at least one file, folder or dataset name.")
        self.sources = [str(s) for s in sources]
        self.tokenizer = tokenizer
        self.eval_fraction = eval_fraction
        self.text_field = text_field

    def documents(self, held_out: bool = False) -> Iterator[str]:
        for source in self.sources:
            for document in iter_documents(source, self.tokenizer, self.text_field):
                if is_held_out(document, self.eval_fraction) == held_out:
                    yield document

    def sequences(self, seq_length: int, held_out: bool = False) -> Iterator[torch.LongTensor]:
        """The documents packed into sequences of `seq_length` tokens."""
        return pack(self.documents(held_out), self.tokenizer, seq_length)

    def prompts(self, max_length: int, held_out: bool = False) -> Iterator[list[int]]:
        """
        Each document as one prompt, whole. A prompt longer than `max_length` tokens is skipped (counted in a
        warning at the end) rather than cut, which could drop a chat template's system turn or its answer header.
        """
        skipped = 0
        for document in self.documents(held_out):
            ids = tokenize(document, self.tokenizer)
            if len(ids) > max_length:
                skipped += 1
                continue
            yield ids
        if skipped:
            logger.warning(
                f"{skipped} prompt(s) of {', '.join(self.sources)} are longer than {max_length} tokens and were "
                "skipped. Raise prompt_length (--prompt-length) to use them."
            )


__all__ = ["Corpus", "is_held_out", "iter_documents", "left_padded", "pack", "tokenize"]
