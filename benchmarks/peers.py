"""The peer trainers, driven through their own CLIs on our data (benchmarks/questions/peers.sh runs these on an H200).

    python -m benchmarks.peers specforge-setup TARGET_DIR FEATURES_DIR WORK --draft-vocab 16384 --epochs 4
        writes WORK/target (the target folder with the weight index SpecForge's TargetHead needs), WORK/draft.json
        (its draft config from the target's, our aux layers) and WORK/run.yaml (its Llama-3.1-8B recipe: lr 1e-4,
        TTT 7, grad clip 0.5, cosine, warmup 0.015, batch 1), and prints the `specforge train` command
    python -m benchmarks.peers speculators-train <speculators train flags>
        speculators 0.9.0's own entry point (TrainConfig.resolve -> main), with the torch-2.11 autotuner fix that
        speculators_throughput.py applies (same kernels, configs and maths)
        (--recipe KEY=VALUE replaces one of the recipe's training keys, e.g. learning_rate=1e-3)
    python -m benchmarks.peers measure OUT.json -- COMMAND...
        runs COMMAND, polling every 0.25 s the GPU memory its processes hold (nvidia-smi's compute apps whose pid
        is COMMAND or one of its descendants, so that trainers running side by side are told apart):
        {command, rc, wall_s, peak_gib} in OUT.json

Nothing of the peers is copied here: they are installed from their wheels (--no-deps, their own folders) and
these only write their inputs and call them.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

# SpecForge's Llama-3.1-8B EAGLE-3 recipe (its examples and schema defaults); epochs and vocabulary are ours to set.
SPECFORGE_RECIPE = {
    "learning_rate": 1e-4,
    "max_grad_norm": 0.5,
    "warmup_ratio": 0.015,
    "lr_scheduler": "cosine",
    "ttt_length": 7,
    "batch_size": 1,
    "attention_backend": "sdpa",
    "seed": 0,
}


def specforge_target(target_dir: Path, out: Path) -> Path:
    """A folder of links to the target's files plus model.safetensors.index.json: SpecForge 0.2.0's TargetHead
    finds the lm_head through an index, which a one-file checkpoint (SmolLM2) lacks."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(target_dir).iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    index = out / "model.safetensors.index.json"
    if not index.exists():
        with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}))
    return out


def specforge_draft_config(target_config: dict, draft_vocab: int, aux_hf_ids: list[int]) -> dict:
    """SpecForge's draft config as it generates one from the target (one Llama layer of the target's shape), with
    the draft vocabulary and the capture layers in its convention (layer id = HF hidden_states id - 1)."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "vocab_size",
            "bos_token_id", "eos_token_id")  # fmt: skip
    cfg = {k: target_config[k] for k in keys if k in target_config}
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        draft_vocab_size=draft_vocab,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_hf_ids]},
    )
    return cfg


def specforge_run_config(work: Path, features: Path, epochs: int, lm_head_key: str, max_length: int) -> dict:
    return {
        "model": {
            "target_model_path": str(work / "target"),
            "draft_model_config": str(work / "draft.json"),
            "embedding_key": "model.embed_tokens.weight",
            "lm_head_key": lm_head_key,
            "torch_dtype": "bfloat16",
        },
        "data": {
            "hidden_states_path": str(features / "train"),
            "eval_hidden_states_path": str(features / "val"),
            "max_length": max_length,
            "cache_dir": str(work / "cache"),
        },
        "training": {
            "strategy": "eagle3",
            "num_epochs": epochs,
            "eval_interval": 500,
            "log_interval": 50,
            **SPECFORGE_RECIPE,
        },  # fmt: skip
        "run_id": "specforge",
        "output_dir": str(work / "output"),
    }


def specforge_setup(argv: list[str]) -> int:
    import argparse

    import yaml

    ap = argparse.ArgumentParser(prog="peers.py specforge-setup")
    ap.add_argument("target_dir", type=Path)
    ap.add_argument("features", type=Path, help="peer_data.py specforge's folder (train/, val/, source.json)")
    ap.add_argument("work", type=Path)
    ap.add_argument("--draft-vocab", type=int, required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--recipe", action="append", default=[], help="KEY=VALUE over the recipe's training keys")
    a = ap.parse_args(argv)
    source = json.loads((a.features / "source.json").read_text())
    aux = source["contract"]["aux_layer_ids"]
    target_config = json.loads((a.target_dir / "config.json").read_text())
    specforge_target(a.target_dir, a.work / "target")
    (a.work / "draft.json").write_text(json.dumps(specforge_draft_config(target_config, a.draft_vocab, aux), indent=2))
    lm_head_key = "model.embed_tokens.weight" if target_config.get("tie_word_embeddings") else "lm_head.weight"
    run = specforge_run_config(a.work, a.features, a.epochs, lm_head_key, a.max_length)
    for item in a.recipe:
        key, sep, value = item.partition("=")
        if not sep or key not in SPECFORGE_RECIPE:
            raise SystemExit(f"--recipe {item!r}: expected KEY=VALUE with KEY one of {sorted(SPECFORGE_RECIPE)}")
        run["training"][key] = yaml.safe_load(value)
    (a.work / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
    print(shlex.join(["specforge", "train", "-c", str(a.work / "run.yaml")]))
    return 0


def speculators_train(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from speculators_throughput import _unshare_loss_autotuners

    _unshare_loss_autotuners()
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve(argv))
    return 0


def process_tree(pid: int) -> set[int]:
    """pid and its descendants, from /proc (the trainers' data workers and spawned ranks hold GPU memory too)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo.extend(children.get(p, []))
    return tree


def nvidia_smi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True)
    return [[f.strip() for f in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def gpu_memory_gib(pids: set[int]) -> tuple[float, float]:
    """(GPU memory held by these processes (nvidia-smi's compute apps), memory in use on all GPUs), in GiB.
    The first is 0 where nvidia-smi reports pids of another namespace than ours."""
    mine = sum(float(mib) for pid, mib in nvidia_smi("--query-compute-apps=pid,used_memory") if int(pid) in pids)
    total = sum(float(mib) for (mib,) in nvidia_smi("--query-gpu=memory.used"))
    return mine / 1024, total / 1024


def measure(argv: list[str]) -> int:
    out, command = Path(argv[0]), argv[argv.index("--") + 1 :]
    base = gpu_memory_gib(set())[1]
    peak, done = [0.0, 0.0], threading.Event()
    t0 = time.perf_counter()
    child = subprocess.Popen(command)

    def poll():
        while not done.wait(0.25):
            mine, total = gpu_memory_gib(process_tree(child.pid))
            peak[:] = max(peak[0], mine), max(peak[1], total - base)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    rc = child.wait()
    wall = time.perf_counter() - t0
    done.set()
    thread.join()
    # peak_gib: this command's processes; gpu_peak_gib: the whole GPU over its memory at the start (the same
    # figure when the command runs alone)
    record = {"command": shlex.join(command), "rc": rc, "wall_s": round(wall, 1), "peak_gib": round(peak[0], 2),
              "gpu_peak_gib": round(peak[1], 2)}  # fmt: skip
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record), flush=True)
    return rc


COMMANDS = {"specforge-setup": specforge_setup, "speculators-train": speculators_train, "measure": measure}

if __name__ == "__main__":  # speculators' data workers start by spawning: nothing may run at import
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: peers.py {{{'|'.join(COMMANDS)}}} ...")
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
