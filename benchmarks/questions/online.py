"""Online training against its take-turns bound: capture alone, train alone, online (thread, process, Ray).

Prints one JSON line per mode. On a GPU host `python -m benchmarks online gpu-plan [smol|8b]` runs online.sh
(prepare and extract in .venv-sglang, then the modes).

Online training against its two parts and against shards on one host, in one process and one run:

    capture alone        online mode's capture (train/sources/online.py, extract.batch_tokens a call) over the training
                         split's first epoch in order, nothing trained; what it captures is kept in memory
    train alone          the same training as online, fed from that memory (no capture, no disk): the trainer's rate
    online thread        the same training, the capture in a thread of the trainer, through the same loaded target
    offline (shards)     training from 01_extract's shards (left out with --no-shards, or when there are none), and
                         the shard reader alone: read, packed, moved to the device, nothing trained
    online processes     the capture in a process of its own beside one trainer process (train.online_placement:
                         process; on one GPU the two share it, the states through host memory); left out with
                         --no-process
    online ray actors    a capture actor and one trainer actor on a local Ray cluster (added with --ray; on one GPU
                         each takes half of it; with sglang_inprocess the capture actor runs in engine.python)
and the take-turns bound 1 / (1/capture + 1/train alone): what the two parts allow when they take turns.

    python -m eagle3lib run tests/params/ci.yaml --to extract --set run.output_root=/tmp/bench-online
    python -m benchmarks online --run-dir /tmp/bench-online/ci --params tests/params/ci.yaml --tokens 8000

--backend sglang_inprocess captures with SGLang's model runner (run this in SGLang's interpreter, on a GPU host:
benchmarks/questions/online.sh). The target is loaded once, in a child process, for the capture, train-alone and online
thread rows; the modes after them start their own capture once that child has ended and freed its memory. Every mode
trains from scratch with the same params and token budget into its own copy of the run folder (the shards run reads
the run's 01_extract). One JSON line per mode goes to --out as it is made; a mode that fails leaves a row with its
error, the others still run, and the exit status says which failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_script  # noqa: E402
from eagle3lib.params import load_params, parse_override  # noqa: E402
from eagle3lib.prepare import conversations  # noqa: E402
from eagle3lib.train.runtime import launch  # noqa: E402
from eagle3lib.train.sources import online  # noqa: E402
from eagle3lib.train.sources.base import CAPTURE_SUMMARY  # noqa: E402


def scratch_run(run_dir: Path, into: Path, with_shards: bool) -> Path:
    """A copy of the run folder's 00_prepare (and 01_extract for the shards mode) in `into`."""
    out = into / run_dir.name
    shutil.copytree(run_dir / "00_prepare", out / "00_prepare")
    if with_shards:
        (out / "01_extract").symlink_to(run_dir / "01_extract")
    return out


class KeptStates:
    """A StateSource that keeps what it captures, by the sequence's ids, and hands it out again without capturing:
    the train-alone row trains from it as online mode would, with the capture's cost taken out."""

    def __init__(self, states):
        self.states, self.batch_tokens = states, states.batch_tokens
        self.ragged = getattr(states, "ragged", False)
        self.kept, self.captured = {}, 0

    def capture(self, sequences):
        keys = [s.numpy().tobytes() for s in sequences]
        todo = [i for i, k in enumerate(keys) if k not in self.kept]
        if todo:
            got = self.states.capture([sequences[i] for i in todo])
            self.kept.update(zip([keys[i] for i in todo], got, strict=True))
            self.captured += sum(len(sequences[i]) for i in todo)
        return [self.kept[k] for k in keys]


def capture_alone(p, loaded, run_dir: Path, tokens: int) -> tuple[dict, KeptStates]:
    """The capture alone over the first `tokens` tokens of the training order, kept for the train-alone row."""
    states, contract = loaded
    kept = KeptStates(states)
    train_tokens = conversations.load_tokens(run_dir / "00_prepare" / "train.safetensors")
    val_tokens = conversations.load_tokens(run_dir / "00_prepare" / "val.safetensors")
    data, val, _ = online.capture_setup(p, train_tokens, val_tokens, run_dir / "02_train", loaded=(kept, contract))
    # the validation split first, not timed: kept for the train-alone row, and the engine's kernels compiled (SGLang's
    # Triton attention compiles at its first batches: 7,800 tokens/s timed cold against ~200,000 warm on an H200)
    for _ in val.val_sequences():
        pass
    started, done = time.perf_counter(), 0
    for seq in data.train_sequences(0, 0):
        done += len(seq.input_ids)
        if done >= tokens:
            break
    seconds = time.perf_counter() - started
    return {"mode": "capture alone", "tokens": done, "tokens_per_s": round(done / seconds, 1)}, kept


def reader_alone(p, run_dir: Path, tokens: int, verify: bool = True, to_device: bool = True) -> dict:
    """The shards path without the trainer: 01_extract's shards read (train.prefetch_shards ahead, sha256 checked
    unless not `verify`), packed into micro-batches (train.batch_prefetch ahead) and moved to the trainer's device
    (unless not `to_device`), nothing trained."""
    import torch

    from eagle3lib.extract.shards import ShardSet
    from eagle3lib.train.runtime.batches import batch_to, micro_batches, shard_sequences

    shard_set = ShardSet(run_dir / "01_extract" / "train", verify=verify)

    def sequences(epoch, start=0):
        return shard_sequences(shard_set, p.run.seed, epoch, start, prefetch=p.train.prefetch_shards)

    started, done = time.perf_counter(), 0
    stream = micro_batches(sequences, p.train, 0, 0, 0)
    for _, _, mb in stream:
        if to_device:
            batch_to(mb, p.target.device)
        done += mb["tokens"]
        if done >= tokens:
            break
    stream.close()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    name = "shard reader alone" + ("" if verify else ", no sha256") + ("" if to_device else ", to host only")
    return {"mode": name, "tokens": done, "tokens_per_s": round(done / (time.perf_counter() - started), 1)}


def in_process_mode(name: str, params_file: str, overrides: dict, run_dir: Path, scratch: Path, loaded) -> dict:
    """Online training through an already loaded capture (launch.run_stage in this process)."""
    run = scratch_run(run_dir, scratch / name.replace(" ", "_"), with_shards=False)
    started = time.perf_counter()
    s = launch.run_stage(load_params(params_file, overrides), str(run), handed=loaded)
    return summary_row(name, s, run, time.perf_counter() - started)


def train_mode(name: str, params_file: str, overrides: dict, run_dir: Path, scratch: Path) -> dict:
    source = overrides.get("train.source", "shards")
    run = scratch_run(run_dir, scratch / name.replace(" ", "_"), with_shards=source == "shards")
    started = time.perf_counter()
    s = launch.launch(load_params(params_file, overrides), str(run))
    return summary_row(name, s, run, time.perf_counter() - started)


def summary_row(name: str, s: dict, run: Path, wall: float) -> dict:
    row = {"mode": name, "tokens": s["tokens"], "tokens_per_s": s["train_tokens_per_s"], "wall_s": round(wall, 1)}
    row |= {"data_wait_s": s["data_wait_s"], "est_accept_len@3": s["eval"]["est_accept_len"].get("3")}
    capture = run / "02_train" / CAPTURE_SUMMARY
    if capture.is_file():
        row["capture_process"] = json.loads(capture.read_text())
    elif s.get("online"):
        row["capture_thread"] = s["online"]
    return row


def in_process_modes(args, p, online_mode: dict, run_dir: Path, scratch: Path, show) -> None:
    """The rows through this process's own loaded target: capture alone, then train alone and online in a thread,
    in turns (a drift of the machine reaches both)."""
    # what the pipeline pulls ahead of the last step: the queue and a micro-batch being packed
    margin = (p.train.online_queue_batches + 2) * p.train.batch_rows * p.train.max_seq_len
    loaded = online.load_states(p)
    row, kept = capture_alone(p, loaded, run_dir, args.tokens + margin)
    show(row)
    # the trainer's first steps in a process (CUDA context, cuBLAS, the allocator) are not timed with a mode's
    warm = online_mode | {"train.max_tokens": 16 * p.train.batch_rows * p.train.max_seq_len}
    in_process_mode("warm-up", args.params, warm, run_dir, scratch, (kept, loaded[1]))
    for n in range(args.repeat):
        before = kept.captured
        row = in_process_mode(f"train alone {n}", args.params, online_mode, run_dir, scratch, (kept, loaded[1]))
        show(row | {"mode": "train alone", "captured_while_training": kept.captured - before})
        row = in_process_mode(f"online thread {n}", args.params, online_mode, run_dir, scratch, loaded)
        show(row | {"mode": "online thread"})
    getattr(loaded[0], "close", lambda: None)()


def append(path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu-plan"]:
        return gpu_script.plan_main("online", argv[1:], PLANS, "smol")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="a run folder whose 00_prepare and 01_extract finished")
    ap.add_argument("--params", required=True, help="that run's params file")
    ap.add_argument("--tokens", type=int, default=8000, help="train.max_tokens of each mode")
    ap.add_argument("--out", default=None, help="JSONL file for the rows (appended)")
    ap.add_argument("--no-process", action="store_true", help="leave out the capture-process mode")
    ap.add_argument(
        "--ray",
        action="store_true",
        help="add the Ray mode (train.online_placement: ray, a local cluster); Ray from this environment or .ray-site",
    )
    ap.add_argument("--backend", choices=["hf", "sglang_inprocess"], default=None, help="default: the params'")
    ap.add_argument("--no-shards", action="store_true", help="leave out the offline (shards) mode")
    ap.add_argument("--repeat", type=int, default=1, help="train alone and online this many times each, in turns")
    ap.add_argument(
        "--reader-variants", action="store_true", help="the shard reader alone also without sha256 and without the move"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more params overrides")
    ap.add_argument("--in-process-part", action="store_true", help=argparse.SUPPRESS)  # the child's part
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    common = {
        "train.max_tokens": args.tokens,
        "train.resume": False,
        "train.eval_every": 10**6,  # one evaluation at the end: the rate is the step's and the capture's
        "train.checkpoint_every": 10**6,
    } | dict(parse_override(kv) for kv in args.set)
    if args.backend:
        common["extract.backend"] = args.backend
    online_mode = common | {"train.source": "online"}
    p = load_params(args.params, online_mode)
    modes = []
    if not args.no_shards and (run_dir / "01_extract" / "train").is_dir():
        modes.append(("offline (shards)", common))
    if not args.no_process:
        modes.append(("online processes", online_mode | {"train.online_placement": "process"}))
    if args.ray:  # with sglang_inprocess the capture actor runs in engine.python, which must have this Ray too
        ray_site = ROOT / ".ray-site"  # where the tests read Ray from, outside the workbook's environment
        if ray_site.is_dir() and str(ray_site) not in sys.path:
            sys.path.append(str(ray_site))
        modes.append(("online ray actors", online_mode | {"train.online_placement": "ray"}))
    rows, failed = [], []

    def show(row):  # every row reaches --out as it is made: a mode that fails later loses none of them
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            append(args.out, [row])

    with tempfile.TemporaryDirectory(prefix="online-bench-") as scratch:
        if args.in_process_part:
            in_process_modes(args, p, online_mode, run_dir, Path(scratch), show)
            return
        # the rows through this process's own target, in a child process: its exit frees the target's GPU memory
        # before the modes that load their own (an 8B shape's second SGLang engine did not fit an 80 GB H100
        # beside the first)
        part = Path(scratch) / "in-process.jsonl"
        code = subprocess.call(
            [sys.executable, "-m", __spec__.name, *argv, "--in-process-part", "--out", str(part)], cwd=ROOT
        )
        rows += [json.loads(line) for line in part.read_text().splitlines()] if part.is_file() else []
        if args.out:
            append(args.out, rows)
        if code != 0:
            failed.append(f"the in-process modes (exit status {code})")
        for name, overrides in modes:
            try:
                if name == "offline (shards)":
                    shards_params = load_params(args.params, common)
                    show(reader_alone(shards_params, run_dir, args.tokens))
                    if args.reader_variants:
                        show(reader_alone(shards_params, run_dir, args.tokens, verify=False))
                        show(reader_alone(shards_params, run_dir, args.tokens, verify=False, to_device=False))
                show(train_mode(name, args.params, overrides, run_dir, Path(scratch)))
            except Exception as e:  # the rows made so far are kept, and the other modes still run
                show({"mode": name, "error": f"{type(e).__name__}: {e}"[-3000:]})
                failed.append(name)
    by = {}
    for r in rows:
        if "tokens_per_s" in r:
            by.setdefault(r["mode"], []).append(r["tokens_per_s"])
    if "capture alone" not in by or "train alone" not in by:
        sys.exit(f"no take-turns bound: {', '.join(failed)} failed (their rows in {args.out or 'the output above'})")
    capture, train = by["capture alone"][0], sum(by["train alone"]) / len(by["train alone"])
    bound = 1 / (1 / capture + 1 / train)
    summary = {
        "mode": "take-turns bound",
        "tokens_per_s": round(bound, 1),
        "capture": capture,
        "train": round(train, 1),
    }
    summary |= {"backend": p.extract.backend, "separate_devices_bound": min(capture, train)}
    rows.append(summary)
    print(f"\n{'mode':<24} {'tokens/s':>9} {'of bound':>9}")
    for r in rows:
        if "tokens_per_s" in r:
            print(f"{r['mode']:<24} {r['tokens_per_s']:>9,.1f} {r['tokens_per_s'] / bound:>9.2f}")
        else:
            print(f"{r['mode']:<24} failed: {r['error'].splitlines()[-1][:200]}")
    if args.out:
        append(args.out, [summary])
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (the other rows are in {args.out or 'the output above'})")


PLANS = {"smol": ([], {"MODE": "smol"}), "8b": ([], {"MODE": "8b"})}


def dry_run(work: Path) -> list[str]:
    return ["gpu-plan", "smol", "--stand-in", "--work", str(work)]


if __name__ == "__main__":
    sys.exit(main())
