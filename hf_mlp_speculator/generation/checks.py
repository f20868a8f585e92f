"""What a speculative `generate()` call is refused for, each with a message that names the problem and the fix."""

from ..drafting.drafter import heads_for_call
from ..drafting.drafts import TreeSpec


def check_speculator_fits(model, speculator, generation_config, tree: dict) -> None:
    """
    Raises a `ValueError` naming the problem and its fix when `speculator` cannot draft for `model` under
    `generation_config`, the call's merged generation config, and the `tree` options of the call.
    """
    _check_pair(model, speculator)
    _check_options(speculator.config, generation_config)
    TreeSpec.for_call(speculator.config, heads_for_call(speculator.config, generation_config), **tree)
    if tree and _attends_by_alibi(model):
        raise ValueError(
            f"Tree candidates need a model that places each node by its position_ids under a custom 4D attention "
            f"mask, and {type(model).__name__} derives its positions from the attention mask (ALiBi). Drop "
            "n_candidates / top_k_tokens_per_head to draft chains, which it takes."
        )


def _check_pair(model, speculator) -> None:
    """Whether `speculator` drafts for `model` at all: a decoder, real weights, the same hidden size and vocabulary."""
    if model.config.is_encoder_decoder:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model, and an MLPSpeculator drafts from the hidden states "
            "of a decoder-only model (a causal LM). Use a decoder-only base model, or drop assistant_model."
        )
    on_meta = [name for name, param in speculator.named_parameters() if param.is_meta]
    if on_meta:
        raise ValueError(
            f"The speculator's weights are on the meta device (e.g. {on_meta[0]}): they hold no values to draft with. "
            "A speculator drafts whole on one device: load it without a device_map that offloads it to the CPU or "
            "disk (`AutoModel.from_pretrained(..., device_map=\"cuda:0\")`, or none), or materialise it "
            "(`speculator.to_empty(device=...)`, then `load_state_dict`)."
        )
    devices = sorted({str(param.device) for param in speculator.parameters()})
    if len(devices) > 1:
        raise ValueError(
            f"The speculator's weights are spread over {', '.join(devices)}, and it drafts on one device: move it "
            f"whole to one, e.g. `speculator.to(\"{devices[-1]}\")` (any device works; the verifier's hidden states "
            "are moved to it)."
        )
    text_config, spec_config = model.config.get_text_config(), speculator.config
    base = spec_config.base_model_name_or_path
    trained_for = f" (it was trained for {base})" if base else ""
    if spec_config.verifier_hidden_size != text_config.hidden_size:
        field = "input_hidden_dim" if spec_config.is_lstm else "emb_dim"
        raise ValueError(
            f"The speculator's {field} is {spec_config.verifier_hidden_size} but the model's hidden_size is "
            f"{text_config.hidden_size}: this speculator was trained for another base model{trained_for}. Use a "
            "speculator trained for this model, or train one with `hf-mlp-speculator train`."
        )
    if spec_config.vocab_size != text_config.vocab_size:
        hint = (
            f" If the model's vocabulary is only padded (its tokenizer has at most {spec_config.vocab_size} tokens), "
            f"pad the speculator to match: `speculator.resize_vocab({text_config.vocab_size})`."
            if spec_config.vocab_size < text_config.vocab_size
            else ""
        )
        raise ValueError(
            f"The speculator's vocab_size is {spec_config.vocab_size} but the model's vocab_size is "
            f"{text_config.vocab_size}{trained_for}.{hint}"
        )


def _check_options(spec_config, generation_config) -> None:
    """The call's decoding options that speculation takes: no beams or contrastive search, whole numbers of drafts."""
    num_beams = generation_config.num_beams or 1
    if num_beams > 1:
        raise ValueError(
            f"Beam search (num_beams={num_beams}) cannot use an MLPSpeculator: speculative decoding verifies a single "
            "sequence. Use greedy decoding or sampling (num_beams=1), or drop assistant_model."
        )
    penalty_alpha, top_k = generation_config.penalty_alpha or 0, generation_config.top_k or 0
    if penalty_alpha > 0 and top_k > 1 and not generation_config.do_sample:
        raise ValueError(
            f"Contrastive search (penalty_alpha={penalty_alpha}, top_k={top_k}) cannot use an MLPSpeculator: it picks "
            "each token by the hidden states of top_k candidates, which speculative decoding does not compute. Drop "
            "penalty_alpha to decode greedily or sample with the speculator, or drop assistant_model."
        )
    num_assistant_tokens = generation_config.num_assistant_tokens
    if num_assistant_tokens is not None and (not _is_int(num_assistant_tokens) or num_assistant_tokens < 1):
        raise ValueError(
            f"num_assistant_tokens={num_assistant_tokens!r}: an MLPSpeculator drafts with its first "
            f"num_assistant_tokens heads, so it must be a whole number between 1 and "
            f"n_predict={spec_config.n_predict} "
            "(larger values mean all heads). To decode without speculation, drop assistant_model."
        )
    lookup = generation_config.prompt_lookup_num_tokens
    if lookup is not None and (not _is_int(lookup) or lookup < 1):
        raise ValueError(
            f"prompt_lookup_num_tokens={lookup!r}: prompt lookup drafts that many tokens per step, so it must be a "
            "positive integer (transformers refuses the same). Drop it to draft with the speculator alone."
        )


def check_schedule(schedule: str) -> str:
    """`num_assistant_tokens_schedule`: "constant" drafts `num_assistant_tokens` heads every step (vLLM's
    `num_speculative_tokens`); "heuristic" and "heuristic_transient" leave each step's depth to the cost-aware
    controller."""
    if schedule not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r}: choose 'constant' (every step drafts num_assistant_tokens "
            "heads) or leave it unset, 'heuristic' or 'heuristic_transient' (the cost-aware controller chooses)."
        )
    return schedule


def check_sampling(sampling, tree: dict, rows: int) -> None:
    """
    `speculative_sampling`: "keyed" (the default: a seed gives the same tokens, see `position_noise`) or "rejection"
    (transformers' rejection sampling, which keeps more drafts where the speculator's distribution differs from the
    verifier's, but whose tokens change with the drafting), for one sequence and a chain only.
    """
    if sampling not in ("keyed", "rejection"):
        raise ValueError(f"speculative_sampling={sampling!r}: choose 'keyed' (the default) or 'rejection'.")
    if sampling == "rejection" and (tree or rows > 1):
        raise ValueError(
            "speculative_sampling='rejection' runs in transformers' assisted decoding, one sequence and one chain at "
            "a time: generate one prompt at a time without n_candidates, or use the default keyed sampling."
        )


def _attends_by_alibi(model) -> bool:
    """Whether `model` biases attention by ALiBi (Bloom, MPT, Falcon with `alibi`), whose positions come from the
    attention mask rather than `position_ids`."""
    config = model.config.get_text_config()
    return config.model_type in ("bloom", "mpt") or bool(getattr(config, "alibi", False))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
