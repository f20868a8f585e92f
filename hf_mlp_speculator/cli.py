"""`hf-mlp-speculator`: train a speculator, run the offline demo, or benchmark.

Each subcommand lives in its own module, which provides `add_arguments(parser)` and `run(args)`.
"""

import argparse
import importlib
import sys

from transformers.utils import logging

SUBCOMMANDS = {
    "train": ("hf_mlp_speculator.training", "Train an MLPSpeculator for any causal LM (stage 1 + stage 2)."),
    "demo": ("hf_mlp_speculator.demo", "Generate with and without speculation and compare speeds."),
    "bench": ("hf_mlp_speculator.bench", "Benchmark plain, prompt-lookup and speculative decoding in one run."),
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hf-mlp-speculator", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(subparsers.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    if not sys.stderr.isatty():
        # Off a terminal a bar's carriage returns pile up into one endless line; ours print a line now and then
        # instead (`progress.Progress`), and transformers' own bars (loading weights) are left out.
        logging.disable_progress_bar()
    return importlib.import_module(SUBCOMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
