"""Command line: python -m eagle3lib {run, params check} ..."""
from __future__ import annotations

import argparse
import sys

import eagle3lib  # noqa: F401  (sets OMP_WAIT_POLICY before anything imports torch)


def _overrides(items: list[str]) -> dict:
    from .params import parse_override
    return dict(parse_override(s) for s in items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3lib", description="EAGLE-3 workbook")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the stage notebooks in order")
    run.add_argument("params", help="params file, e.g. params/tiny.yaml")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--from", dest="from_stage", metavar="STAGE", help="force this stage and every later one")
    group.add_argument("--only", dest="only_stage", metavar="STAGE", help="run just this stage (forced)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a param (repeatable)")
    run.add_argument("--quiet", action="store_true", help="do not echo notebook output")

    params = sub.add_parser("params", help="params files")
    params_sub = params.add_subparsers(dest="params_command", required=True)
    check = params_sub.add_parser("check", help="validate a params file and print it resolved")
    check.add_argument("file")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    args = parser.parse_args(argv)
    from .params import ParamsError, dumps, load_params

    try:
        if args.command == "params":
            print(dumps(load_params(args.file, _overrides(args.set))), end="")
            return 0
        from .pipeline import StageError, run_pipeline
        import logging
        if not args.quiet:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        try:
            out = run_pipeline(args.params, _overrides(args.set), args.from_stage, args.only_stage,
                               log_output=not args.quiet)
        except StageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"run finished: {out / 'index.html'}")
        return 0
    except (ParamsError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
