"""Heads that begin as a language model: embeddings and output layers copied from the base model.

Medusa starts its heads from the base model's LM head. Here every head's token embedding starts from the base's input
embeddings and its output layer from the base's LM head rows of the draft vocabulary, for tied and untied bases alike.
When the heads are narrower than the base (`inner_dim < hidden_size`), both are projected onto the `inner_dim`
directions that matter most for the base's predictions: the top right-singular vectors of its LM head (restricted to
the draft vocabulary), i.e. the principal subspace of its output embeddings. Both are rescaled to the reference's
initial spread (std `1 / sqrt(inner_dim)`), so that the heads start from the base's geometry without its large logits.
"""

import math

import torch
from torch import nn

from .sharding import whole


@torch.no_grad()
def initialize_from_base(speculator, base) -> None:
    """Copies (projected and rescaled) `base`'s input embeddings and LM head into every head of `speculator`."""
    heads = speculator.speculator
    inner_dim = speculator.config.speculator_inner_dim
    embeddings = whole(base.get_input_embeddings().weight).detach().float().cpu()
    output = base.get_output_embeddings()
    if output is None or output.weight.shape != embeddings.shape:
        raise ValueError(
            f"{type(base).__name__} has no LM head of the shape of its input embeddings {tuple(embeddings.shape)}, "
            "so the heads cannot start from it. Train with --no-init-from-base."
        )
    lm_head = whole(output.weight).detach().float().cpu()
    if heads.draft_vocab is not None:
        lm_head = lm_head[heads.draft_vocab.cpu()]
    if inner_dim < embeddings.shape[1]:
        # A draft vocabulary of fewer rows than inner_dim spans fewer directions than the heads have: the complete
        # factorisation (cheap here, its U is rows x rows) fills the rest with an orthonormal complement.
        full = lm_head.shape[0] < inner_dim
        projection = torch.linalg.svd(lm_head, full_matrices=full).Vh[:inner_dim].T
    elif inner_dim == embeddings.shape[1]:
        projection = torch.eye(inner_dim)
    else:
        raise ValueError(
            f"inner_dim={inner_dim} is wider than the base model's hidden size {embeddings.shape[1]}, so the heads "
            "cannot start from its embeddings. Use inner_dim <= hidden_size, or train with --no-init-from-base."
        )
    std = 1 / math.sqrt(inner_dim)

    def rescaled(weight):
        return weight * (std / weight.pow(2).mean().sqrt())

    embedding, head = rescaled(embeddings @ projection), rescaled(lm_head @ projection)
    for module in heads.modules():  # each once, however many names it has
        if isinstance(module, nn.Embedding):
            module.weight.copy_(embedding)
    for module in {*heads.head}:
        module.weight.copy_(head)
