"""Command line: python -m eagle3lib {run, params check} ..."""

from __future__ import annotations

import argparse
import errno
import sys

import eagle3lib  # noqa: F401  (sets OMP_WAIT_POLICY before anything imports torch)


def _overrides(items: list[str]) -> dict:
    from eagle3lib.params import parse_override

    return dict(parse_override(s) for s in items)


def build_parser() -> argparse.ArgumentParser:
    """The command line: run, params check, convert, verify."""
    parser = argparse.ArgumentParser(prog="python -m eagle3lib", description="EAGLE-3 workbook")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the stage notebooks in order")
    run.add_argument("params", help="params file, e.g. params/smollm2-135m-cpu.yaml")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--from", dest="from_stage", metavar="STAGE", help="force this stage and every later one")
    group.add_argument("--only", dest="only_stage", metavar="STAGE", help="run just this stage (forced)")
    run.add_argument(
        "--to",
        dest="to_stage",
        metavar="STAGE",
        help="stop after this stage (a batch of calls, each with a time limit, can run a few at a time)",
    )
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a param (repeatable)")
    echo = run.add_mutually_exclusive_group()
    echo.add_argument(
        "--verbose", action="store_true", help="echo each cell's log (always in the stage folder's NN_stage.log)"
    )
    echo.add_argument("--quiet", action="store_true", help="the default: a line per stage and its progress bar")

    params = sub.add_parser("params", help="params files")
    params_sub = params.add_subparsers(dest="params_command", required=True)
    check = params_sub.add_parser(
        "check", help="validate a params file and print it resolved: every section, its bases and defaults included"
    )
    check.add_argument("file")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    convert = sub.add_parser("convert", help="export a drafter checkpoint for an engine")
    convert.add_argument("checkpoint", help="canonical, speculators or EAGLE/SpecForge checkpoint folder")
    convert.add_argument("--to", required=True, choices=["sglang", "vllm", "speculators"])
    convert.add_argument("--out", required=True, help="output folder")
    convert.add_argument(
        "--target",
        help="the target the drafter was trained for (folder or hub id): refused unless it matches the checkpoint's "
        "eagle3.json; for a checkpoint without one (speculators, EAGLE/SpecForge) the contract is built from it and "
        "written into the output",
    )

    verify = sub.add_parser("verify", help="load-back gate: exit 0 only when the engine would load the export")
    verify.add_argument("folder")
    verify.add_argument("--engine", required=True, choices=["vllm", "sglang", "speculators"])
    verify.add_argument(
        "--target",
        help="target to serve with (default: the contract's); needed for a folder without eagle3.json, whose "
        "contract is built from it",
    )
    verify.add_argument("--python", help="interpreter with the engine (default: .venv-<engine>/bin/python)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("convert", "verify"):
        return _export_command(args)
    from eagle3lib.params import ParamsError, dumps, load_params

    try:
        if args.command == "params":
            print(dumps(load_params(args.file, _overrides(args.set))), end="")
            return 0
        return _run_command(args)
    except (ParamsError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # permissions, a full disk: the path and what to do, not a traceback
        print(f"error: {os_error_text(e)}", file=sys.stderr)
        return 2


def _run_command(args) -> int:
    """`run`: the stage notebooks in order; 1 when a stage failed, 3 when another run holds the folder."""
    import logging

    from eagle3lib.run_folder import RunFolderBusy
    from eagle3lib.workbook.pipeline import StageError, run_pipeline

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = run_pipeline(
            args.params,
            _overrides(args.set),
            args.from_stage,
            args.only_stage,
            log_output=args.verbose,
            to_stage=args.to_stage,
        )
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RunFolderBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:
        print(f"interrupted: {e or 'Ctrl-C'}; finished stages are kept, the next run redoes the rest", file=sys.stderr)
        return 130
    print(f"run finished: {out / 'index.html'}")
    return 0


def os_error_text(e: OSError) -> str:
    """An OS error as its path and what to do about it."""
    from eagle3lib.run_folder import DISK_FULL_ADVICE

    where = f"{e.filename}: " if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"the disk is full while writing {e.filename or 'the run folder'}: {DISK_FULL_ADVICE}"
    advice = {
        errno.EACCES: "this user may not write there: fix its permissions or set run.output_root to a folder you own",
        errno.EPERM: "this user may not write there: fix its permissions or set run.output_root to a folder you own",
        errno.EROFS: "a read-only file system: set run.output_root to a writable folder",
    }.get(e.errno, "see the path and the system's message")
    return f"{where}{e.strerror or e} ({advice})"


def _export_command(args) -> int:
    from eagle3lib.convert import gate, layouts

    try:
        if args.command == "convert":
            print(layouts.export(args.checkpoint, args.to, args.out, target=args.target))
            return 0
        report = gate.verify(args.folder, args.engine, target=args.target, python=args.python)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = report["counts"]
    print(
        f"{args.engine} gate: {'PASS' if report['ok'] else 'FAIL'} ({c['loaded']}/{c['expected']} loaded, "
        f"{c['skipped']} skipped, {c['extra']} extra)"
    )
    for problem in report["problems"]:
        print(f"  - {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
