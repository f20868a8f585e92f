"""Plain decoding on CPU as speculative `generate()` runs its verifier, so that the two compare on the same footing."""

import contextlib

from torch import nn

from .grouped_attention import grouped_sdpa
from .weight_layouts import adaptive_weights


@contextlib.contextmanager
def fast_cpu_decoding(model: nn.Module):
    """
    Plain decoding as speculative `generate()` runs by itself on CPU: each forward on the fastest of the plain,
    transposed and packed weights (`adaptive_weights`: for an fp32 CPU `model`, packed only where its packed and plain
    forwards agree, checked once per model), and grouped key/value heads read in place under a padding mask instead of
    copied (`grouped_sdpa`, torch 2.9 or later: the same results); elsewhere nothing changes. It is never slower than
    plain decoding for long: a shape's first forwards try every kind of weights, and then the fastest runs. On
    leaving, the model is as it was. What speculation itself brings is its speedup over this.

    ```python
    >>> from hf_mlp_speculator import fast_cpu_decoding
    >>> with fast_cpu_decoding(model):
    ...     output = model.generate(input_ids, max_new_tokens=128)
    ```
    """
    with adaptive_weights(model), grouped_sdpa(model):
        yield model
