"""Each engine's own serving benchmark, run in the engine's interpreter against a running server: the load (Poisson
arrivals at a request rate, capped at a concurrency) and what a serving engineer holds against an SLO (output
tokens/s, time to first token and inter-token latency percentiles).

- vLLM: `vllm bench serve` (vllm/benchmarks/serve.py), started through its module for the reason launch_command
  gives, reading the prompts as a ShareGPT-format JSON file (its custom dataset needs pandas, which the vLLM
  environment lacks) and saving its result JSON. It leaves out prompts over 1,024 tokens.
- SGLang: `python -m sglang.benchmark.serving` reading a JSONL of {"conversations"} (its custom dataset) and
  appending its result as a JSON line; it imports Hugging Face's `datasets`, which the engine's environment must
  have.

Both descend from the same benchmark script, so their result fields agree: output_throughput, completed, and
{p50 (median), p90, p99} of ttft/itl/tpot in ms. Prompts are sent as the chat-rendered text of the sweep's
prompts; output is greedy, ignore_eos, a fixed number of tokens.
"""

from __future__ import annotations

import json
import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from eagle3lib.engines.server import EngineError

# The figures read from either tool's result (ms, except throughput and counts).
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "tpot")

VLLM_BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


@dataclass(frozen=True)
class LoadPoint:
    """One load: Poisson arrivals at `rate` requests/s (None: all at once) with at most `concurrency` in flight
    (None: no cap)."""

    rate: float | None
    concurrency: int | None

    def name(self) -> str:
        arrivals = "closed loop" if self.rate is None else f"{self.rate:g} req/s"
        return arrivals + ("" if self.concurrency is None else f", {self.concurrency} in flight")

    def as_dict(self) -> dict:
        return {"rate": self.rate, "concurrency": self.concurrency}


def figures(result: dict) -> dict:
    """The common figures of either tool's result."""
    out = {
        "completed": result["completed"],
        "output_tokens": result.get("total_output_tokens"),
        "duration_s": result.get("duration"),
        "tokens_per_s": result["output_throughput"],
        "request_throughput": result.get("request_throughput"),
    }
    for name in LATENCIES:
        for p in PERCENTILES:
            key = f"p{p}_{name}_ms"
            out[key] = result.get(key, result.get(f"median_{name}_ms") if p == 50 else None)
    return out


class ServingBench(ABC):
    """An engine's serving benchmark: the prompts file it reads, its command for one load point, its result."""

    tool = ""

    @abstractmethod
    def prompts_file(self, texts: list[str], max_tokens: int, path: Path) -> Path: ...

    @abstractmethod
    def command(self, python, server, target_dir, prompts: Path, n: int, max_tokens: int, point, out: Path) -> list:
        """The tool's command line: every prompt of the file once, at `point`, its result written to `out`."""

    @abstractmethod
    def read(self, out: Path) -> dict: ...

    def fix(self, log_text: str, python: str) -> str | None:
        """What to do about a failure the log shows, when it is a known one."""
        return None

    def run(self, python, server, target_dir, texts: list[str], max_tokens: int, point, folder, timeout_s: float):
        """The figures of the tool's run of every text at `point` against `server` (target_dir: the served model,
        whose tokenizer the tool counts tokens with; its files and log kept in folder)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{server.log_path.stem}-rate{point.rate or 'inf'}-c{point.concurrency or 'inf'}"
        prompts = self.prompts_file(texts, max_tokens, folder / f"{stem}-prompts.jsonl")
        out, log = folder / f"{stem}.json", folder / f"{stem}.log"
        out.unlink(missing_ok=True)
        cmd = self.command(python, server, target_dir, prompts, len(texts), max_tokens, point, out)
        with open(log, "w") as f:
            try:
                done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise EngineError(f"{self.tool} at {point.name()} ran past {timeout_s:.0f} s; its log: {log}") from None
        if done.returncode != 0 or not out.is_file():
            text = log.read_text(errors="replace")
            tail = "\n".join(text.splitlines()[-15:])
            fix = self.fix(text, python)
            raise EngineError(
                f"{self.tool} at {point.name()} failed (exit {done.returncode})" + (f": {fix}" if fix else "")
                + f"; {log} ends:\n{tail}"
            )  # fmt: skip
        got = figures(self.read(out))
        if got["completed"] < len(texts):
            raise EngineError(f"{self.tool} at {point.name()}: {got['completed']} of {len(texts)} requests completed")
        return got | {"log": str(log)}


class VllmBenchServe(ServingBench):
    tool = "vllm bench serve"

    def prompts_file(self, texts, max_tokens, path):
        rows = [{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": ""}]} for t in texts]
        path.write_text(json.dumps(rows))
        return path

    def command(self, python, server, target_dir, prompts, n, max_tokens, point, out):
        cmd = [python, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", server.url, "--model", server.model]
        cmd += ["--tokenizer", str(target_dir)]
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", str(prompts)]
        cmd += ["--sharegpt-output-len", str(max_tokens), "--num-prompts", str(n), "--no-oversample"]
        cmd += ["--disable-shuffle", "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm"]
        cmd += ["--request-rate", "inf" if point.rate is None else str(point.rate)]
        cmd += [] if point.concurrency is None else ["--max-concurrency", str(point.concurrency)]
        cmd += ["--percentile-metrics", ",".join(LATENCIES), "--metric-percentiles", ",".join(map(str, PERCENTILES))]
        return cmd + ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]

    def read(self, out):
        return json.loads(out.read_text())

    def fix(self, log_text, python):
        if "input_requests[0]" in log_text and "IndexError" in log_text:
            return "it kept none of the prompts: it sends only prompts of 4 to 1,024 tokens"
        return None


class SglangBenchServing(ServingBench):
    tool = "sglang.benchmark.serving"

    def prompts_file(self, texts, max_tokens, path):
        rows = [{"conversations": [{"content": t}, {"content": "x " * max_tokens}]} for t in texts]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    def command(self, python, server, target_dir, prompts, n, max_tokens, point, out):
        cmd = [python, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", server.url]
        cmd += [
            "--model",
            str(target_dir),
            "--tokenizer",
            str(target_dir),
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(prompts),
        ]
        cmd += ["--num-prompts", str(n), "--sharegpt-output-len", str(max_tokens), "--seed", "0", "--disable-tqdm"]
        cmd += ["--request-rate", "inf" if point.rate is None else str(point.rate)]
        cmd += [] if point.concurrency is None else ["--max-concurrency", str(point.concurrency)]
        return cmd + ["--extra-request-body", json.dumps({"temperature": 0}), "--output-file", str(out)]

    def read(self, out):
        return json.loads(out.read_text().strip().splitlines()[-1])  # it appends a line per run

    def fix(self, log_text, python):
        if "No module named 'datasets'" in log_text:
            return f"it imports Hugging Face datasets, which the SGLang environment lacks: {python} -m pip install datasets"
        return None
