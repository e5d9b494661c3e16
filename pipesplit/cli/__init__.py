"""The ``pipesplit`` command line: ``demo``, ``split``, ``bench`` and ``schedule``."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from pipesplit.cli.commands import add_bench, add_schedule, add_split
from pipesplit.cli.demo import add_demo
from pipesplit.cli.factory import CLIError
from pipesplit.compat import FAKE_TENSOR_LOGGER
from pipesplit.errors import PipesplitError

_EPILOG = """examples:
  pipesplit demo
  pipesplit split pipesplit.models:gpt --input-shape 4x64:int64 --stages 4 --svg split.svg
  pipesplit bench my_model.py:build --input-shape 16x128 --stages 2,4 --schedules gpipe,1f1b,zb_h1
  pipesplit schedule zb_h1 --stages 4 --microbatches 8 --png zb_h1.png
Run `pipesplit COMMAND --help` for a command's options."""


def _debug_flag(p: argparse.ArgumentParser, compiles: bool = True) -> None:
    # also accepted after the command; SUPPRESS keeps a `--debug` (or `--quiet`) given before it.
    # --quiet only where the command compiles a model: elsewhere there is nothing for it to hide.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks on errors")
    if compiles:
        p.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help=_QUIET)


_QUIET = "do not log the compile phases (capture, annotate, plan, split) and their times"


def _version() -> str:
    import torch

    import pipesplit

    return f"pipesplit {pipesplit.__version__} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipesplit", description="Split PyTorch models into balanced pipeline stages, run and benchmark them.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--quiet", action="store_true", help=_QUIET + " (demo, split, bench)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo(sub, _debug_flag)
    add_split(sub, _debug_flag)
    add_bench(sub, _debug_flag)
    add_schedule(sub, _debug_flag)
    return parser


def _report(e: BaseException, debug: bool) -> None:
    """One ``pipesplit: error:`` line, the message's other lines indented under it, one ``hint:``
    per hint (the error's ``hint`` and its own ``hint:`` lines), and the --debug pointer where a
    traceback would show more than the message (see :func:`traceback_helps`)."""
    if debug:
        traceback.print_exc()
    if isinstance(e, PipesplitError):
        first, *rest = (str(e).strip() or type(e).__name__).splitlines()
    else:  # a bug, or something pipesplit did not anticipate
        first, rest = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}", []
    print(f"pipesplit: error: {first}", file=sys.stderr)
    hints = [line.strip() for line in rest if line.strip().startswith("hint:")] + [getattr(e, "hint", "")]
    for line in rest:
        if line.strip() and not line.strip().startswith("hint:"):
            print(f"  {line.rstrip()}" if not line.startswith(" ") else line.rstrip(), file=sys.stderr)
    for hint in filter(None, hints):
        print(hint if hint.startswith("hint:") else f"hint: {hint}", file=sys.stderr)
    if not debug and traceback_helps(e):
        print("hint: run with --debug for the full traceback", file=sys.stderr)


def traceback_helps(e: BaseException) -> bool:
    """A traceback shows more than the message: for an error pipesplit did not raise on purpose (a
    bug, or an exception from the user's code), and for one of pipesplit's errors that wraps another
    (a failed capture, a factory that raised), not for a usage error whose message says it all."""
    if not isinstance(e, PipesplitError):
        return True
    return e.__cause__ is not None and not isinstance(e.__cause__, PipesplitError)


def _not_a_note(record: logging.LogRecord) -> bool:
    return not getattr(record, "pipesplit_note", False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not args.debug:  # torch logs failed fake-tensor ops with tracebacks before raising the error we report
        logging.getLogger(FAKE_TENSOR_LOGGER).setLevel(logging.CRITICAL)
    # the compile phases as they finish (INFO); --debug adds what torch.export printed on a failed capture
    ours = logging.getLogger("pipesplit")
    level = ours.level
    noting = logging.getLogger("pipesplit.api")  # a plan's warnings are prog.notes, which every command prints
    noting.addFilter(_not_a_note)
    ours.setLevel(logging.DEBUG if args.debug else logging.WARNING if args.quiet else logging.INFO)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("pipesplit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        _report(e, args.debug)
        return 2
    finally:
        ours.setLevel(level)
        noting.removeFilter(_not_a_note)


__all__ = ["CLIError", "build_parser", "main", "traceback_helps"]

if __name__ == "__main__":
    raise SystemExit(main())
