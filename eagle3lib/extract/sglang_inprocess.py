"""SGLang's model runner in this process (run in SGLang's interpreter): the Engine that 01_extract's
sglang_inprocess backend (extract/sglang_inprocess_extract.py) and online training (train/sources/online.py, EngineStates)
capture with, GPU hosts.

The server backend (extract/sglang.py) gets the states as JSON floats and prefills every token twice; this one
loads the target the way SGLang's own one-batch benchmark does (sglang.benchmark.one_batch: load_model, extend)
and reads both kinds of state from one forward:
- aux: the model captures the layers named by set_eagle3_layers_to_capture(ids), the call SGLang's EAGLE-3 target
  makes; ids = engines.sglang.sglang_config_ids(ours, architecture), the export's rule, and the layers the model
  then captures are read back and must be ours (HF hidden_states indices);
- final: the model hands its logits processor the final normed state of every token of an extend batch; a
  forward pre-hook on that module takes it, together with the aux states it is handed beside it.
The KV pools are cleared after each batch. Tensor parallel: one process a GPU; rank 0 runs the caller here and
ranks 1.. (spawned) run every batch rank 0 broadcasts on the TP group's CPU group.
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

from eagle3lib.drafter.aux_ids import sglang_config_ids
from eagle3lib.target.config import target_config_json

# Not needed for extend batches, and capturing decode graphs costs a minute at start-up.
DEFAULT_FLAGS = ["--disable-cuda-graph"]


class InProcessError(RuntimeError):
    """SGLang's model runner did not give the states the sglang_inprocess backend needs, or its extraction in
    SGLang's interpreter failed."""


# ------------------------------------------------------------------------------ CPU parts ----


def check_captured(captured, aux_layer_ids, architecture: str) -> None:
    """The layers SGLang's model captures after set_eagle3_layers_to_capture must be ours: its layers_to_capture
    holds i for 'the input of layer i' = HF hidden_states[i], our convention."""
    if [int(i) for i in captured] != [int(i) for i in aux_layer_ids]:
        raise InProcessError(
            f"SGLang's {architecture} captures layers {list(captured)} for config ids "
            f"{sglang_config_ids(aux_layer_ids, architecture)}, expected our aux ids {list(aux_layer_ids)}; the id rule "
            f"in engines/sglang.py does not hold for this SGLang release or architecture"
        )


def causal_lm(model):
    """The module that holds the decoder (`.model.layers_to_capture`) and the logits processor: the model itself, or
    a wrapper's `language_model` (Kimi-K2.5's KimiK25ForConditionalGeneration around DeepseekV3ForCausalLM)."""
    for m in (model, getattr(model, "language_model", None)):
        if m is not None and hasattr(m, "logits_processor") and hasattr(getattr(m, "model", None), "layers_to_capture"):
            return m
    raise InProcessError(
        f"{type(model).__name__} has no logits_processor beside a decoder with layers_to_capture (nor has its "
        f"language_model): SGLang's EAGLE-3 capture is not built for this architecture; use extract.backend: sglang"
    )


def logits_processor_states(forward, args, kwargs) -> tuple:
    """(final normed hidden_states [T, H], aux_hidden_states list) from the arguments a logits processor was
    called with, by its forward's parameter names (positional or keyword)."""
    bound = inspect.signature(forward).bind(*args, **kwargs)
    return bound.arguments.get("hidden_states"), bound.arguments.get("aux_hidden_states")


# ------------------------------------------------------------------------------ the runner ----


def server_args_from_flags(target_dir, dtype, flags):
    """sglang ServerArgs from launch_server's own flags (what --tp, --mem-fraction-static, --load-format... mean)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", str(target_dir)] + (["--dtype", dtype] if dtype else [])
    argv += [f for f in DEFAULT_FLAGS if f not in flags] + list(flags)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


class Runner:
    """SGLang's model runner of one TP rank, with the states captured from its logits processor."""

    def __init__(self, server_args, port_args, gpu_id: int, tp_rank: int, aux_layer_ids, architecture: str):
        from sglang.benchmark import one_batch
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config

        initialize_moe_config(server_args)  # as one_batch's latency_test does before load_model
        initialize_fp8_gemm_config(server_args)
        initialize_fp4_gemm_config(server_args)
        self.one_batch, self.tp_rank = one_batch, tp_rank
        bench, _ = one_batch.load_model(server_args, port_args, gpu_id, tp_rank)
        self.runner = bench.torch_runner
        self.tp_group = self.runner.tp_group
        self.runner.model.set_eagle3_layers_to_capture(sglang_config_ids(aux_layer_ids, architecture))
        self.model = causal_lm(self.runner.model)  # a wrapper delegates the call above to it
        check_captured(self.model.model.layers_to_capture, aux_layer_ids, architecture)
        self._capture_layers = list(self.model.model.layers_to_capture)
        self._seen = None
        processor = self.model.logits_processor
        self._hook = processor.register_forward_pre_hook(self._take, with_kwargs=True)
        self._forward = processor.forward

    def _take(self, module, args, kwargs):
        if self._seen is not None:
            final, aux = logits_processor_states(self._forward, args, kwargs)
            self._seen.update(final=final, aux=aux)

    def set_capture(self, on: bool) -> None:
        """Aux capture on (as configured) or off (a plain prefill)."""
        self.model.capture_aux_hidden_states = on
        self.model.model.layers_to_capture = list(self._capture_layers) if on else []

    @torch.no_grad()
    def extend(self, seqs: list[list[int]], capture: bool):
        """One prefill of these sequences; with capture, (aux [T, k*H], final [T, H]) on the GPU in token order."""
        reqs = self.one_batch.prepare_synthetic_inputs_for_latency_test(len(seqs), 0, custom_inputs=seqs)
        self.set_capture(capture)
        self._seen = {} if capture else None
        try:
            self.one_batch.extend(reqs, self.runner)
            if not capture:
                return None
            final, aux = self._seen.get("final"), self._seen.get("aux")
        finally:
            self._seen = None
            self.runner.req_to_token_pool.clear()
            self.runner.token_to_kv_pool_allocator.clear()
        n = sum(len(s) for s in seqs)
        if final is None or not aux or final.shape[0] != n or any(a.shape[0] != n for a in aux):
            raise InProcessError(
                f"the logits processor was handed final {None if final is None else tuple(final.shape)} and "
                f"{len(aux or [])} aux states for a batch of {n} tokens; expected [{n}, H] and one [{n}, H] per "
                f"aux layer (an SGLang release whose model forward differs from 0.5.17's?)"
            )
        return torch.cat(aux, dim=-1), final

    def broadcast(self, message):
        """Rank 0: send a message to the other ranks; others: receive it."""
        return self.tp_group.broadcast_object(message, src=0)

    def close(self):
        self._hook.remove()


def _follow(server_args, port_args, gpu_id, tp_rank, aux_layer_ids, architecture):
    """Ranks 1..: run every batch rank 0 runs, until it says stop."""
    runner = Runner(server_args, port_args, gpu_id, tp_rank, aux_layer_ids, architecture)
    while True:
        message = runner.broadcast(None)
        if message is None:
            return
        runner.extend(message["seqs"], message["capture"])


class Engine:
    """Rank 0 here, ranks 1.. spawned; extend() runs a batch on all of them."""

    def __init__(self, target_dir, aux_layer_ids, dtype=None, flags=()):
        import multiprocessing

        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.server_args import PortArgs

        _, self.architecture = target_config_json(target_dir)
        self.server_args = server_args_from_flags(target_dir, dtype, list(flags))
        _set_envs_and_config(self.server_args)
        port_args = PortArgs.init_new(self.server_args)
        t0 = time.perf_counter()
        ctx = multiprocessing.get_context("spawn")
        args = (self.server_args, port_args)
        self.followers = [
            ctx.Process(target=_follow, args=(*args, r, r, aux_layer_ids, self.architecture), daemon=True)
            for r in range(1, self.server_args.tp_size)
        ]
        for p in self.followers:
            p.start()
        self.runner = Runner(*args, 0, 0, aux_layer_ids, self.architecture)
        self.start_s = time.perf_counter() - t0

    def extend(self, seqs, capture: bool):
        if self.followers:
            self.runner.broadcast({"seqs": seqs, "capture": capture})
        return self.runner.extend(seqs, capture)

    def close(self):
        if self.followers:
            self.runner.broadcast(None)
            for p in self.followers:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def split_states(aux, final, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A ragged batch's states [T, .] (on the GPU, in token order) as (aux [n, k*H], final [n, H]) on the host per
    sequence of these lengths: one copy of each, then views."""
    aux, final = aux.to("cpu", copy=True), final.to("cpu", copy=True)
    return list(zip(aux.split(lengths), final.split(lengths), strict=True))


class EngineStates:
    """Online training's StateSource (train/sources/online.py) over an Engine: one extend() of consecutive sequences, packed
    without padding, their states handed to the trainer on the host (as the hf source hands them)."""

    name = "sglang_inprocess"
    ragged = True

    def __init__(self, engine: Engine, batch_tokens: int):
        self.engine, self.batch_tokens = engine, int(batch_tokens)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def capture(self, sequences: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.device is not None:  # the current GPU is per thread: the capture thread's is not set
            torch.cuda.set_device(self.device)
        aux, final = self.engine.extend([s.tolist() for s in sequences], capture=True)
        return split_states(aux, final, [len(s) for s in sequences])

    def close(self) -> None:
        self.engine.close()
