"""The trainer's streaming data: readers per format, packing, the held-out split and resuming at a position."""

import itertools
import json

import pytest
import torch

from hf_mlp_speculator.data import PackedTextStream, is_held_out, iter_documents, pack
from tiny_tokenizer import char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.eos_token = "~"  # a printable character, so that the test can read the packed text back
    return tokenizer


def test_txt_documents_are_paragraphs(tmp_path, tokenizer):
    path = tmp_path / "a.txt"
    path.write_text("first line\nsame doc\n\n\n  \nsecond\n\nthird")
    assert list(iter_documents(str(path), tokenizer)) == ["first line\nsame doc", "second", "third"]


def test_jsonl_text_field_and_chat_messages(tmp_path, tokenizer):
    path = tmp_path / "a.jsonl"
    records = [{"text": "plain"}, {"messages": [{"role": "user", "content": "hi"}]}, {"body": "other field"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    documents = iter_documents(str(path), tokenizer)
    # Records without the text field fall back to chat messages, rendered with the tokenizer's chat template.
    assert [next(documents), next(documents)] == ["plain", "<user>hi"]
    with pytest.raises(ValueError, match=r"a.jsonl:3 has neither a 'text' field nor chat `messages`.*--text-field"):
        next(documents)
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "other field"}))
    assert list(iter_documents(str(tmp_path / "b.jsonl"), tokenizer, text_field="body")) == ["other field"]
    no_template = char_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        list(iter_documents(str(path), no_template))


def test_parquet(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", "two", "three"]}), tmp_path / "a.parquet")
    assert list(iter_documents(str(tmp_path / "a.parquet"), tokenizer)) == ["one", "two", "three"]


def test_folder_reads_its_files_in_order_and_bad_sources_say_why(tmp_path, tokenizer):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "ay"}))
    (tmp_path / "notes.csv").write_text("ignored in a folder")
    assert list(iter_documents(str(tmp_path), tokenizer)) == ["ay", "bee"]
    with pytest.raises(ValueError, match=r"suffix '\.csv' is not one of"):
        list(iter_documents(str(tmp_path / "notes.csv"), tokenizer))
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install datasets"):
            list(iter_documents("no/such-dataset", tokenizer))


def test_pack_is_back_to_back_with_eos_and_drops_the_remainder(tokenizer):
    sequences = list(pack(["abc", "defgh", "ij"], tokenizer, seq_length=4))
    assert [tokenizer.decode(s) for s in sequences] == ["abc~", "defg", "h~ij"]
    assert all(s.dtype == torch.long and s.shape == (4,) for s in sequences)


def test_held_out_split_is_by_document_and_stable(tmp_path, tokenizer):
    documents = [f"document number {i}" for i in range(200)]
    (tmp_path / "a.txt").write_text("\n\n".join(documents))
    held_out = [d for d in documents if is_held_out(d, 0.2)]
    assert 20 < len(held_out) < 60  # a hash split, near its share

    stream = PackedTextStream([str(tmp_path / "a.txt")], tokenizer, seq_length=8, eval_fraction=0.2)
    eval_text = "".join(tokenizer.decode(s) for s in stream.eval_sequences(1000))
    train_text = "".join(tokenizer.decode(s) for s in itertools.islice(stream.train_sequences(), 100))
    assert eval_text.startswith("".join(d + "~" for d in held_out)[: len(eval_text)])
    assert train_text.startswith("".join(d + "~" for d in documents if d not in held_out)[: len(train_text)])


def test_train_sequences_cycle_and_resume_exactly_at_a_position(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("\n\n".join(f"doc {i}" for i in range(30)))
    stream = PackedTextStream(str(tmp_path / "a.txt"), tokenizer, seq_length=5, eval_fraction=0.0)
    per_epoch = len(list(pack((f"doc {i}" for i in range(30)), tokenizer, 5)))
    run = list(itertools.islice(stream.train_sequences(), 3 * per_epoch))
    assert all(torch.equal(a, b) for a, b in zip(run, run[per_epoch:]))  # epoch after epoch
    for skip in (0, 7, per_epoch + 3, 2 * per_epoch):
        resumed = list(itertools.islice(stream.train_sequences(skip=skip), 5))
        assert all(torch.equal(a, b) for a, b in zip(resumed, run[skip : skip + 5], strict=True))


def test_empty_or_too_short_data_says_what_to_do(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="No training data given"):
        PackedTextStream([], tokenizer, seq_length=8)
    (tmp_path / "a.txt").write_text("tiny")
    stream = PackedTextStream(str(tmp_path / "a.txt"), tokenizer, seq_length=64, eval_fraction=0.0)
    with pytest.raises(ValueError, match="no complete sequence of 64 tokens outside the held-out split"):
        next(stream.train_sequences())
    with pytest.raises(ValueError, match=r"held-out split \(eval_fraction=0.0\) holds no complete sequence"):
        stream.eval_sequences(4)


def test_prompts_are_whole_documents_ending_where_they_end(tmp_path):
    tokenizer = char_tokenizer()
    path = tmp_path / "prompts.jsonl"
    texts = [f"prompt {i} " + "x" * i for i in range(40)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    stream = PackedTextStream([str(path)], tokenizer, seq_length=8, eval_fraction=0.2)
    train = [t for t in texts if not is_held_out(t, 0.2)]
    held_out = [t for t in texts if is_held_out(t, 0.2)]
    assert held_out and list(stream.prompts(10, held_out=True)) == [tokenizer(t)["input_ids"][-10:] for t in held_out]
    cycled = list(itertools.islice(stream.prompts(10), 2 * len(train) + 3))
    assert cycled == [tokenizer(t)["input_ids"][-10:] for t in (train * 3)[: len(cycled)]]  # epoch after epoch
    assert list(itertools.islice(stream.prompts(10, skip=len(train) + 2), 4)) == cycled[len(train) + 2 : len(train) + 6]
