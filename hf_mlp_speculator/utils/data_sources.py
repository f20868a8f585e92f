"""Documents read from a data source: a text, JSON Lines or Parquet file, a folder of them, or a `datasets` name.

Files are read lazily, one document at a time. Chat records (`messages`) are rendered with the tokenizer's chat
template; blank documents are skipped. Below both the trainer, which learns from documents, and the benchmark, which
runs the user's prompts.
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path

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
        f"{where} has neither a {text_field!r} field nor chat `messages` (its fields: {sorted(record)}). Name the "
        "text field with `text_field` (--text-field)."
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
            f"{name!r} is neither a file nor a folder; reading it as a `datasets` dataset needs "
            "`pip install datasets`."
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


__all__ = ["KNOWN_SUFFIXES", "iter_documents"]
