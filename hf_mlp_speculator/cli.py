"""`hf-mlp-speculator`: train a speculator, run the offline demo, benchmark, or export for a serving engine.

Each subcommand lives in its own module, which provides `add_arguments(parser)` and `run(args)`. A mistake in the
user's input (an argument, a file, a folder, a model, a mismatched pair) is reported as
`hf-mlp-speculator <command>: error: <message>` on one line, with exit status 2; `--debug` shows the traceback.
"""

import argparse
import importlib
import sys

from huggingface_hub.errors import StrictDataclassError
from transformers.utils import logging

SUBCOMMANDS = {
    "train": ("hf_mlp_speculator.training", "Train an MLPSpeculator for any causal LM (stage 1 + stage 2)."),
    "demo": ("hf_mlp_speculator.tools.demo", "Generate with and without speculation and compare speeds."),
    "bench": ("hf_mlp_speculator.tools.bench", "Benchmark plain, prompt-lookup and speculative decoding in one run."),
    "export": ("hf_mlp_speculator.tools.export", "Write a speculator for ArcticInference, vLLM or TGI."),
}
# What the user's input raises: the package's own checks raise ValueError (a config's validation wraps it in a
# StrictDataclassError), and files, folders and models that cannot be read raise OSError; a missing optional package,
# ImportError. Anything else is a bug, and keeps its traceback.
USER_ERRORS = (ValueError, OSError, ImportError, StrictDataclassError)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hf-mlp-speculator", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_arguments(subparser)
        subparser.add_argument("--debug", action="store_true", help="Show the traceback of an error.")
    args = parser.parse_args(argv)
    if not sys.stderr.isatty():
        # Off a terminal a bar's carriage returns pile up into one endless line; ours print a line now and then
        # instead (`progress.Progress`), and transformers' own bars (loading weights) are left out.
        logging.disable_progress_bar()
    try:
        return importlib.import_module(SUBCOMMANDS[args.command][0]).run(args)
    except USER_ERRORS as error:
        if args.debug:
            raise
        if isinstance(error, StrictDataclassError) and error.__cause__ is not None:
            error = error.__cause__  # the validator's own message, without the wrapper's
        message = " ".join(str(error).split()) or type(error).__name__
        # One write: processes of one launch (torchrun) share stderr, and print() writes the line break apart.
        sys.stderr.write(f"hf-mlp-speculator {args.command}: error: {message}\n")
        sys.stderr.flush()
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
