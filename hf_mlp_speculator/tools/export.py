"""`hf-mlp-speculator export`: write a speculator in the layout a serving engine loads unchanged.

- `arctic`, for ArcticInference (a vLLM plugin), which loads `ArcticMLPSpeculatorPreTrainedModel` and
  `ArcticLSTMSpeculatorPreTrainedModel` (one `architectures` entry, and `base_model_archs`): an MLP in IBM's keys as
  `speculator.`-prefixed safetensors; an LSTM as ArcticTraining saves it, unprefixed in `pytorch_model.bin`.
- `vllm`, for vLLM V0 and TGI, which load `MLPSpeculatorPreTrainedModel` (MLP only): IBM's published layout, prefixed
  safetensors, `inner_dim` resolved, one top-k per head, and `base_model_name_or_path`.

No engine knows a reduced draft vocabulary: it is widened to the whole vocabulary (`expand_draft_vocab`).
"""

import json
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.utils import logging

ENGINES = ("arctic", "vllm")
ARCTIC_ARCHITECTURES = {False: "ArcticMLPSpeculatorPreTrainedModel", True: "ArcticLSTMSpeculatorPreTrainedModel"}

logger = logging.get_logger(__name__)


def export_speculator(speculator, output_dir, engine: str, base_model_arch: str | None = None) -> Path:
    """
    Writes `speculator` (an `MLPSpeculatorPreTrainedModel`) to `output_dir` for `engine` (`"arctic"` or `"vllm"`) and
    returns the folder. ArcticInference wants the verifier's architecture (`base_model_archs`): give
    `base_model_arch` (e.g. `"LlamaForCausalLM"`), or it is read from the config of `base_model_name_or_path`.
    """
    if engine not in ENGINES:
        raise ValueError(f"Unknown engine {engine!r}: export writes for {' or '.join(ENGINES)}.")
    config = speculator.config
    if engine == "vllm" and config.is_lstm:
        raise ValueError(
            "vLLM V0 and TGI run MLP speculators only, and this is an LSTM one: export it with --engine arctic for "
            "ArcticInference."
        )
    if engine == "vllm" and not config.base_model_name_or_path:
        raise ValueError(
            "TGI reads the verifier from base_model_name_or_path, which this speculator's config lacks: pass "
            "--base-model (a Hub id or folder)."
        )
    if config.reduced_draft_vocab:
        speculator = speculator.expand_draft_vocab()
        config = speculator.config
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    fields = _published_fields(config)
    if engine == "arctic":
        fields["architectures"] = [ARCTIC_ARCHITECTURES[config.is_lstm]]
        fields["base_model_archs"] = [base_model_arch or _verifier_architecture(config.base_model_name_or_path)]
    if config.is_lstm:
        _write_arctic_lstm(speculator, output_dir, fields)
    else:
        speculator.save_pretrained(output_dir)
        (output_dir / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    return output_dir


def _published_fields(config) -> dict:
    """The config as the engines read it: IBM's fields (ArcticTraining's for an LSTM), every default spelled out."""
    fields = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": config.vocab_size,
        "emb_dim": config.emb_dim,
        # TGI multiplies with inner_dim as written: the published `0` (meaning emb_dim) would zero the token term.
        "inner_dim": config.speculator_inner_dim,
        "n_predict": config.n_predict,
        "top_k_tokens_per_head": list(config.top_k_tokens_per_head),
        "n_candidates": config.n_candidates,
        "tie_weights": config.tie_weights,
        "scale_input": config.scale_input,
        "torch_dtype": str(config.dtype or torch.float32).removeprefix("torch."),
    }
    if config.base_model_name_or_path:
        fields["base_model_name_or_path"] = config.base_model_name_or_path
    if config.is_lstm:
        width = str(config.speculator_inner_dim)  # ArcticTraining writes every width as a string
        fields.update(method=config.method, input_hidden_dim=config.input_hidden_dim, emb_dim=width, inner_dim=width,
                      proj_dim=width, tie_lstm_embs=True)  # fmt: skip
    return fields


def _write_arctic_lstm(speculator, output_dir: Path, fields: dict) -> None:
    # ArcticInference pops the four gates' projections by their unprefixed names to fuse them, so the LSTM goes out as
    # ArcticTraining saves it: the heads' own state dict, every tied name included, in pytorch_model.bin.
    weights = {name: tensor.detach().cpu() for name, tensor in speculator.speculator.state_dict().items()}
    torch.save(weights, output_dir / "pytorch_model.bin")
    (output_dir / "config.json").write_text(json.dumps(fields, indent=2) + "\n")


def _verifier_architecture(base_model: str | None) -> str:
    if not base_model:
        raise ValueError(
            "ArcticInference checks the verifier's architecture (base_model_archs), and this speculator's config has "
            "no base_model_name_or_path to read it from: pass --base-model-arch (e.g. LlamaForCausalLM)."
        )
    try:
        architectures = AutoConfig.from_pretrained(base_model).architectures
    except (OSError, ValueError) as error:
        raise ValueError(
            f"ArcticInference checks the verifier's architecture (base_model_archs), and the config of "
            f"base_model_name_or_path={base_model!r} cannot be read here ({' '.join(str(error).split())[:200]}): "
            "pass --base-model-arch (e.g. LlamaForCausalLM)."
        ) from error
    if not architectures:
        raise ValueError(
            f"The config of {base_model!r} names no architecture: pass --base-model-arch (e.g. LlamaForCausalLM)."
        )
    return architectures[0]


def add_arguments(parser):
    parser.add_argument("source", help="The speculator: a folder or Hub id that AutoModel.from_pretrained loads.")
    parser.add_argument("output_dir", help="Where to write the exported checkpoint.")
    parser.add_argument("--engine", required=True, choices=ENGINES,
                        help="arctic: ArcticInference (a vLLM plugin). vllm: vLLM V0 and TGI.")  # fmt: skip
    parser.add_argument("--base-model-arch", help="The verifier's architecture, e.g. LlamaForCausalLM (arctic; "
                        "read from base_model_name_or_path when not given).")  # fmt: skip
    parser.add_argument("--base-model", help="Sets base_model_name_or_path (vllm: TGI loads the verifier from it).")


def run(args) -> int:
    from ..models.modeling_mlp_speculator import MLPSpeculatorPreTrainedModel

    speculator = MLPSpeculatorPreTrainedModel.from_pretrained(args.source)
    if args.base_model:
        speculator.config.base_model_name_or_path = args.base_model
    folder = export_speculator(speculator, args.output_dir, args.engine, args.base_model_arch)
    kind = "LSTM" if speculator.config.is_lstm else "MLP"
    print(f"Wrote the {kind} speculator for {args.engine} to {folder}")
    return 0
