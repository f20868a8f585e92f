"""Speculative decoding offline: SmolLM2-135M-Instruct with and without its MLPSpeculator, speeds and metrics.

    python examples/offline_inference.py [--max-new-tokens 128] [--num-prompts 8] [--model ... --speculator ...]

The same as `hf-mlp-speculator demo`. The first run builds the default pair (see hf_mlp_speculator/default_models.py).
"""

import sys

from hf_mlp_speculator.cli import main


if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
