"""`megatronapp` command line: train (launching local processes when asked), trace tools, export/import.

    megatronapp train --nproc-per-node 4 --tensor-model-parallel-size 2 ...   # launches 4 ranks
    torchrun --nnodes 2 --nproc-per-node 8 ... -m megatronapp.cli.main train ... # multi-node
    megatronapp trace merge DIR -o timeline.json
    megatronapp trace detect DIR [--json]
    megatronapp generate --load CKPT --prompt TEXT [--nproc-per-node N ...]
    megatronapp scope capture|report ...
    megatronapp export hf --load CKPT --out DIR    # Hugging Face GPTNeoXForCausalLM
    megatronapp import hf --from DIR --save CKPT
    megatronapp schedule simulate|show ...                                  # MegaDPP
    megatronapp preprocess-data --input corpus.jsonl --output-prefix data/corpus  # Megatron .bin/.idx

Every configuration error is reported in one line, with exit code 2, before any process
is launched: each launching command builds a description of its run, which `validate`
(cli/validate.py) checks in one place.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from dataclasses import replace

from torch.distributed.elastic.multiprocessing.errors import record

from megatronapp.cli.args import add_train_arguments
from megatronapp.cli.injection import COMMAND_INJECTIONS, add_injection_arguments
from megatronapp.cli.run import TrainRun, build_train_run
from megatronapp.cli.validate import validate
from megatronapp.dpp.cli import add_schedule_subcommands
from megatronapp.engine.checkpoint_files import CheckpointDamagedError
from megatronapp.launch.local import launched_world_size, under_launcher


class DefaultsShownFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already speaks of its default or
    there is none worth showing (None, an empty list, an on/off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        hidden = default is None or default is argparse.SUPPRESS or default == [] or action.nargs == 0
        if not action.option_strings or hidden or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors in one line (its default prints the whole usage block first), and help
    that shows the defaults; subcommand parsers are made with the parent's class, so they inherit
    both."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShownFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _version() -> str:
    import platform

    import torch

    try:
        ours = importlib.metadata.version("megatronapp")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        ours = "(not installed)"
    return f"megatronapp {ours} (torch {torch.__version__}, Python {platform.python_version()})"


def _show_help_when_bare(parser: argparse.ArgumentParser) -> None:
    """A command group given without its subcommand (`megatronapp`, `megatronapp trace`) prints
    its help, listing the subcommands, instead of an error about a missing argument."""
    for action in parser._actions:  # argparse keeps subcommands only in this private list
        if isinstance(action, argparse._SubParsersAction):
            action.required = False
            parser.set_defaults(bare_command_parser=parser)
            for sub in action.choices.values():
                _show_help_when_bare(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="megatronapp", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train", help="train a GPT with TP/PP/DP (Megatron-LM flag names)")
    add_train_arguments(train)
    train.set_defaults(build_run=_build_train_run, launch=_train)
    from megatronapp.scan.cli import add_trace_subcommands

    add_trace_subcommands(sub)
    from megatronapp.inference.cli import add_generate_subcommand
    from megatronapp.interop.cli import add_interop_subcommands
    from megatronapp.scope.cli import add_scope_subcommands
    from megatronapp.scope_ui.cli import add_scope_ui_train_arguments, add_serve_subcommand

    add_generate_subcommand(sub)
    add_serve_subcommand(add_scope_subcommands(sub))
    add_scope_ui_train_arguments(train)
    add_interop_subcommands(sub)
    add_schedule_subcommands(sub)
    for path, kinds in COMMAND_INJECTIONS.items():  # the test knobs, hidden from --help
        add_injection_arguments(find_subparser(parser, path), kinds)

    from megatronapp.cli.preprocess import add_preprocess_subcommand

    add_preprocess_subcommand(sub)
    _show_help_when_bare(parser)
    return parser


def find_subparser(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser of the subcommand `path` (e.g. ("trace", "run")) under `parser`."""
    for name in path:
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subs.choices[name]
    return parser


def _build_train_run(args: argparse.Namespace) -> TrainRun:
    """What `train` will launch: on torchrun's world, or --nproc-per-node local ranks."""
    from megatronapp.data.tokenizer_types import build_tokenizer

    world = launched_world_size(args.nproc_per_node)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    return build_train_run(args, world, tokenizer.vocab_size)


def _print_config(job) -> None:
    from dataclasses import asdict

    from megatronapp.job import FIELD_COMPONENTS

    print(
        json.dumps(
            {
                "layout": asdict(job.layout),
                "model": asdict(job.model),
                **{name: asdict(getattr(job, name)) for name in FIELD_COMPONENTS},
                "derived": {
                    "dp_size": job.layout.dp_size,
                    "num_microbatches": job.num_microbatches,
                    "padded_vocab_size": job.model.padded_vocab_size,
                    "parameters": job.model.num_parameters(),
                    "flops_per_token": job.model.flops_per_token(),
                },
            },
            indent=1,
        )
    )


def _train(run: TrainRun, argv: list[str]) -> int:
    """Run the validated `run`: in this process (alone, or as a rank under a launcher), or on
    --nproc-per-node local ranks, each of which builds and checks it again from the same flags."""
    if run.print_config:
        _print_config(run.job)
        return 0
    if under_launcher() or not run.nproc_per_node:
        from megatronapp.cli.train import run_rank

        if not under_launcher():
            from megatronapp.cli.launch import new_summary_path, prepare_trace_dir, report_summary

            prepare_trace_dir(run)
            run = replace(run, result_file=run.result_file or str(new_summary_path()))
            run_rank(run)
            return report_summary(run, run.result_file)
        run_rank(run)
        return 0
    from megatronapp.cli.launch import launch_train

    return launch_train(run, argv)


def build_checked_run(argv: list[str]):
    """The frozen run of a command's `argv`, checked (cli/validate.py): what `main` runs, and how
    tests and benchmarks build the runs they start themselves. ValueError or OSError (one line)
    for a run that breaks a rule; SystemExit for a bare command group."""
    args = build_parser().parse_args(argv)
    if not hasattr(args, "build_run"):
        raise SystemExit(f"megatronapp {argv[0]} needs a subcommand")
    return _build_and_check(args)


def _build_and_check(args: argparse.Namespace):
    run = args.build_run(args)
    validate(run)
    return run


@record
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not hasattr(args, "build_run"):  # a bare command group
        args.bare_command_parser.print_help(sys.stderr)
        return 2
    try:  # the one check of every command, before any process starts or any file is written
        run = _build_and_check(args)
    except (ValueError, OSError) as exc:  # ConfigError and the components' errors are ValueErrors
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    try:
        return args.launch(run, argv)  # from here on only the run is read
    except CheckpointDamagedError as exc:  # an older checkpoint has no checksums to verify first
        if under_launcher():  # recorded for the launching process, which names this rank; no traceback
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
            return 1
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
