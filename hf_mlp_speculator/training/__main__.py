"""`python -m hf_mlp_speculator.training ...`: the same as `hf-mlp-speculator train ...` (what torchrun launches),
errors included: a mistake in the input is one line, not a traceback from every process."""

import sys

from ..cli import main

raise SystemExit(main(["train", *sys.argv[1:]]))
