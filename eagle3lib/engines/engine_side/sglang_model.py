"""SGLang's draft model as its server builds it, in SGLang's interpreter (sglang_replay.py's load and meta-load):
the server args published, a process group of one, the model built on the CPU or the meta device, and its
weight loaders watched. Standalone (stdlib, torch and SGLang only)."""

import os
import sys
import tempfile
import traceback
from contextlib import contextmanager
from types import ModuleType


def sglang_setup(export_dir, dtype):
    """Server args published, process group of one (gloo), and SGLang's ModelConfig of the draft."""
    import torch  # noqa: F401  (torch before sglang, as the server imports them)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=export_dir, device="cpu", dtype=dtype, skip_tokenizer_init=True)
    publish(server_args, role="scheduler")  # the process that builds and loads models in a server
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        backend="gloo",
        distributed_init_method=f"file://{tempfile.mktemp(prefix='sglang-replay-')}",
    )
    ensure_model_parallel_initialized(1, 1, 1)
    return ModelConfig.from_server_args(server_args, model_path=export_dir, is_draft_model=True)


def construct(model_config, load_config, device="cpu"):
    """(model, how, note): SGLang's _initialize_model on the CPU (or meta), as installed, else with the one kernel
    import that a CPU-only install lacks stubbed (see the module docstring)."""
    import torch
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    def build():
        with set_default_torch_dtype(model_config.dtype), torch.device(device), plain_rope_on_cpu():
            return _initialize_model(model_config, load_config)

    try:
        return build(), "real model on cpu", None
    except ModuleNotFoundError as e:
        if e.name not in ("vllm", "vllm._custom_ops"):
            raise
        where = traceback.extract_tb(e.__traceback__)[-1]
        note = (
            f"SGLang's constructor as installed raised {type(e).__name__}: {e} at "
            f"{'/'.join(where.filename.split(os.sep)[-3:])}:{where.lineno} `{where.line}`: on a host that is "
            "neither CUDA nor SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, which needs sgl_kernel's CPU build, "
            "absent here) RotaryEmbedding.__init__ binds vllm._custom_ops.rotary_embedding as its forward "
            "kernel. Built again with that one function stubbed (it would raise if called; loading never calls it)."
        )

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("sglang_replay: stub of vllm._custom_ops.rotary_embedding (forward is not replayed)")

    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm._custom_ops")}
    ops = ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    pkg = ModuleType("vllm")
    pkg._custom_ops = ops
    sys.modules.update({"vllm": pkg, "vllm._custom_ops": ops})
    try:
        model = build()
    finally:  # no other SGLang code may take the stub for an installed vLLM
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return model, "real model on cpu, vllm._custom_ops.rotary_embedding stubbed", note


@contextmanager
def plain_rope_on_cpu():
    """SGLang's CPU rope for DeepSeek's attention (rotary_embedding/factory.py get_rope_cpu) asserts a DeepSeek-YaRN
    rope_scaling, so an MLA draft with a plain rope cannot be built with device cpu; such a rope has no weights, so
    it is built by the factory's get_rope (what a GPU server builds) and the loading replayed is SGLang's own."""
    from sglang.srt.layers.rotary_embedding import factory

    cpu_rope = factory.get_rope_cpu

    def rope(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None, *args, **kwargs):
        if rope_scaling is None:
            kwargs.pop("device", None)
            return factory.get_rope(head_size, rotary_dim, max_position, base, is_neox_style, None, *args[:2])
        return cpu_rope(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, *args, **kwargs)

    factory.get_rope_cpu = rope
    try:
        yield
    finally:
        factory.get_rope_cpu = cpu_rope


def record_weight_loaders(params: dict, calls: list, current: dict, default=None) -> None:
    """Wrap each parameter's weight_loader (its own bound method, else `default`; none: left alone) so that every
    call appends (current["name"], the parameter's name, the shard id SGLang hands it) to calls."""
    for n, p in params.items():
        loader = p.__dict__.get("weight_loader", default)
        if loader is None:
            continue

        def record(param, loaded_weight, *args, _n=n, _loader=loader, **kwargs):
            shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
            calls.append((current["name"], _n, shard))
            return _loader(param, loaded_weight, *args, **kwargs)

        p.weight_loader = record
