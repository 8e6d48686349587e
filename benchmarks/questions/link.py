"""The process placement's link alone: tokens/s of hidden states from a capture process to a trainer process.

Prints one JSON line of figures (tokens/s, GB/s, intact).

The process placement's link alone (train/sources/capture_link.py): how many tokens/s of hidden states it carries
from a capture process to a trainer process for a target's shape, nothing captured or trained. What the wire allows
beside what online training needs (the take-turns bound's tokens/s times the states' bytes a token).

    python -m benchmarks link --hidden 4096 --seq 4096 --batches 24            # Llama-3.1-8B's shape
    python -m benchmarks link --hidden 576 --seq 4096 --batches 48             # SmolLM2-135M's
    python -m benchmarks link --hidden 4096 --device cuda --through-host       # one GPU, both sides

Each micro-batch goes as the placement sends it: a header over the link's control group, then the ids, the aux
states (--aux-layers x hidden) and the final state over its data group, the sender --queue micro-batches ahead of
credits the receiver grants, as the trainers do. With --device cuda the states start on the capture's GPU and end on
the trainer's, through host memory (--through-host: the two share a GPU) or NCCL (GPUs of their own: run it with two
visible GPUs). The receiver checks that what arrived is what was sent (every micro-batch's ids, the last one's states).
One JSON line of figures is printed; --out appends it to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from eagle3lib.train.sources import capture_link  # noqa: E402

SIDE_ENV = "LINK_BENCH_SIDE"  # "0": the sender (the capture's rank), "1": the receiver (a trainer's)


def shapes(args) -> dict:
    return {
        "ids": (4, args.rows, args.seq),
        "aux": (args.rows, args.seq, args.aux_layers * args.hidden),
        "final": (args.rows, args.seq, args.hidden),
    }


def device_of(args, rank: int) -> str:
    if args.device == "cpu":
        return "cpu"
    return "cuda:0" if args.through_host or torch.cuda.device_count() < 2 else f"cuda:{rank}"


def expected_states(args, device: str) -> list[torch.Tensor]:
    """The aux and final states every micro-batch carries (seeded: the receiver checks what arrived against them)."""
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    return [torch.randn(shapes(args)[k], generator=g).to(dtype).to(device) for k in ("aux", "final")]


def send_side(args, link) -> None:
    device, s = device_of(args, 0), shapes(args)
    states = expected_states(args, device)
    pending, credits = [], args.queue
    for n in range(args.batches):
        ids = torch.full(s["ids"], n, dtype=torch.long, device=device)
        if credits == 0:
            credits += int(link.recv(torch.zeros(1, dtype=torch.long), 1, control=True))
        header = torch.tensor([capture_link.BATCH, 0, n, 0, args.rows * args.seq, 1, args.rows, 0], dtype=torch.long)
        pending = [(w, t) for w, t in pending if not w.is_completed()]
        pending.append((link.isend(header, 1, control=True), header))
        for t in [ids, *states]:
            t = t.to(link.data_device)  # the capture's copy off its GPU when the data group is gloo
            pending.append((link.isend(t, 1), t))
        credits -= 1
    for w, _ in pending:
        w.wait()
    link.barrier()


def receive_side(args, link) -> dict:
    device, dtype = device_of(args, 1), getattr(torch, args.dtype)
    s = shapes(args)
    seconds, ids_intact = [], True
    for n in range(args.batches):
        started = time.perf_counter()
        link.recv(torch.zeros(capture_link.HEADER, dtype=torch.long), 0, control=True)
        ids = link.recv(torch.empty(s["ids"], dtype=torch.long, device=link.data_device), 0).to(device)
        got = [
            link.recv(torch.empty(s[k], dtype=dtype, device=link.data_device), 0).to(device) for k in ("aux", "final")
        ]
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
        if n < args.batches - args.queue:
            link.send(torch.ones(1, dtype=torch.long), 0, control=True)
        ids_intact &= bool((ids == n).all())
    link.barrier()
    # what arrived is what was sent: every micro-batch's ids (its index), the last one's states
    states_intact = all(torch.equal(a, b) for a, b in zip(got, expected_states(args, device), strict=True))
    timed = seconds[args.warmup :]  # the first micro-batches set up the groups' buffers and connections
    tokens = args.rows * args.seq
    state_bytes = tokens * (args.aux_layers + 1) * args.hidden * dtype.itemsize
    total = sum(timed)
    return {
        "backend": link.backend,
        "device": device,
        "hidden": args.hidden,
        "aux_layers": args.aux_layers,
        "dtype": args.dtype,
        "tokens_per_batch": tokens,
        "state_bytes_per_token": state_bytes // tokens,
        "batches_timed": len(timed),
        "ms_per_batch": round(1000 * total / len(timed), 2),
        "tokens_per_s": round(tokens * len(timed) / total, 1),
        "state_gb_per_s": round(state_bytes * len(timed) / total / 1e9, 3),
        "intact": ids_intact and states_intact,
    }


def side(args) -> None:
    rank = int(os.environ[SIDE_ENV])
    if args.device == "cuda":
        torch.cuda.set_device(device_of(args, rank))
    link = capture_link.Link.join(rank, device_of(args, rank))
    try:
        if rank == 0:
            send_side(args, link)
        else:
            print(json.dumps(receive_side(args, link)), flush=True)
    finally:
        link.close()


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096, help="the target's hidden size")
    ap.add_argument("--aux-layers", type=int, default=3, help="aux layers captured (EAGLE-3: 3)")
    ap.add_argument("--rows", type=int, default=1, help="train.batch_rows")
    ap.add_argument("--seq", type=int, default=4096, help="train.max_seq_len")
    ap.add_argument("--dtype", default="bfloat16", help="the states' dtype (the target's)")
    ap.add_argument("--batches", type=int, default=24, help="micro-batches sent")
    ap.add_argument("--warmup", type=int, default=2, help="micro-batches not timed")
    ap.add_argument("--queue", type=int, default=4, help="train.online_queue_batches: how far the sender runs ahead")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--through-host", action="store_true", help="gloo through host memory whatever NCCL says")
    ap.add_argument("--out", default=None, help="JSONL file the figures are appended to")
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)  # a child's part
    args = ap.parse_args(argv)
    if args.batches <= args.warmup:
        sys.exit(f"--batches {args.batches} leaves nothing timed after --warmup {args.warmup}")
    if args.side:
        return side(args)
    store = capture_link.open_store()
    env = os.environ | capture_link.link_env(store, 1, args.through_host) | {"OMP_NUM_THREADS": "1"}
    children = [
        subprocess.Popen(
            [sys.executable, "-m", __spec__.name, *argv, "--side"],
            cwd=ROOT,
            env=env | {SIDE_ENV: str(rank)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [c.communicate()[0] for c in children]
    failed = [rank for rank, c in enumerate(children) if c.returncode != 0]
    if failed:
        sys.exit(f"link benchmark failed: side {failed} exited {[children[r].returncode for r in failed]}")
    row = json.loads(outputs[1].strip().splitlines()[-1])
    print(json.dumps(row))
    if not row["intact"]:
        sys.exit("link benchmark: what arrived is not what was sent")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


OUT_FILE = "rows.jsonl"


def dry_run(work: Path) -> list[str]:
    return ["--hidden", "64", "--seq", "256", "--batches", "6", "--rows", "2", "--queue", "2"]


def headline(rows: list[dict]) -> dict:
    return {k: rows[-1].get(k) for k in ("tokens_per_s", "state_gb_per_s", "intact")}


if __name__ == "__main__":
    sys.exit(main())
