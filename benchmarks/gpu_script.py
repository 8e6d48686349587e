"""The GPU plans of the questions: a question's shell script next to it (benchmarks/questions/<question>.sh) run in
the environments benchmarks/gpu_host/setup.sh makes, its JSON lines printed as the question's rows. Every script
reads its environments from these variables (defaults: the setup script's folders in the checkout):

    E3_PYTHON           .venv/bin/python              this project, its test extras, the embedded target
    SGLANG_PYTHON       .venv-sglang/bin/python       sglang[all] (the engine, and our in-process capture)
    SPECULATORS_PYTHON  .venv-speculators/bin/python  speculators
    SPECFORGE_PYTHON    .venv-specforge/bin/python    SpecForge
    OUT                 the result folder's raw/ (logs and records the script keeps)
    WORK                scratch (default: $TMPDIR/benchmarks-<question>)

A dry run checks the script's syntax and which environments are there, prints the command it would run and a
{"skipped": ...} row, and runs nothing on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "benchmarks" / "questions"
VENVS = {
    "E3_PYTHON": ".venv",
    "SGLANG_PYTHON": ".venv-sglang",
    "SPECULATORS_PYTHON": ".venv-speculators",
    "SPECFORGE_PYTHON": ".venv-specforge",
}


def add_options(ap: argparse.ArgumentParser, default_plan: str | None = None) -> None:
    ap.add_argument(
        "--venvs", type=Path, default=ROOT, help="the folder holding the setup script's .venv* (default: the checkout)"
    )
    ap.add_argument("--raw", type=Path, default=None, help="where the script's logs go (default: a temp folder)")
    ap.add_argument(
        "--work", type=Path, default=None, help="scratch for the script (default: $TMPDIR/benchmarks-QUESTION)"
    )
    ap.add_argument(
        "--stand-in", action="store_true", help="check the plan and the environments, run nothing (dry run)"
    )


def environment(question: str, args: argparse.Namespace) -> dict[str, str]:
    """The script's variables: each environment's python (an exported variable wins), OUT, WORK, ROOT."""
    env = dict(os.environ)
    for name, venv in VENVS.items():
        env.setdefault(name, str(Path(args.venvs) / venv / "bin" / "python"))
    raw = args.raw or Path(tempfile.mkdtemp(prefix=f"benchmarks-{question}-raw-"))
    work = args.work or Path(tempfile.gettempdir()) / f"benchmarks-{question}"
    env.update(
        ROOT=str(ROOT), OUT=str(raw), WORK=str(work), PYTHONPATH=f"{ROOT}:{env.get('PYTHONPATH', '')}".rstrip(":")
    )
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off: not every host's driver has it
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run(
    question: str, args: argparse.Namespace, script_args: list[str], variables: dict[str, str] | None = None
) -> int:
    """Runs benchmarks/questions/<question>.sh with script_args (variables added to its environment), its lines
    printed as they come; with args.stand_in, checks it and runs nothing. Returns its exit status."""
    script = QUESTIONS / f"{question}.sh"
    env = environment(question, args) | (variables or {})
    shown = " ".join(f"{k}={v}" for k, v in (variables or {}).items())
    command = f"{shown + ' ' if shown else ''}bash {script.relative_to(ROOT)} {' '.join(script_args)}".strip()
    if args.stand_in:
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        if syntax.returncode:
            print(syntax.stderr, file=sys.stderr)
            return syntax.returncode
        missing = [name for name in VENVS if not Path(env[name]).exists()]
        print(f"would run: {command}  (OUT={env['OUT']}, WORK={env['WORK']})")
        print(f"environments missing here: {', '.join(missing) or 'none'}")
        skip(f"the GPU plan ({command}): a dry run checks it and runs nothing on a GPU")
        return 0
    Path(env["OUT"]).mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(["bash", str(script), *script_args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:  # fmt: skip
        for line in proc.stdout:
            print(line, end="", flush=True)
    return proc.returncode


def plan_main(question: str, argv: list[str], plans: dict[str, tuple[list[str], dict[str, str]]], default: str) -> int:
    """`python -m benchmarks QUESTION gpu-plan [PLAN] [script arguments] [options]`: PLAN names (the script's
    arguments, its variables) in `plans`."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {question} gpu-plan")
    ap.add_argument("plan", nargs="?", default=default, choices=sorted(plans))
    ap.add_argument("script_args", nargs="*", help="more arguments for the script")
    add_options(ap)
    a = ap.parse_args(argv)
    script_args, variables = plans[a.plan]
    return run(question, a, script_args + a.script_args, variables)


class PlanQuestion:
    """A question that is only a GPU plan (its script beside it): `main` runs `gpu-plan PLAN`, `dry_run` checks
    `dry_plan` with --stand-in. A module binds both: `main, dry_run = PlanQuestion(...).entry_points()`."""

    def __init__(self, question: str, plans: dict[str, tuple[list[str], dict[str, str]]], default: str, dry_plan=None):
        self.question, self.plans, self.default, self.dry_plan = question, plans, default, dry_plan or default

    def main(self, argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else argv
        argv = argv[1:] if argv[:1] == ["gpu-plan"] else argv
        return plan_main(self.question, argv, self.plans, self.default)

    def dry_run(self, work: Path) -> list[str]:
        return ["gpu-plan", self.dry_plan, "--stand-in", "--work", str(work)]

    def entry_points(self):
        return self.main, self.dry_run


def skip(what: str) -> int:
    """A dry run's stand-in for a part that cannot run here: says so in a row of its own."""
    print(json.dumps({"skipped": what}))
    return 0
