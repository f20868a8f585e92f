"""`python -m hf_mlp_speculator.training ...`: the same as `hf-mlp-speculator train ...` (what torchrun launches)."""

import argparse

from . import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m hf_mlp_speculator.training", description="Train an MLPSpeculator.")
add_arguments(parser)
raise SystemExit(run(parser.parse_args()))
