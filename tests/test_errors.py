"""Bad input: mistakes users make get an error that names the problem and the fix (on the command line, one line and
exit status 2); what plain generate() takes, speculative generate() takes; a fault in the draft never ends a call."""

import logging
import subprocess
import sys

import pytest
import torch
from conftest import ARCHITECTURES, HIDDEN, VOCAB, make_prompt, make_speculator, make_verifier
from huggingface_hub.errors import StrictDataclassClassValidationError
from test_batched_decoding import ragged_batch
from tiny_tokenizer import char_tokenizer
from transformers import BloomConfig, BloomForCausalLM, GenerationConfig

from hf_mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorPreTrainedModel, cli


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(n_predict=0, top_k_tokens_per_head=[]), r"n_predict must be >= 1, got 0"),
        (dict(n_predict=3, top_k_tokens_per_head=[5, 4]), r"has 2 entries but n_predict is 3"),
        (dict(n_predict=1, top_k_tokens_per_head=[5], tie_weights=True), r"tie_weights=True needs n_predict > 1"),
        (dict(vocab_size=0), r"vocab_size must be positive, got 0"),
        (dict(emb_dim=-4), r"emb_dim must be positive, got -4"),
        (dict(inner_dim=-1), r"inner_dim must be >= 0 \(0 means emb_dim\), got -1"),
        (dict(top_k_tokens_per_head=[5, 0, 3]), r"must hold positive values"),
    ],
)
def test_malformed_config(fields, message):
    # transformers 5 configs report validation failures as StrictDataclassClassValidationError, carrying our message.
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        MLPSpeculatorConfig(**fields)


def test_config_defaults_and_alias():
    config = MLPSpeculatorConfig()
    assert (config.vocab_size, config.emb_dim, config.inner_dim, config.n_predict) == (32000, 4096, 0, 3)
    assert config.top_k_tokens_per_head == [5, 4, 3] and config.n_candidates == 5
    assert not config.tie_weights and not config.scale_input and config.base_model_name_or_path is None
    assert config.hidden_size == 4096 and config.speculator_inner_dim == 4096
    assert MLPSpeculatorConfig(hidden_size=768, inner_dim=1024).emb_dim == 768


@pytest.mark.parametrize("n_predict,top_k", [(1, [5]), (2, [5, 4]), (4, [5, 4, 3, 2]), (6, [5, 4, 3, 2, 2, 2])])
def test_default_branching_follows_n_predict(n_predict, top_k):
    config = MLPSpeculatorConfig(n_predict=n_predict)
    assert config.top_k_tokens_per_head == top_k
    # and survives a save and load as it is
    assert MLPSpeculatorConfig.from_dict(config.to_dict()).top_k_tokens_per_head == top_k


def test_hidden_size_mismatch_names_both_numbers():
    speculator = make_speculator()
    speculator.config.emb_dim = 32
    speculator.config.base_model_name_or_path = "some/other-model"
    with pytest.raises(ValueError, match=r"emb_dim is 32 but the model's hidden_size is 64.*some/other-model"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=speculator)


def test_vocab_mismatch_names_both_numbers_and_the_padding_fix():
    speculator = make_speculator()
    speculator.resize_vocab(VOCAB + 32)
    with pytest.raises(ValueError, match=rf"vocab_size is {VOCAB + 32} but the model's vocab_size is {VOCAB}"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=speculator)
    small = make_speculator()
    small.config.vocab_size = VOCAB - 16
    with pytest.raises(ValueError, match=rf"speculator.resize_vocab\({VOCAB}\)"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=small)


def test_resize_vocab_pads_losslessly():
    """A speculator for a padded verifier vocabulary: pad it, and greedy output stays identical."""
    real = VOCAB - 8
    speculator = make_speculator(vocab_size=real)
    original = speculator.speculator.head[0].weight.clone()
    speculator.resize_vocab(VOCAB)
    heads = speculator.speculator
    assert heads.emb[0].weight.shape == (VOCAB, 48) and not heads.emb[0].weight[real:].any()
    assert torch.equal(heads.head[0].weight, original)  # the heads still score the real ids only
    assert torch.equal(heads.draft_vocab, torch.arange(real))
    verifier, prompt = make_verifier(), make_prompt()
    expected = verifier.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(
        verifier.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=speculator), expected
    )
    with pytest.raises(ValueError, match="only pads"):
        speculator.resize_vocab(10)


def test_resize_vocab_keeps_ties_and_never_drafts_a_padded_id(tmp_path):
    """Padded ids must never win the argmax nor get sampling mass, even when every real logit is negative."""
    real = VOCAB - 8
    speculator = make_speculator(tie_weights=True, vocab_size=real)
    speculator.resize_vocab(VOCAB)
    heads = speculator.speculator
    for modules in (heads.emb, heads.head):
        assert all(module.weight is modules[0].weight for module in modules)
    assert not heads.emb[0].weight[real:].any()

    hidden, token = torch.randn(3, HIDDEN), torch.tensor([4, 5, 6])
    with torch.no_grad():
        state, _ = heads.step(0, heads.input_state(hidden), token)
        # Real head rows pointing away from this state: every real logit of the next head is negative.
        heads.head[1].weight[:real] = -state.mean(0) - 1.0
        _, logits = heads.step(1, state, token)
    assert (logits[:, :real] < 0).all()
    assert (logits.argmax(-1) < real).all()
    assert (logits.softmax(-1)[:, real:] == 0).all()
    assert (logits[:, real:] == torch.finfo(logits.dtype).min).all()

    # The padding survives saving and loading.
    speculator.save_pretrained(tmp_path)
    loaded = MLPSpeculatorPreTrainedModel.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab_size == real and loaded.speculator.head[2].weight is loaded.speculator.head[0].weight
    with torch.no_grad():
        _, reloaded = loaded.speculator.step(1, state, token)
    torch.testing.assert_close(reloaded, logits)


def test_batch_of_inputs_embeds():
    verifier, prompts = make_verifier(), torch.cat([make_prompt(seed=1), make_prompt(seed=2)])
    embeds = verifier.get_input_embeddings()(prompts)
    with pytest.raises(ValueError, match=r"A batch given as inputs_embeds: .* Pass input_ids \(with the batch's "
                                         r"attention_mask\), or generate one prompt at a time\."):
        verifier.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(prompts), max_new_tokens=4,
                          assistant_model=make_speculator())  # fmt: skip


def test_beam_search():
    """Refused wherever num_beams comes from: kwargs, a positional or keyword generation config, the model's."""
    verifier, prompt, speculator = make_verifier(), make_prompt(), make_speculator()
    refused = r"Beam search \(num_beams=3\) cannot use an MLPSpeculator"
    with pytest.raises(ValueError, match=refused):
        verifier.generate(prompt, max_new_tokens=4, num_beams=3, assistant_model=speculator)
    with pytest.raises(ValueError, match=refused):
        verifier.generate(prompt, GenerationConfig(num_beams=3, max_new_tokens=4), assistant_model=speculator)
    with pytest.raises(ValueError, match=refused):
        verifier.generate(prompt, generation_config=GenerationConfig(num_beams=3, max_new_tokens=4),
                          assistant_model=speculator)  # fmt: skip
    verifier.generation_config.num_beams = 3
    with pytest.raises(ValueError, match=refused):
        verifier.generate(prompt, max_new_tokens=4, assistant_model=speculator)
    # A call's own num_beams=1 overrides the model's default.
    expected = verifier.generate(prompt, max_new_tokens=4, num_beams=1)
    assert torch.equal(verifier.generate(prompt, max_new_tokens=4, num_beams=1, assistant_model=speculator), expected)


def test_contrastive_search_is_refused_rather_than_decoded_greedily():
    verifier, prompt, speculator = make_verifier(), make_prompt(), make_speculator()
    with pytest.raises(ValueError, match=r"^Contrastive search \(penalty_alpha=0.6, top_k=4\) cannot use an MLPSpec"):
        verifier.generate(prompt, max_new_tokens=4, penalty_alpha=0.6, top_k=4, assistant_model=speculator)


def test_an_empty_prompt_says_so():
    empty = torch.zeros((1, 0), dtype=torch.long)
    with pytest.raises(ValueError, match=r"^The prompt is empty \(input_ids of shape \(batch, 0\)\)"):
        make_verifier().generate(empty, max_new_tokens=4, assistant_model=make_speculator())


def test_training_forward_checks_input_length():
    speculator = make_speculator(n_predict=3)
    with pytest.raises(ValueError, match=r"sequence_length \+ n_predict = 8 tokens per row"):
        speculator(hidden_states=torch.zeros(1, 5, HIDDEN), input_ids=torch.zeros(1, 5, dtype=torch.long))


def test_encoder_decoder_base_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(d_model=HIDDEN, d_ff=128, num_layers=1, num_heads=2, d_kv=32,
                                             vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0,
                                             eos_token_id=1)).eval()  # fmt: skip
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder model"):
        t5.generate(make_prompt(), max_new_tokens=4, assistant_model=make_speculator())


def test_speculator_on_the_meta_device_is_refused():
    with torch.device("meta"):
        speculator = make_speculator()
    with pytest.raises(ValueError, match=r"weights are on the meta device \(e.g. speculator.emb.0.weight\)"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, assistant_model=speculator)


@pytest.mark.parametrize("num_assistant_tokens", [0, -1, 2.0])
@pytest.mark.parametrize("batch", [1, 2])
def test_num_assistant_tokens_below_one_is_refused(num_assistant_tokens, batch):
    """0 would silently mean all heads, a negative count would silently turn drafting off, and 2.0 is no count."""
    prompt = make_prompt().repeat(batch, 1)
    refused = rf"num_assistant_tokens={num_assistant_tokens}: .* a whole number between 1 and n_predict=3"
    with pytest.raises(ValueError, match=refused):
        make_verifier().generate(prompt, max_new_tokens=4, num_assistant_tokens=num_assistant_tokens,
                                 assistant_model=make_speculator())  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompt_lookup_num_tokens=0), r"prompt_lookup_num_tokens=0: prompt lookup drafts that many tokens"),
        (dict(prompt_lookup_num_tokens=-1), r"prompt_lookup_num_tokens=-1: .* must be a positive integer"),
        (dict(n_candidates=0), r"n_candidates=0: a tree keeps that many candidate paths, so it must be a positive"),
        (dict(n_candidates="3"), r"n_candidates='3': .* positive integer \(the speculator's own is 5\)"),
        (dict(top_k_tokens_per_head=[2, "2", 2]), r"top_k_tokens_per_head=\[2, '2', 2\]: give a list of positive"),
        (dict(top_k_tokens_per_head=3), r"top_k_tokens_per_head=3: give a list of positive integers"),
        (dict(num_assistant_tokens_schedule="fixed"), r"num_assistant_tokens_schedule='fixed': choose 'constant'"),
        (dict(speculative_sampling="gumbel"), r"speculative_sampling='gumbel': choose 'keyed' \(the default\) or "),
    ],
)  # fmt: skip
@pytest.mark.parametrize("batch", [1, 2])
def test_bad_generate_options_are_refused(kwargs, message, batch):
    prompt = make_prompt().repeat(batch, 1)
    with pytest.raises(ValueError, match=message):
        make_verifier().generate(prompt, max_new_tokens=4, assistant_model=make_speculator(), **kwargs)


def test_trees_on_an_alibi_model_are_refused_and_chains_run():
    torch.manual_seed(0)
    verifier = BloomForCausalLM(BloomConfig(hidden_size=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB)).eval()
    verifier.generation_config.assistant_confidence_threshold = 0.0
    prompt, speculator = make_prompt(), make_speculator()
    with pytest.raises(ValueError, match=r"Tree candidates need a model that places each node by its position_ids .* "
                                         r"BloomForCausalLM derives its positions from the attention mask \(ALiBi\)"):
        verifier.generate(prompt, max_new_tokens=4, assistant_model=speculator, n_candidates=3)
    expected = verifier.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(verifier.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=speculator),
                       expected)  # fmt: skip


def test_a_sampled_prompt_as_inputs_embeds_points_to_its_two_ways():
    verifier, prompt = make_verifier(), make_prompt()
    embeds = verifier.get_input_embeddings()(prompt)
    with pytest.raises(ValueError, match=r"A sampled prompt given as inputs_embeds: .* Pass input_ids, or pass "
                                         r"speculative_sampling='rejection'\."):
        verifier.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=True, assistant_model=make_speculator())
    torch.manual_seed(0)  # both ways run
    verifier.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=True, assistant_model=make_speculator(),
                      speculative_sampling="rejection")  # fmt: skip
    verifier.generate(prompt, max_new_tokens=4, do_sample=True, assistant_model=make_speculator())


def test_several_sampled_sequences_with_prompt_lookup_run():
    """transformers refuses num_return_sequences with its own prompt lookup; the package's loop takes both."""
    verifier, prompt = make_verifier(), make_prompt()
    kwargs = dict(max_new_tokens=16, do_sample=True, num_return_sequences=2, assistant_model=make_speculator(),
                  prompt_lookup_num_tokens=3)  # fmt: skip
    torch.manual_seed(4)
    first = verifier.generate(prompt, **kwargs)
    torch.manual_seed(4)
    assert first.shape == (2, 28) and torch.equal(verifier.generate(prompt, **kwargs), first)


@pytest.mark.parametrize("options", [dict(n_candidates=2), dict(num_return_sequences=2)])
def test_rejection_sampling_is_for_one_chain(options):
    with pytest.raises(ValueError, match=r"speculative_sampling='rejection' runs in transformers' assisted decoding"):
        make_verifier().generate(make_prompt(), max_new_tokens=4, do_sample=True, assistant_model=make_speculator(),
                                 speculative_sampling="rejection", **options)  # fmt: skip


@pytest.mark.parametrize("tree", [False, True])
def test_int32_input_ids_in_a_batch(tree):
    verifier, prompts = make_verifier(), torch.cat([make_prompt(seed=1), make_prompt(seed=2)])
    kwargs = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompts))
    expected = verifier.generate(prompts, **kwargs)
    options = dict(n_candidates=3) if tree else {}
    output = verifier.generate(prompts.int(), assistant_model=make_speculator(), **kwargs, **options)
    assert torch.equal(output, expected)


def broken_speculator(kind: str):
    """A speculator whose second head gives NaN logits, or one in float16 whose logits overflow to inf."""
    speculator = make_speculator(n_predict=3)
    with torch.no_grad():
        if kind == "nan":
            speculator.speculator.head[1].weight.fill_(float("nan"))
        else:
            speculator.speculator.head[0].weight.fill_(6e4)  # finite in float16, but its logits pass 65504
            speculator.half()
    return speculator


@pytest.mark.parametrize("kind", ["nan", "fp16 overflow"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_nonfinite_speculator_logits_never_end_a_call(kind, batch, do_sample, tree, caplog):
    """The rows whose speculator logits are not finite draft less; the call completes, greedy identical to plain."""
    verifier, prompts = make_verifier(), torch.cat([make_prompt(seed=s) for s in range(batch)])
    speculator = broken_speculator(kind)
    kwargs = dict(max_new_tokens=12, do_sample=do_sample, attention_mask=torch.ones_like(prompts))
    expected = verifier.generate(prompts, **kwargs)
    with caplog.at_level(logging.WARNING, logger="hf_mlp_speculator"):
        tree_options = {"n_candidates": 2} if tree else {}
        output = verifier.generate(prompts, assistant_model=speculator, **kwargs, **tree_options)
    assert output.shape == expected.shape
    if not do_sample:
        assert torch.equal(output, expected)
    metrics = speculator.speculation_metrics
    assert metrics.num_nonfinite_steps > 0 and metrics.num_steps > 0
    # The drafts verified: head 0's only where head 1 is broken, none where head 0 overflows.
    assert metrics.head_draft_tokens[1:] == [] and (metrics.num_draft_tokens > 0) == (kind == "nan")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "logits were not finite (NaN or inf)" in warnings[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny base model with its tokenizer, a speculator for it, one for another base, and prompt files."""
    root = tmp_path_factory.mktemp("bad_inputs")
    make_verifier().save_pretrained(root / "base")
    char_tokenizer().save_pretrained(root / "base")
    make_speculator().save_pretrained(root / "speculator")
    other = MLPSpeculatorConfig(vocab_size=VOCAB, emb_dim=32, inner_dim=48, top_k_tokens_per_head=[2, 2, 2])
    MLPSpeculatorPreTrainedModel(other).save_pretrained(root / "other_speculator")
    (root / "latin1.txt").write_bytes("A first prompt\nCaf\xe9 au lait\n".encode("latin-1"))
    (root / "blank.txt").write_text("\n  \n\n")
    (root / "a_file").write_text("not a folder")
    return root


def command_line_errors():
    """(argv, the message after `hf-mlp-speculator <command>: error: `), with `{root}` for the fixture folder."""
    train = ["train", "--base-model", "{root}/base", "--output-dir", "{out}", "--report-to", "none"]
    bench = ["bench", "--model", "{root}/base", "--speculator", "{root}/speculator", "--output-dir", "{root}/bench"]
    return [
        (train + ["--prompts", "{root}/latin1.txt"],
         "{root}/latin1.txt:2 is not UTF-8 text (byte 0xe9 at column 4): save the file as UTF-8."),
        (train + ["--prompts", "{root}/blank.txt"],
         "{root}/blank.txt holds no prompts or documents: it is empty or blank. Give a file with text."),
        (train + ["--prompts", "{root}/missing.txt"], "{root}/missing.txt does not exist (no such file or folder)."),
        (["train", "--base-model", "{root}/base", "--prompts", "{root}/blank.txt", "--output-dir", "{root}/a_file"],
         "--output-dir {root}/a_file is a file, not a folder: name a new folder, or a run's to resume."),
        (["train", "--base-model", "{root}/no_model", "--prompts", "{root}/blank.txt", "--output-dir", "{out}"],
         "{root}/no_model"),
        (bench + ["--prompts", "{root}/latin1.txt"], "{root}/latin1.txt:2 is not UTF-8 text"),
        (bench + ["--prompts", "{root}/blank.txt"], "{root}/blank.txt holds no prompts or documents"),
        (bench[:-1] + ["{root}/a_file"],
         "--output-dir {root}/a_file is a file, not a folder: name a folder for the results."),
        (["bench", "--model", "{root}/base"], "--model {root}/base needs --speculator"),
        (["bench", "--model", "{root}/base", "--speculator", "{root}/no_speculator", "--output-dir", "{root}/bench"],
         "{root}/no_speculator"),
        (["bench", "--model", "{root}/base", "--speculator", "{root}/other_speculator", "--max-new-tokens", "2",
          "--num-prompts", "1", "--output-dir", "{root}/bench"],
         "The speculator's emb_dim is 32 but the model's hidden_size is 64"),
        (["demo", "--model", "{root}/base", "--speculator", "{root}/other_speculator", "--max-new-tokens", "2",
          "--num-prompts", "1"], "The speculator's emb_dim is 32 but the model's hidden_size is 64"),
    ]  # fmt: skip


@pytest.mark.parametrize("argv,message", command_line_errors())
def test_command_line_errors_are_one_line(folders, tmp_path, capsys, argv, message):
    argv = [arg.format(root=folders, out=tmp_path / "out") for arg in argv]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"hf-mlp-speculator {argv[0]}: error: ") and message.format(root=folders) in line, err
    assert "Traceback" not in err
    # A run stopped by a bad input saved nothing: the same command, once the input is fixed, needs no --resume.
    assert not list((tmp_path / "out").glob("checkpoint-*"))


@pytest.mark.parametrize(
    "flags,message",
    [(["--num-prompts", "0"], "argument --num-prompts: '0' is not a positive integer"),
     (["--max-new-tokens", "-3"], "argument --max-new-tokens: '-3' is not a positive integer"),
     (["--batch-sizes", "0"], "argument --batch-sizes: '0' is not a comma-separated list of positive integers"),
     (["--batch-sizes", "4,x"], "argument --batch-sizes: '4,x' is not a comma-separated list of positive integers"),
     (["--repeats", "two"], "argument --repeats: 'two' is not a positive integer")],
)  # fmt: skip
def test_bench_arguments_are_checked_by_argparse(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"hf-mlp-speculator bench: error: {message}"


def test_debug_shows_the_traceback(folders, tmp_path):
    with pytest.raises(ValueError, match="holds no prompts or documents"):
        cli.main(["train", "--base-model", str(folders / "base"), "--prompts", str(folders / "blank.txt"),
                  "--output-dir", str(tmp_path / "out"), "--debug"])  # fmt: skip


def test_a_command_line_error_is_one_line_on_stderr(folders, tmp_path):
    """As a user's shell sees it: one line, exit status 2, no traceback."""
    argv = ["train", "--base-model", str(folders / "base"), "--prompts", str(folders / "latin1.txt"),
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "hf_mlp_speculator.cli", *argv], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hf-mlp-speculator train: error: {folders}/latin1.txt:2 is not UTF-8 text (byte 0xe9 at column 4): save the "
        "file as UTF-8."
    ]


def test_unsupported_batched_requests_are_refused():
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch([4, 7])
    speculator = make_speculator()
    with pytest.raises(ValueError, match="output_scores cannot be returned"):
        verifier.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, assistant_model=speculator,
                          return_dict_in_generate=True, output_scores=True)  # fmt: skip
    with pytest.raises(ValueError, match="A static cache serves one sequence drafting chains, and this call has 2 "):
        verifier.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, assistant_model=speculator,
                          cache_implementation="static")  # fmt: skip


def test_sliding_window_overflow_is_refused():
    verifier = ARCHITECTURES["mistral"]()
    verifier.config.sliding_window = 16
    verifier.eval()
    input_ids, attention_mask = ragged_batch([4, 7])
    with pytest.raises(ValueError, match="sliding window of 16"):
        verifier.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, assistant_model=make_speculator())


def test_lookup_with_trees_is_refused():
    verifier, speculator = make_verifier(), make_speculator()
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens drafts chains .* cannot join tree candidates"):
        verifier.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, assistant_model=speculator, n_candidates=2,
                          prompt_lookup_num_tokens=3)  # fmt: skip


def test_tree_requests_are_checked():
    verifier, prompt = make_verifier(), make_prompt()
    speculator = make_speculator()
    with pytest.raises(ValueError, match="n_candidates=9 must be between 1 and the 8 paths"):
        verifier.generate(prompt, max_new_tokens=4, assistant_model=speculator, n_candidates=9)
    with pytest.raises(ValueError, match="one positive branching factor for each of the 3 heads"):
        verifier.generate(prompt, max_new_tokens=4, assistant_model=speculator, top_k_tokens_per_head=[2, 2])
