"""The trainer's documents and prompts: readers per format and their errors, BOS handling, packing, the held-out split,
the chat template's user prefix, Magpie prompts, and which target batches a run (under a time budget) uses."""

import json
import logging
import os
import random
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_verifier
from tiny_tokenizer import char_tokenizer
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from hf_mlp_speculator import cli
from hf_mlp_speculator.tools.default_models import evaluation_prompts
from hf_mlp_speculator.training import SpeculatorTrainingArguments, training_data
from hf_mlp_speculator.training.documents import Corpus, is_held_out, iter_documents, pack, tokenize
from hf_mlp_speculator.training.prompts import keep_new, render_chat_prompt, synthesize_user_turns, user_prefix


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.eos_token = "~"  # a printable character, so that the test can read the packed text back
    return tokenizer


def bos_tokenizer() -> PreTrainedTokenizerFast:
    """A char tokenizer that adds a BOS token `<s>` (id 96) in front of every text; its chat template starts with
    it."""
    vocab = {"\x00": 0, **{chr(32 + i): i + 1 for i in range(VOCAB - 1)}, "<s>": VOCAB}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="\x00"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="\x00", bos_token="<s>")
    tokenizer.chat_template = "{{ bos_token }}" + char_tokenizer().chat_template
    return tokenizer


def chars(text: str) -> list[int]:
    """The char tokenizer's ids of `text`, computed independently of any tokenizer."""
    return [ord(c) - 31 for c in text]


# Reading documents.


def test_txt_documents_are_paragraphs(tmp_path, tokenizer):
    path = tmp_path / "a.txt"
    path.write_text("first line\nsame doc\n\n\n  \nsecond\n\nthird")
    assert list(iter_documents(str(path), tokenizer)) == ["first line\nsame doc", "second", "third"]


def test_jsonl_text_field_and_chat_messages(tmp_path, tokenizer):
    path = tmp_path / "a.jsonl"
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    records = [{"text": "plain"}, {"messages": [{"role": "user", "content": "hi"}]}, {"messages": conversation},
               {"body": "other field"}]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    documents = iter_documents(str(path), tokenizer)
    # A conversation that ends with the user's turn is a prompt: it ends where the answer begins.
    assert [next(documents) for _ in range(3)] == ["plain", "<user>hi<assistant>", "<user>hi<assistant>yo"]
    with pytest.raises(ValueError, match=r"a.jsonl:4 has neither a 'text' field nor chat `messages`.*--text-field"):
        next(documents)
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "other field"}))
    assert list(iter_documents(str(tmp_path / "b.jsonl"), tokenizer, text_field="body")) == ["other field"]
    no_template = char_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="a.jsonl:2 holds chat `messages` but the tokenizer has no chat template"):
        list(iter_documents(str(path), no_template))


def test_broken_jsonl_names_the_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "cut off\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:3 is not valid JSON \(.* at column \d+\)"):
        list(iter_documents(str(path), tokenizer))
    path.write_text('{"text": "fine"}\n["a", "list"]\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2 holds a JSON list, not an object"):
        list(iter_documents(str(path), tokenizer))


SHAPE = '{"role": ..., "content": ...}'


@pytest.mark.parametrize(
    "record, message",
    [({"text": 5}, "the 'text' field holds a number, not text. Give each record its text as a string, or chat "
                   "`messages`."),
     ({"text": None}, "the 'text' field holds null, not text. Give each record its text as a string, or chat "
                      "`messages`."),
     ({"text": ["a"]}, "the 'text' field holds a list, not text. Give each record its text as a string, or chat "
                       "`messages`."),
     ({"messages": ["hi"]}, f"message 1 of `messages` is a string; `messages` must be a list of {SHAPE} objects."),
     ({"messages": [{"role": "user", "content": "hi"}, {"text": "yo"}]},
      f"message 2 of `messages` is an object with the fields ['text']; `messages` must be a list of {SHAPE} objects."),
     ({"messages": "hi"}, f"`messages` holds a string, not a list of {SHAPE} objects."),
     ({"messages": []}, f"`messages` holds an empty list, not a list of {SHAPE} objects.")],
)  # fmt: skip
def test_records_that_are_not_text_name_the_file_line_and_what_is_wrong(tmp_path, tokenizer, record, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps(record) + "\n")
    documents = iter_documents(str(path), tokenizer)
    assert next(documents) == "fine"
    with pytest.raises(ValueError) as error:
        next(documents)
    assert str(error.value) == f"{path}:3: {message}"


def test_records_with_empty_text_are_skipped_and_a_file_of_only_those_is_an_error(tmp_path, tokenizer, caplog):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["", "one", " \n ", "two"]))
    with caplog.at_level(logging.WARNING, logger="hf_mlp_speculator"):
        assert list(iter_documents(str(path), tokenizer)) == ["one", "two"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{path}: 2 of its 4 records have empty or blank text; skipped."]
    path.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"messages": [], "text": " "}) + "\n")
    with pytest.raises(ValueError) as error:
        list(iter_documents(str(path), tokenizer))
    assert str(error.value) == (
        f"{path} holds no usable prompt or document: the text of each of its 2 records is empty or blank. Give "
        "records with text."
    )


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_base")
    make_verifier().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "records, message",
    [([{"text": 5}], "{path}:1: the 'text' field holds a number, not text."),
     ([{"text": None}], "{path}:1: the 'text' field holds null, not text."),
     ([{"text": ["a"]}], "{path}:1: the 'text' field holds a list, not text."),
     ([{"messages": ["hi"]}], "{path}:1: message 1 of `messages` is a string;"),
     ([{"text": ""}] * 3, "{path} holds no usable prompt or document: the text of each of its 3 records is empty")],
)  # fmt: skip
def test_prompt_records_that_are_not_text_are_one_line_on_the_command_line(tiny_base, tmp_path, capsys, records,
                                                                           message):  # fmt: skip
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["train", "--base-model", str(tiny_base), "--prompts", str(path), "--output-dir", str(tmp_path / "out"),
            "--targets-cache", str(tmp_path / "cache"), "--report-to", "none"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"hf-mlp-speculator train: error: {message.format(path=path)}")


def test_parquet(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", "two", "three"]}), tmp_path / "a.parquet")
    assert list(iter_documents(str(tmp_path / "a.parquet"), tokenizer)) == ["one", "two", "three"]
    pq.write_table(pa.table({"text": ["one", None]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet row 2: the 'text' field holds null, not text\."):
        list(iter_documents(str(tmp_path / "b.parquet"), tokenizer))


def test_folder_reads_its_files_in_order_and_bad_sources_say_why(tmp_path, tokenizer):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "ay"}))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("sea")
    (tmp_path / "notes.csv").write_text("ignored in a folder")
    assert list(iter_documents(str(tmp_path), tokenizer)) == ["ay", "bee", "sea"]
    with pytest.raises(ValueError, match=r"suffix '\.csv' is not one of"):
        list(iter_documents(str(tmp_path / "notes.csv"), tokenizer))
    (tmp_path / "unreadable").mkdir()
    (tmp_path / "unreadable" / "data.csv").write_text("x")
    with pytest.raises(ValueError, match=r"folder .*unreadable holds no \.txt, \.md, \.text, \.jsonl, \.parquet file"):
        list(iter_documents(str(tmp_path / "unreadable"), tokenizer))


@pytest.mark.parametrize("source", ["corpus.jsonl", "./nope/", "data/corpus.txt", "../corpus.txt", "~/no/such.txt"])
def test_a_mistyped_path_says_it_does_not_exist(tmp_path, monkeypatch, tokenizer, source):
    """Never handed to `datasets` (made unimportable here, so that reaching it would say something else)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=rf"^{re.escape(source)} does not exist \(no such file or folder\)"):
        list(iter_documents(source, tokenizer))
    corpus = Corpus([source], tokenizer)
    with pytest.raises(ValueError, match="does not exist"):
        next(corpus.prompts(64))


def test_a_dataset_name_needs_datasets(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"'org/some-dataset' is neither a file nor a folder.*pip install datasets"):
        list(iter_documents("org/some-dataset", tokenizer))


# Tokens.


def test_tokenize_adds_bos_unless_the_text_starts_with_it():
    tokenizer = bos_tokenizer()
    assert tokenize("hi", tokenizer) == [VOCAB, *chars("hi")]
    assert tokenize("<s>hi", tokenizer) == [VOCAB, *chars("hi")]  # one BOS, not two
    assert tokenize("a <s> inside", tokenizer) == [VOCAB, *chars("a "), VOCAB, *chars(" inside")]
    assert tokenize("hi", char_tokenizer()) == chars("hi")  # a tokenizer without BOS adds nothing


def test_chat_prompts_from_messages_have_one_bos(tmp_path):
    """The chat template renders the BOS itself; the rendered text is not given a second one."""
    tokenizer = bos_tokenizer()
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    (prompt,) = Corpus([str(path)], tokenizer, eval_fraction=0.0).prompts(64)
    assert prompt == [VOCAB, *chars("<user>hello<assistant>")]
    assert render_chat_prompt(tokenizer, "hello") == [VOCAB, *chars("<user>hello<assistant>")]


def test_pack_is_back_to_back_with_eos_and_drops_the_remainder(tokenizer):
    sequences = list(pack(["abc", "defgh", "ij"], tokenizer, seq_length=4))
    assert [tokenizer.decode(s) for s in sequences] == ["abc~", "defg", "h~ij"]
    assert all(s.dtype == torch.long and s.shape == (4,) for s in sequences)


def test_long_prompts_are_skipped_whole_with_a_warning(tmp_path, tokenizer, caplog):
    texts = ["short", "x" * 9, "exactly8", "a much longer prompt", "tiny"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with caplog.at_level(logging.WARNING, logger="hf_mlp_speculator"):
        prompts = list(Corpus([str(path)], tokenizer, eval_fraction=0.0).prompts(8))
    # Kept whole (never cut to fit), in order; the two longer than 8 tokens are left out.
    assert prompts == [chars("short"), chars("exactly8"), chars("tiny")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("2 prompt(s) of ")
    assert "longer than 8 tokens" in warnings[0] and "--prompt-length" in warnings[0]


def test_held_out_split_is_by_document_and_stable(tmp_path, tokenizer):
    documents = [f"document number {i}" for i in range(300)]
    (tmp_path / "a.txt").write_text("\n\n".join(documents))
    shuffled = documents[:]
    random.Random(0).shuffle(shuffled)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in shuffled))

    corpus = Corpus([str(tmp_path / "a.txt")], tokenizer, eval_fraction=0.2)
    held_out, train = list(corpus.documents(held_out=True)), list(corpus.documents())
    assert sorted(held_out + train) == sorted(documents) and not set(held_out) & set(train)
    assert 40 < len(held_out) < 80  # near its share
    # A document's side depends on its text alone: not on its file, format, position or neighbours...
    other = Corpus([str(tmp_path / "b.jsonl")], tokenizer, eval_fraction=0.2)
    assert set(other.documents(held_out=True)) == set(held_out)
    # ...nor on the process (Python's own hash() is salted per process).
    script = (
        "import json, sys; from hf_mlp_speculator.training.documents import is_held_out; "
        "print(json.dumps([d for d in json.load(sys.stdin) if is_held_out(d, 0.2)]))"
    )
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    result = subprocess.run([sys.executable, "-c", script], input=json.dumps(documents), capture_output=True,
                            text=True, env={**os.environ, "PYTHONHASHSEED": seed}, check=True)  # fmt: skip
    assert json.loads(result.stdout) == held_out
    # A larger share holds out a superset: raising eval_fraction never moves a document into training.
    assert set(held_out) <= {d for d in documents if is_held_out(d, 0.5)}
    # Packed sequences keep the two sides apart.
    eval_text = "".join(tokenizer.decode(s) for s in corpus.sequences(8, held_out=True))
    assert "".join(d + "~" for d in held_out).startswith(eval_text)


# Prompts the base model writes itself.


def test_user_prefix_is_exactly_the_text_before_the_users_words():
    tokenizer = char_tokenizer()
    assert user_prefix(tokenizer) == chars("<user>")
    with_system = char_tokenizer()
    with_system.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<system>Be brief.{% endif %}" + with_system.chat_template
    )
    assert user_prefix(with_system) == chars("<system>Be brief.<user>")  # the system turn included
    assert user_prefix(bos_tokenizer()) == [VOCAB, *chars("<user>")]
    assert render_chat_prompt(tokenizer, "Hi there") == chars("<user>Hi there<assistant>")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template.*--synthesize-prompts 0"):
        user_prefix(tokenizer)


def test_keep_new_dedupes_by_normalized_text_and_against_seen():
    seen = {"explain how a rainbow forms"}
    candidates = ["Explain how a RAINBOW forms!", "What is a prime number?", "  what is a   prime number ",
                  "Hi!", "", "Name three rivers.", "What is a prime number?"]  # fmt: skip
    assert keep_new(candidates, seen) == ["What is a prime number?", "Name three rivers."]
    assert seen == {"explain how a rainbow forms", "what is a prime number", "name three rivers"}
    assert keep_new(["name three rivers", "Write a haiku."], seen) == ["Write a haiku."]


def peaked_chat_model():
    """A tiny random Llama made near-deterministic (huge logits), so that its samples are its greedy continuation."""
    base = make_verifier("llama")
    with torch.no_grad():
        base.lm_head.weight.mul_(1000)
    tokenizer = char_tokenizer()
    tokenizer.eos_token = "~"
    prefix = torch.tensor([chars("<user>")])
    greedy = base.generate(prefix, max_new_tokens=24, do_sample=False)[0, prefix.shape[1] :].tolist()
    k = next(k for k in range(4, 24) if greedy[k] not in greedy[:k])
    assert chars("~")[0] not in greedy[:k]
    return base, tokenizer, greedy[:k], greedy[k]


def test_synthesized_user_turns_end_at_the_end_of_turn_and_cut_off_ones_are_empty():
    base, tokenizer, words, end_of_turn = peaked_chat_model()
    base.generation_config.eos_token_id = [end_of_turn]  # e.g. <|im_end|>, not the tokenizer's eos
    turns = synthesize_user_turns(base, tokenizer, count=3, seed=0, max_new_tokens=len(words) + 1)
    assert turns == [tokenizer.decode(words).strip()] * 3
    assert synthesize_user_turns(base, tokenizer, count=2, seed=0, max_new_tokens=len(words)) == ["", ""]


def test_synthesized_user_turns_take_an_end_of_turn_id_given_as_an_int():
    """transformers' generation configs usually hold a single eos_token_id as a plain int."""
    base, tokenizer, words, end_of_turn = peaked_chat_model()
    base.generation_config.eos_token_id = end_of_turn
    assert synthesize_user_turns(base, tokenizer, count=2, seed=0, max_new_tokens=len(words) + 1) == [
        tokenizer.decode(words).strip()
    ] * 2


# Which targets a run uses.


ONE_PROCESS = types.SimpleNamespace(num_processes=1, process_index=0, wait_for_everyone=lambda: None,
                                    is_local_main_process=False)  # fmt: skip


def data_args(tmp_path, prompts, **overrides) -> SpeculatorTrainingArguments:
    settings = dict(base_model="tiny", prompts=[str(prompts)], targets_cache=str(tmp_path / "cache"), new_tokens=6,
                    eval_new_tokens=6, eval_prompts=2, generation_batch_size=4, prompt_length=64, eval_fraction=0.2)
    return SpeculatorTrainingArguments(**{**settings, **overrides})  # fmt: skip


def spy_on_continuations(monkeypatch) -> list:
    """Records the prompts of every continuation the base model computes, and the targets it returns."""
    calls, real = [], training_data.continue_prompts

    def spy(base, prompts, *args, **kwargs):
        targets = real(base, prompts, *args, **kwargs)
        calls.append((prompts, targets))
        return targets

    monkeypatch.setattr(training_data, "continue_prompts", spy)
    return calls


def chat_prompt_file(path: Path, user_texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": f"<user>{t}<assistant>"}) + "\n" for t in user_texts))
    return path


def test_synthesized_prompts_never_repeat_evaluation_training_or_held_out_prompts(tmp_path, monkeypatch):
    tokenizer, base = char_tokenizer(), make_verifier("llama")
    user_texts = [f"Question number {i} about rivers" for i in range(30)]
    prompts = chat_prompt_file(tmp_path / "prompts.jsonl", user_texts)
    held_out = [t for t in user_texts if is_held_out(f"<user>{t}<assistant>", 0.2)]
    train = [t for t in user_texts if t not in held_out]
    assert len(held_out) >= 3
    evaluation = evaluation_prompts()[0]
    batches = [
        [evaluation, f"  {evaluation.upper()}  ", train[4], held_out[2], "A fresh request, one",
         "a fresh REQUEST, one.", "short", "Write " + "very " * 20 + "long", "A fresh request, two"],
        ["A fresh request, two!", "", held_out[0], "A fresh request, three", "A fresh request, four"],
    ]  # fmt: skip
    synthesized = []

    def fake_synthesis(base_model, tok, count, seed, max_new_tokens=48):
        synthesized.append(count)
        return batches[len(synthesized) - 1]

    monkeypatch.setattr(training_data, "synthesize_user_turns", fake_synthesis)
    calls = spy_on_continuations(monkeypatch)
    args = data_args(tmp_path, prompts, synthesize_prompts=3, eval_prompts=2)
    data = training_data.build_training_data(args, base, tokenizer, ONE_PROCESS)

    continued = [[tokenizer.decode(p) for p in prompts_of_call] for prompts_of_call, _ in calls]
    rendered = lambda texts: [f"<user>{t}<assistant>" for t in texts]  # noqa: E731
    assert continued[0] == rendered(held_out[:2])  # the evaluation targets
    assert sum(continued[1:-2], []) == rendered(train)  # every training prompt, in order, 4 at a time
    assert continued[-2:] == [rendered(["A fresh request, one", "A fresh request, two"]),
                              rendered(["A fresh request, three"])]  # fmt: skip
    assert synthesized == [4, 4]  # stopped once 3 were kept
    assert len(data.train) == 6 * (len(train) + 3) and len(data.eval) == 6 * 2


def test_synthesis_that_finds_nothing_new_gives_up(tmp_path, monkeypatch, caplog):
    """A base model that writes no complete new user turn must not keep the run sampling forever."""
    tokenizer, base = char_tokenizer(), make_verifier("llama")
    prompts = chat_prompt_file(tmp_path / "prompts.jsonl", [f"Question number {i} about rivers" for i in range(30)])
    calls = []

    def nothing_new(base_model, tok, count, seed, max_new_tokens=48):
        calls.append(seed)
        if len(calls) > 100:
            raise AssertionError("synthesize_user_turns was called 100 times without a new prompt, and never stopped")
        return [""] * count  # every turn cut off

    monkeypatch.setattr(training_data, "synthesize_user_turns", nothing_new)
    args = data_args(tmp_path, prompts, synthesize_prompts=5)
    with caplog.at_level(logging.WARNING, logger="hf_mlp_speculator"):
        data = training_data.build_training_data(args, base, tokenizer, ONE_PROCESS)
    assert len(calls) == training_data.GIVE_UP_AFTER
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("stopping synthesis at 0 of the 5 prompts" in w for w in warnings), warnings
    assert len(data.train) > 0  # the given prompts still train


def test_a_time_budget_stops_at_the_recorded_seconds_of_the_cached_batches(tmp_path, monkeypatch):
    tokenizer, base = char_tokenizer(), make_verifier("llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n\n".join(f"prompt {i} of the run" for i in range(40)))
    args = data_args(tmp_path, prompts)
    calls = spy_on_continuations(monkeypatch)
    full = training_data.build_training_data(args, base, tokenizer, ONE_PROCESS)
    order = [targets for _, targets in calls]  # the evaluation batch, then the training batches in their order
    assert len(order) >= 8 and torch.equal(full.train.next_tokens, torch.cat([t.next_tokens for t in order[1:]]))

    # Known seconds per batch, recorded in the cache files as a run that took them would have.
    seconds = [4.0, 3.0, 20.0, 1.0, 1.0] + [10.0] * (len(order) - 5)
    files = sorted((tmp_path / "cache").glob("*.pt"))
    assert len(files) == len(order)
    for path in files:
        stored = torch.load(path, weights_only=True)
        (index,) = [i for i, t in enumerate(order) if torch.equal(t.next_tokens, stored["targets"]["next_tokens"])]
        torch.save({**stored, "seconds": seconds[index]}, path)
    listing = {p.name: p.stat().st_mtime_ns for p in files}

    calls.clear()
    def used(budget):
        return training_data.build_training_data(args, base, tokenizer, ONE_PROCESS, budget).train

    # The evaluation batch counts first (4 s). A batch is added while the seconds so far, plus those of the batch
    # before it (the estimate of the next one), fit the budget.
    batches_used = {
        9.99: 1,  # 4 + 3 = 7 after the first; 7 + 3 > 9.99
        10.0: 2,  # 7 + 3 fits exactly; then 27 + 20 does not
        46.99: 2,
        47.0: 5,  # 27 + 20 fits: 28, 28 + 1 fits: 29, 29 + 1 fits: 39 (the 10 s batch); 39 + 10 > 47
        49.0: 6,
        10_000.0: len(order) - 1,  # a budget beyond them all: every batch
    }
    for budget, count in batches_used.items():
        expected = torch.cat([t.next_tokens for t in order[1 : 1 + count]])
        assert torch.equal(used(budget).next_tokens, expected), f"budget {budget}: not the first {count} batches"
    assert calls == []  # nothing recomputed: all from the cache
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*.pt")} == listing


def test_held_out_prompts_of_their_own_hold_no_training_prompt_back(tmp_path, monkeypatch):
    """With eval_data, acceptance is measured on its prompts, every training prompt is trained on, and synthesized
    prompts never repeat an evaluation prompt."""
    tokenizer, base = char_tokenizer(), make_verifier("llama")
    user_texts = [f"Question number {i} about rivers" for i in range(12)]
    prompts = chat_prompt_file(tmp_path / "prompts.jsonl", user_texts)
    eval_texts = ["How deep is the sea?", "Name a blue fish.", "Why do waves break?"]
    eval_data = chat_prompt_file(tmp_path / "eval.jsonl", eval_texts)
    monkeypatch.setattr(training_data, "synthesize_user_turns",
                        lambda *a, **kw: [eval_texts[1], "A brand new question"])  # fmt: skip
    calls = spy_on_continuations(monkeypatch)
    args = data_args(tmp_path, prompts, eval_data=[str(eval_data)], eval_prompts=2, synthesize_prompts=1)
    training_data.build_training_data(args, base, tokenizer, ONE_PROCESS)
    continued = [tokenizer.decode(p) for prompts_of_call, _ in calls for p in prompts_of_call]
    rendered = lambda texts: [f"<user>{t}<assistant>" for t in texts]  # noqa: E731
    assert continued == rendered(eval_texts[:2] + user_texts + ["A brand new question"])
