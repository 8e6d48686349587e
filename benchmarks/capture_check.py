"""GPU checks of the SGLang extraction backends against hf on the same tokens: the per-layer differences, the layer
probe (which shows any off-by-one in the aux ids), and the capture rate against the same engine's plain prefill.
Each writes OUT/compare.json, prints it and exits 0 when the backend agrees with hf.

    .venv/bin/python -m benchmarks.capture_check save-tokens FILE --n 64      # here: the checks' token file
    python -m benchmarks.capture_check sglang --target DIR --tokens FILE --n 24 --engine-python python3 \\
        --extra-args "--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.3"
    python -m benchmarks.capture_check inprocess --target DIR --tokens FILE [--no-reference] [-- SGLANG FLAGS]

sglang: the server backend (extract/sglang.py) through its two servers, then hf in this process.
inprocess: SGLang's model runner in this process (extract/sglang_inprocess.py: run it in SGLang's interpreter), then
hf unless --no-reference (a target too big for one GPU). benchmarks/questions/capture.sh measures their rates on a GPU
host; tests/gpu/test_extraction_backends.py checks their agreement.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3lib import target  # noqa: E402
from eagle3lib.extract import compare, hf, shards  # noqa: E402
from eagle3lib.prepare import conversations  # noqa: E402

# Of a backend's extract_with result, what a report keeps (with capture_over_plain_prefill).
KEEP = ("tokens_per_s", "seconds", "engine_start_s", "plain_prefill_tokens_per_s", "bytes_per_token")
SGLANG_KEEP = KEEP + ("final_pass_tokens_per_s", "aux_pass_tokens_per_s", "wire_bytes_per_token", "captured_hf_layers")
INPROCESS_KEEP = KEEP + ("shards", "capture_s", "write_wait_s")


# ------------------------------------------------------------------------------ shared ----


def first_sequences(tokens: dict, n: int) -> dict:
    """The first n sequences of token arrays (data.save_tokens format), their ids with them."""
    n = min(n, tokens["seq_starts"].numel() - 1)
    end = int(tokens["seq_starts"][n])
    return {
        "input_ids": tokens["input_ids"][:end],
        "loss_mask": tokens["loss_mask"][:end],
        "seq_starts": tokens["seq_starts"][: n + 1],
        "ids": list(tokens.get("ids", range(n)))[:n],
    }


def sizes(tokens: dict) -> dict:
    return {"sequences": int(tokens["seq_starts"].numel() - 1), "tokens": int(tokens["input_ids"].numel())}


def check_tokens(a, tokenizer) -> dict:
    """The check's token arrays: --n sequences of --tokens FILE, else --n conversations of --data tokenized here."""
    from eagle3lib.prepare import sources

    if a.tokens:
        return first_sequences(conversations.load_tokens(a.tokens), a.n)
    convs, _ = sources.load_conversations(a.data, limit=a.n)
    return conversations.tokenize_split(tokenizer, convs, a.max_seq_len, progress=False)


def fresh(out: Path, *subs: str) -> None:
    """A check measures afresh: no resume from an earlier run's shards in these folders of out (all of out when
    none is named)."""
    for folder in [out / sub for sub in subs] or [out]:
        shutil.rmtree(folder, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def capture_figures(result: dict, keep: tuple) -> dict:
    """The kept figures of an extraction, and its capture rate over the same engine's plain prefill."""
    figures = {k: result.get(k) for k in keep}
    plain = result.get("plain_prefill_tokens_per_s")
    figures["capture_over_plain_prefill"] = (
        result["tokens_per_s"] / plain if plain and result.get("tokens_per_s") else None
    )
    return figures


def against_hf(report: dict, model, out: Path, name: str, aux_ids) -> None:
    """out/<name>'s shards against out/hf's: per layer (with the target's lm_head), and the layer probe."""
    head = model.lm_head.weight.detach()
    report["agreement"] = compare.compare_shard_sets(str(out / name), str(out / "hf"), lm_head=head)
    report["layer_probe"] = compare.layer_probe(model, str(out / name), aux_ids, max_sequences=8)


def agrees(report: dict) -> bool:
    return bool(report["agreement"]["ok"] and report["layer_probe"]["ok"])


def finish(report: dict, out: Path) -> int:
    """Write out/compare.json, print it; the exit status says whether the backend agrees."""
    text = json.dumps(report, indent=1, default=str)
    (out / "compare.json").write_text(text + "\n")
    print(text, flush=True)
    return 0 if report["ok"] else 1


# ------------------------------------------------------------------------------ commands ----


def save_tokens_main(a) -> int:
    """Tokenize --n conversations of --data here (no GPU, no SGLang) for a GPU host without the data package."""
    from transformers import AutoTokenizer

    cache = Path(a.cache_dir) if a.cache_dir else target.default_cache_dir()
    tokenizer = AutoTokenizer.from_pretrained(target.resolve_target(a.target, cache))
    a.tokens = None
    path = conversations.save_tokens(a.file, check_tokens(a, tokenizer))
    print(json.dumps({"tokens_file": str(path)}))
    return 0


def random_target_main(a) -> int:
    """A random-weight Llama of the embedded target's config (--layers of them), saved with its tokenizer's files:
    the checks' target on a host without SmolLM2's weights (formats, row counts and layer ids, not values)."""
    import shutil

    import torch
    import transformers

    source = target.embedded_target_dir(target.default_cache_dir())
    cfg = json.loads((source / "config.json").read_text())
    cfg["num_hidden_layers"] = a.layers or cfg["num_hidden_layers"]
    keep = {
        k: v
        for k, v in cfg.items()
        if k not in ("architectures", "transformers_version", "_model_name_or_path", "dtype")
    }
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**keep)).to(torch.bfloat16)
    model.save_pretrained(a.dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, Path(a.dir) / name)
    print(json.dumps({"target": str(a.dir), "layers": cfg["num_hidden_layers"]}))
    return 0


def sglang_main(a) -> int:
    """The sglang backend and hf extract the same tokens; their shards compared."""
    from eagle3lib.extract.sglang import SGLangCapture

    cache = Path(a.cache_dir) if a.cache_dir else target.default_cache_dir()
    target_dir = target.resolve_target(a.target, cache)
    model, tokenizer = target.load_target(target_dir, cache, dtype=a.dtype, device=a.device)
    aux_ids = target.aux_layer_ids(a.aux_layer_ids, target.num_layers(model.config))
    tokens = check_tokens(a, tokenizer)
    out = Path(a.out)
    fresh(out, "sglang", "hf")
    contract = target.make_contract(a.target, model, tokenizer, aux_ids, a.dtype)
    report = {"target": a.target, "dtype": a.dtype, "aux_layer_ids": aux_ids}
    report |= sizes(tokens)
    cap = SGLangCapture(
        target_dir,
        aux_ids,
        batch_tokens=a.batch_tokens,
        dtype=a.dtype,
        python=a.engine_python,
        extra_args=shlex.split(a.extra_args),
        log_dir=out,
        concurrency=a.concurrency,
    )
    store = target.torch_dtype(a.dtype)
    kw = dict(batch_tokens=a.batch_tokens, shard_max_tokens=a.shard_max_tokens, store_dtype=store, progress=False)
    layout = shards.ShardLayout(store, a.shard_max_tokens, a.batch_tokens)
    r_sg = shards.extract_with(cap, tokens, aux_ids, str(out / "sglang"), contract, layout, progress=False)
    # The plain forward first: its warm-up also warms the capture (CUDA context, kernels), which a cold
    # capture of a few batches would otherwise pay alone.
    hf_prefill = hf.measure_forward_tokens_per_s(
        model, list(hf.iter_batches(tokens, a.batch_tokens, a.shard_max_tokens))[:5]
    )
    r_hf = hf.extract(model, tokens, aux_ids, str(out / "hf"), contract, **kw)
    against_hf(report, model, out, "sglang", aux_ids)
    report["sglang"] = capture_figures(r_sg, SGLANG_KEEP)
    report["hf"] = {
        "tokens_per_s": r_hf["tokens_per_s"],
        "forward_tokens_per_s": hf_prefill,
        "capture_over_forward": r_hf["tokens_per_s"] / hf_prefill if hf_prefill else None,
        "bytes_per_token": r_hf["bytes_per_token"],
    }
    report["ok"] = agrees(report)
    return finish(report, out)


def inprocess_main(a, flags: list[str]) -> int:
    """The sglang_inprocess capture of the tokens, then hf on the same tokens unless --no-reference."""
    from eagle3lib.extract.sglang_inprocess import Engine
    from eagle3lib.extract.sglang_inprocess_extract import InProcessCapture

    text, arch = target.target_config_json(a.target)
    aux_ids = a.aux_layer_ids or target.aux_layer_ids(None, int(text["num_hidden_layers"]))
    tokens = first_sequences(conversations.load_tokens(a.tokens), a.n)
    out = Path(a.out)
    fresh(out)
    contract = {"target": a.target, "aux_layer_ids": aux_ids, "hidden_size": int(text["hidden_size"])}
    store = target.torch_dtype(a.store_dtype)
    kw = dict(batch_tokens=a.batch_tokens, shard_max_tokens=a.shard_max_tokens, store_dtype=store, progress=False)
    layout = shards.ShardLayout(store, a.shard_max_tokens, a.batch_tokens)
    report = {"target": a.target, "architecture": arch, "aux_layer_ids": aux_ids}
    report |= sizes(tokens) | {"writers": a.writers}
    with Engine(a.target, aux_ids, a.dtype, flags) as engine:
        report["tp"] = engine.server_args.tp_size
        cap = InProcessCapture.for_target(engine, a.target, aux_ids, a.store_dtype, a.batch_tokens, a.plain_batches)
        r = shards.extract_with(
            cap, tokens, aux_ids, str(out / "inprocess"), contract, layout, progress=False, writers=a.writers
        )
    report["inprocess"] = capture_figures(r, INPROCESS_KEEP)
    report["ok"] = True
    if not a.no_reference:
        model, _ = target.load_target(a.target, out, dtype=a.dtype or "bfloat16", device="cuda")
        hf.extract(model, tokens, aux_ids, str(out / "hf"), contract, **kw)
        against_hf(report, model, out, "inprocess", aux_ids)
        report["ok"] = agrees(report)
    return finish(report, out)


# ------------------------------------------------------------------------------ arguments ----


def ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save-tokens", help="tokenize --n conversations of --data into FILE (here, no GPU)")
    save.add_argument("file")
    rt = sub.add_parser("random-target", help="a random-weight Llama of the embedded target's config, into DIR")
    rt.add_argument("dir")
    rt.add_argument("--layers", type=int, default=None, help="default: the target's")
    sg = sub.add_parser("sglang", help="the sglang server backend against hf")
    for p in (save, sg):
        p.add_argument("--n", type=int, default=64, help="conversations")
        p.add_argument("--target", default="embedded:smollm2-135m-instruct")
        p.add_argument("--data", default="embedded:sharegpt")
        p.add_argument("--cache-dir", default=None)
        p.add_argument("--max-seq-len", type=int, default=2048)
    sg.add_argument("--tokens", default=None, help="token arrays (save-tokens' file) instead of --data")
    sg.add_argument("--out", default="/tmp/eagle3-sglang-check")
    sg.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    sg.add_argument("--device", default="cuda", help="device of the hf reference")
    sg.add_argument("--shard-max-tokens", type=int, default=32768)
    sg.add_argument("--concurrency", type=int, default=4)
    sg.add_argument(
        "--engine-python", default=None, help="interpreter with sglang (default: .venv-sglang, else this one)"
    )
    sg.add_argument("--extra-args", default="", help="more sglang launch flags, one string")
    ip = sub.add_parser("inprocess", help="the sglang_inprocess backend (in SGLang's interpreter) against hf")
    ip.add_argument("--target", required=True)
    ip.add_argument("--tokens", required=True, help="token arrays (save-tokens' file)")
    ip.add_argument("--out", default="/tmp/eagle3-inprocess-check")
    ip.add_argument("--n", type=int, default=10**9, help="at most this many sequences")
    ip.add_argument("--store-dtype", default="bfloat16")
    ip.add_argument("--dtype", default=None, help="SGLang's --dtype")
    ip.add_argument("--shard-max-tokens", type=int, default=None, help="default: about 1 GiB a shard")
    ip.add_argument("--plain-batches", type=int, default=4)
    ip.add_argument("--writers", type=int, default=2, help="shards written at once (threads)")
    ip.add_argument("--no-reference", action="store_true", help="skip hf (a target too big for one GPU)")
    for p in (sg, ip):
        p.add_argument("--aux-layer-ids", type=ids, default=None)
        p.add_argument("--batch-tokens", type=int, default=16384)
    return ap


def main(argv=None) -> int:
    argv, flags = list(sys.argv[1:] if argv is None else argv), []
    if "--" in argv:  # inprocess: SGLang's launch flags follow
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1 :]
    ap = parser()
    a = ap.parse_args(argv)
    if flags and a.command != "inprocess":
        ap.error(f"{a.command} takes no SGLang flags after -- (the sglang check: --extra-args)")
    if a.command == "save-tokens":
        return save_tokens_main(a)
    if a.command == "random-target":
        return random_target_main(a)
    if a.command == "sglang":
        return sglang_main(a)
    return inprocess_main(a, flags)


if __name__ == "__main__":
    sys.exit(main())
