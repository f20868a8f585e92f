"""Streaming training text for the speculator trainer: documents from files or `datasets`, packed into token sequences.

Nothing is loaded whole: files are read lazily, one document at a time, and packing keeps at most one sequence of
tokens in memory. Documents are split between training and held-out data by a hash of their text, so the split is the
same on every run and every process, and no held-out text is ever packed into a training sequence.
"""

import itertools
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
KNOWN_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


def _render(record: dict, tokenizer, text_field: str, where: str) -> str:
    """The text of one record: its `text_field`, or its chat `messages` rendered with the tokenizer's chat template."""
    if text_field in record:
        return record[text_field]
    if "messages" in record:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"{where} holds chat `messages` but the tokenizer has no chat template to render them with. Set "
                "`tokenizer.chat_template`, or give the records a text field."
            )
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    raise ValueError(
        f"{where} has neither a {text_field!r} field nor chat `messages` (its fields: {sorted(record)}). Name the text "
        "field with `text_field` (--text-field)."
    )


def _iter_txt(path: Path) -> Iterator[str]:
    # Blank lines separate documents, so that a .txt file of paragraphs is split at paragraph boundaries for the
    # held-out split and for the end-of-document tokens between them.
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _iter_jsonl(path: Path, tokenizer, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield _render(json.loads(line), tokenizer, text_field, f"{path}:{number}")


def _iter_parquet(path: Path, tokenizer, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ValueError(f"Reading {path} needs pyarrow: `pip install pyarrow`.") from error
    for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
        for record in batch.to_pylist():
            yield _render(record, tokenizer, text_field, str(path))


def _iter_dataset(name: str, tokenizer, text_field: str, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as error:
        raise ValueError(
            f"{name!r} is neither a file with a known suffix ({', '.join(KNOWN_SUFFIXES)}) nor a folder holding "
            "such files; reading it as a `datasets` dataset needs `pip install datasets`."
        ) from error
    for record in datasets.load_dataset(name, split=split, streaming=True):
        yield _render(record, tokenizer, text_field, name)


def iter_documents(source: str, tokenizer, text_field: str = "text", split: str = "train") -> Iterator[str]:
    """Yields the documents of one data source, lazily: a file, a folder of files, or a `datasets` name or path."""
    path = Path(source)
    files = sorted(p for p in path.rglob("*") if p.suffix in KNOWN_SUFFIXES) if path.is_dir() else []
    if files:
        for file in files:
            yield from iter_documents(str(file), tokenizer, text_field, split)
    elif path.is_file() and path.suffix in TEXT_SUFFIXES:
        yield from _iter_txt(path)
    elif path.is_file() and path.suffix in JSONL_SUFFIXES:
        yield from _iter_jsonl(path, tokenizer, text_field)
    elif path.is_file() and path.suffix in PARQUET_SUFFIXES:
        yield from _iter_parquet(path, tokenizer, text_field)
    elif path.is_file():
        raise ValueError(
            f"Cannot read {source}: its suffix {path.suffix!r} is not one of "
            f"{', '.join(KNOWN_SUFFIXES)}. Convert it, or rename a plain-text file to .txt."
        )
    else:
        yield from _iter_dataset(source, tokenizer, text_field, split)


def is_held_out(document: str, eval_fraction: float) -> bool:
    """Whether a document belongs to the held-out split: decided by a hash of its text, the same on every run."""
    return zlib.crc32(document.encode("utf-8")) / 2**32 < eval_fraction


def pack(documents: Iterable[str], tokenizer, seq_length: int) -> Iterator[torch.LongTensor]:
    """
    Tokenizes documents and packs them back to back into sequences of exactly `seq_length` tokens, with the
    tokenizer's end-of-sequence token after each document. The incomplete last sequence is dropped.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buffer = []
    for document in documents:
        buffer.extend(tokenizer(document)["input_ids"] + eos)
        while len(buffer) >= seq_length:
            yield torch.tensor(buffer[:seq_length], dtype=torch.long)
            del buffer[:seq_length]


class PackedTextStream:
    """
    The packed sequences of a list of data sources, split into training and held-out data.

    `train_sequences(skip)` cycles over the data forever (epoch after epoch) so that the trainer runs for its number of
    steps whatever the corpus size; `skip` resumes it exactly at a position, which is how a resumed run continues
    where its checkpoint left off. Every process reads the whole stream and takes its own rows of each global batch
    (see the trainer), which keeps the global batch identical whatever the number of processes.
    """

    def __init__(self, sources, tokenizer, seq_length: int, eval_fraction: float = 0.05, text_field: str = "text"):
        if isinstance(sources, (str, os.PathLike)):
            sources = [sources]
        if not sources:
            raise ValueError("No training data given: pass at least one file, folder or dataset name (--data).")
        self.sources = [str(s) for s in sources]
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.eval_fraction = eval_fraction
        self.text_field = text_field

    def _documents(self, held_out: bool) -> Iterator[str]:
        for source in self.sources:
            for document in iter_documents(source, self.tokenizer, self.text_field):
                if is_held_out(document, self.eval_fraction) == held_out:
                    yield document

    def eval_sequences(self, num_sequences: int) -> torch.LongTensor:
        """The first `num_sequences` packed held-out sequences, as one `[num_sequences, seq_length]` tensor."""
        sequences = list(itertools.islice(pack(self._documents(True), self.tokenizer, self.seq_length), num_sequences))
        if not sequences:
            raise ValueError(
                f"The held-out split (eval_fraction={self.eval_fraction}) holds no complete sequence of "
                f"{self.seq_length} tokens. Raise eval_fraction (--eval-fraction), give more data, or lower "
                "seq_length. (Documents are held out whole: records of .jsonl/.parquet files, blank-line-separated "
                "paragraphs of .txt files.)"
            )
        if len(sequences) < num_sequences:
            logger.warning(
                f"The held-out split holds only {len(sequences)} sequences of the {num_sequences} asked for."
            )
        return torch.stack(sequences)

    def prompts(self, length: int, held_out: bool = False, skip: int = 0) -> Iterator[list[int]]:
        """
        Each document as one prompt of at most `length` tokens, its last ones (a chat turn rendered up to the
        assistant's answer ends there). Training prompts cycle epoch after epoch, starting after the first `skip`;
        held-out prompts are read once.
        """

        def epoch():
            return (self.tokenizer(document)["input_ids"][-length:] for document in self._documents(held_out))

        if held_out:
            return epoch()
        return _cycle(
            epoch,
            skip,
            f"The prompt data ({', '.join(self.sources)}) holds no document outside the held-out split. Give more "
            "prompts, or lower eval_fraction.",
        )

    def train_sequences(self, skip: int = 0) -> Iterator[torch.LongTensor]:
        """Training sequences, epoch after epoch, starting after the first `skip`."""
        return _cycle(
            lambda: pack(self._documents(False), self.tokenizer, self.seq_length),
            skip,
            f"The training data ({', '.join(self.sources)}) holds no complete sequence of {self.seq_length} tokens "
            "outside the held-out split. Give more data, or lower seq_length or eval_fraction.",
        )


def _cycle(epoch: Callable[[], Iterable], skip: int, empty_error: str) -> Iterator:
    """The items of `epoch()`, epoch after epoch forever, starting after the first `skip`; `empty_error` if none."""
    number = 0
    while True:
        produced = 0
        for item in epoch():
            produced += 1
            if skip:
                skip -= 1
                continue
            yield item
        if produced == 0:
            raise ValueError(empty_error)
        number += 1
        # Skipping whole epochs by re-reading them would only waste time.
        skip %= produced
        logger.info(f"Starting epoch {number} over the training data.")


def left_padded(prompts: list[list[int]], pad_token_id: int, device=None) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Token lists of different lengths as one batch padded on the left, as decoder-only generation needs, and its
    attention mask."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention_mask


__all__ = ["PackedTextStream", "is_held_out", "iter_documents", "left_padded", "pack"]
