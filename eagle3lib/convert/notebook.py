"""The 03_convert notebook's steps that are more than one call: every engine's export, the load-back gate over
them, the launch commands at the benchmark depths, and the stage's result."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3lib import engines
from eagle3lib.convert import layouts
from eagle3lib.convert.gate import verify
from eagle3lib.params import cache_dir

# What the gate loads back: its name -> (the client that loads it: an engine or speculators' own library, the export
# it loads).
GATE = {
    "vllm": ("vllm", "vllm"),
    "speculators (vLLM)": ("vllm", "speculators"),
    "sglang": ("sglang", "sglang"),
    "speculators": ("speculators", "speculators"),
}


def export_all(p, checkpoint: Path, out: Path) -> dict[str, Path]:
    """The canonical drafter (02_train's drafter/) in each engine's layout that can serve it over the run's target,
    out/<layout>/ (an MLA drafter has no speculators layout: layouts.exportable_engines says why, and gate() reports
    it not checked). Raises, before writing any, when the run's own engine cannot serve it; the drafter stays."""
    refusals = layouts.exportable_engines(checkpoint, target=p.target.name, cache_dir=cache_dir(p))
    if refusals[p.engine.name]:
        raise ValueError(
            f"The run serves with engine.name: {p.engine.name}, which cannot serve this drafter: "
            f"{refusals[p.engine.name]}. The trained drafter is kept in {checkpoint}; change the params and run "
            "again: a finished stage whose sections did not change is kept (02_train reads engine only to train "
            "online beside SGLang)."
        )
    return {
        engine: layouts.export(
            checkpoint,
            engine,
            Path(out) / engine,
            target=p.target.name,
            cache_dir=cache_dir(p),
            depth=max(p.bench.depths),
        )
        for engine, refusal in refusals.items()
        if refusal is None
    }


def gate(p, exports: dict) -> tuple[dict, dict]:
    """Each export loaded back by its engine's own loader (convert.gate.verify). Returns (reports by gate name,
    not_checked: {name: why} for a client not installed here or a layout not exported). The engine this run serves
    with is always checked: its absence raises."""
    not_checked, pending = {}, {}
    # The clients run side by side: each is a process of its own that spends most of its time importing its
    # engine (tens of seconds on a CPU), and none reads another's answer.
    with ThreadPoolExecutor(max_workers=len(GATE)) as pool:
        for name, (engine, layout) in GATE.items():
            if layout not in exports:
                not_checked[name] = f"no {layout} export: its layout cannot serve this drafter (layouts.export_refusal)"
                continue
            python = p.engine.python if p.engine.name == engine else None
            depth = max(p.bench.depths)
            pending[name] = (
                engine,
                pool.submit(
                    verify,
                    exports[layout],
                    engine,
                    target=p.target.name,
                    cache_dir=cache_dir(p),
                    python=python,
                    depth=depth,
                ),
            )
        reports = {}
        for name, (engine, answer) in pending.items():
            try:
                reports[name] = answer.result()
            except FileNotFoundError as e:
                if engine == p.engine.name:
                    raise
                not_checked[name] = str(e)  # said, not hidden
    return reports, not_checked


def gate_rows(reports: dict, not_checked: dict) -> list[dict]:
    """The gate as table rows: passed, the loaded / expected counts and the number of problems per export."""
    rows = [
        {"export": name, "passed": r["ok"], **r["counts"], "problems": len(r["problems"])}
        for name, r in reports.items()
    ]
    return rows + [{"export": name, "passed": "not checked: " + why.split(":")[0]} for name, why in not_checked.items()]


def refuse_failed(reports: dict) -> None:
    """Never hand an engine a drafter it would silently half-load: raise listing every problem."""
    failed = {name: r["problems"] for name, r in reports.items() if not r["ok"]}
    if failed:
        raise RuntimeError(
            "load-back gate failed:\n" + "\n".join(f"  {n}: {x}" for n, ps in failed.items() for x in ps)
        )


def launch_commands(target_dir, exports: dict, depths) -> dict[str, str]:
    """{"<engine> depth <d>": the server command line} for each engine with an export, at each benchmark depth."""
    return {
        f"{engine} depth {d}": " ".join(engines.launch_command(engine, target_dir, exports[engine], d))
        for engine in ("sglang", "vllm")
        if engine in exports
        for d in depths
    }


def commands_text(commands: dict) -> str:
    return "".join(f"# {name}\n{cmd}\n\n" for name, cmd in commands.items())


def result(exports: dict, reports: dict, not_checked: dict, commands: dict) -> dict:
    """For Stage.save: the exports, the gate's counts, the launch commands; loaded/expected per export as the
    headline; every layout's weights as the artifacts."""
    verified = {name: {"ok": r["ok"], **r["counts"]} for name, r in reports.items()}
    figures = {
        "exports": {e: str(x) for e, x in exports.items()},
        "verified": verified,
        "launch_commands": commands,
        "not_checked": not_checked,
    }
    headline = {name: f"{v['loaded']}/{v['expected']} loaded" for name, v in verified.items()}
    return {"figures": figures, "headline": headline, "artifacts": [f"{e}/model.safetensors" for e in exports]}
