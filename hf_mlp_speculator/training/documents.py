"""Training documents from files or `datasets`: text to teacher-force, packed into sequences, and prompts to continue.

Files are read lazily, one document at a time. Documents are split between training and held-out data by a hash of
their text, so the split is the same on every run and every process, and no held-out text is ever trained on.
"""

import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
KNOWN_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


def _kind(value) -> str:
    """A value's JSON type, as the user wrote it: null, a number, a list, ..."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _render(record: dict, tokenizer, text_field: str, where: str) -> str:
    """The text of one record: its `text_field`, or its chat `messages` rendered with the tokenizer's chat template."""
    if text_field in record:
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"{where}: the {text_field!r} field holds {_kind(text)}, not text. Give each record its text as a "
                "string, or chat `messages`."
            )
        return text
    if "messages" in record:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"{where} holds chat `messages` but the tokenizer has no chat template to render them with. Set "
                "`tokenizer.chat_template`, or give the records a text field."
            )
        messages = record["messages"]
        shape = 'a list of {"role": ..., "content": ...} objects'
        if not isinstance(messages, list) or not messages:
            what = "an empty list" if messages == [] else _kind(messages)
            raise ValueError(f"{where}: `messages` holds {what}, not {shape}.")
        for number, message in enumerate(messages, 1):
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                what = f"an object with the fields {sorted(message)}" if isinstance(message, dict) else _kind(message)
                raise ValueError(f"{where}: message {number} of `messages` is {what}; `messages` must be {shape}.")
        # A conversation that ends with the user's turn is a prompt: it ends where the assistant's answer begins.
        awaiting_answer = messages[-1]["role"] == "user"
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=awaiting_answer)
    raise ValueError(
        f"{where} has neither a {text_field!r} field nor chat `messages` (its fields: {sorted(record)}). Name the text "
        "field with `text_field` (--text-field)."
    )


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file; a line that is not UTF-8 is an error that names the file and line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}:{number} is not UTF-8 text (byte {raw[error.start]:#04x} at column {error.start + 1}): "
                    "save the file as UTF-8."
                ) from None


def _iter_txt(path: Path) -> Iterator[str]:
    # Blank lines separate documents, so that a .txt file of paragraphs is split at paragraph boundaries for the
    # held-out split and for the end-of-document tokens between them.
    lines = []
    for _, line in _lines(path):
        if line.strip():
            lines.append(line)
        elif lines:
            yield "".join(lines).rstrip("\n")
            lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _iter_jsonl(path: Path, tokenizer, text_field: str) -> Iterator[str]:
    for number, line in _lines(path):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not valid JSON ({error.msg} at column {error.colno}).") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number} holds a JSON {type(record).__name__}, not an object (a record).")
            yield _render(record, tokenizer, text_field, f"{path}:{number}")


def _iter_parquet(path: Path, tokenizer, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ValueError(f"Reading {path} needs pyarrow: `pip install pyarrow`.") from error
    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
        for record in batch.to_pylist():
            number += 1
            yield _render(record, tokenizer, text_field, f"{path} row {number}")


# What a `datasets` name looks like ("name" or "org/name"); anything else that does not exist is a mistyped path.
_DATASET_NAME = re.compile(r"[\w-]+(/[\w.-]+)?")


def _iter_dataset(name: str, tokenizer, text_field: str, split: str) -> Iterator[str]:
    if not _DATASET_NAME.fullmatch(name) or Path(name).suffix in KNOWN_SUFFIXES:
        raise ValueError(
            f"{name} does not exist (no such file or folder). Check the path; `datasets` names look like 'org/name'."
        )
    try:
        import datasets
    except ImportError as error:
        raise ValueError(
            f"{name!r} is neither a file nor a folder; reading it as a `datasets` dataset needs `pip install datasets`."
        ) from error
    for record in datasets.load_dataset(name, split=split, streaming=True):
        yield _render(record, tokenizer, text_field, name)


def iter_documents(source: str, tokenizer, text_field: str = "text", split: str = "train") -> Iterator[str]:
    """Yields the documents of one data source, lazily: a file, a folder of files, or a `datasets` name."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in KNOWN_SUFFIXES)
        if not files:
            raise ValueError(f"The folder {source} holds no {', '.join(KNOWN_SUFFIXES)} file to read documents from.")
        for file in files:
            yield from iter_documents(str(file), tokenizer, text_field, split)
    elif path.is_file() and path.suffix in KNOWN_SUFFIXES:
        if path.suffix in TEXT_SUFFIXES:
            documents = _iter_txt(path)
        elif path.suffix in JSONL_SUFFIXES:
            documents = _iter_jsonl(path, tokenizer, text_field)
        else:
            documents = _iter_parquet(path, tokenizer, text_field)
        read = usable = 0
        for document in documents:
            read += 1
            # Nothing to continue or to learn from, and an empty prompt would reach the base model as no tokens.
            if document.strip():
                usable += 1
                yield document
        if not read:
            raise ValueError(f"{source} holds no prompts or documents: it is empty or blank. Give a file with text.")
        if not usable:
            raise ValueError(
                f"{source} holds no usable prompt or document: the text of each of its {read} records is empty or "
                "blank. Give records with text."
            )
        if usable < read:
            logger.warning_once(f"{source}: {read - usable} of its {read} records have empty or blank text; skipped.")
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


def left_padded(prompts: list[list[int]], pad_token_id: int, device=None) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Token lists of different lengths as one batch padded on the left, as decoder-only generation needs, and its
    attention mask."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention_mask


__all__ = ["Corpus", "is_held_out", "iter_documents", "left_padded", "pack", "tokenize"]
