"""The stage notebooks' Jupyter kernels: the manager papermill starts each with (local sockets in a private folder),
and the set of those this process started, which stop_on_signals (workbook/signals.py) interrupts."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

# papermill's default is 60 s; a kernel on a host loaded with trainings starts later than that
KERNEL_START_TIMEOUT_S = 600

KERNELS: weakref.WeakSet = weakref.WeakSet()  # the managers of the stage kernels this process started
# A socket's path ends at 107 bytes (AF_UNIX); the folder mkdtemp adds and the socket's name take 31 of them
SOCKET_BASE_MAX = 70


def stage_kernel_manager(env: dict[str, str] | None = None):
    """The stage kernels' manager: local sockets (over TCP, ipykernel warns on every start that its traffic is
    unencrypted, and our kernels never leave the machine), each kernel's in a private folder of its own; env is added
    to each kernel's environment (run_folder.holder_env: the run lock the pipeline holds for them). Each instance is
    known to stop_on_signals."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import CaselessStrEnum

    class IPCKernelManager(AsyncKernelManager):
        transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)
        socket_dir: str | None = None  # set with the first read of ip

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            KERNELS.add(self)

        async def _async_pre_start_kernel(self, **kw):
            kw["env"] = {**kw.get("env", os.environ), **(env or {})}
            return await super()._async_pre_start_kernel(**kw)

        def _ip_default(self):
            # jupyter_client's default is "kernel-ipc" in the working directory, the notebooks folder that papermill
            # enters, so every run of a checkout shares the paths kernel-ipc-1..5: two runs whose kernels started
            # together bound the same ones, one run's client spoke to the other's kernel (refused: "Invalid
            # Signature") and its stage failed at the start timeout
            if self.transport != "ipc":
                return super()._ip_default()
            base = tempfile.gettempdir()
            if len(base) > SOCKET_BASE_MAX and os.path.isdir("/tmp"):  # a cluster job's long TMPDIR
                base = "/tmp"
            self.socket_dir = tempfile.mkdtemp(prefix="eagle3-kernel-", dir=base)  # 0700: no other user connects
            return os.path.join(self.socket_dir, "kernel")

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart=restart)
            if not restart and self.socket_dir is not None:
                shutil.rmtree(self.socket_dir, ignore_errors=True)

        cleanup_resources = _async_cleanup_resources

    return IPCKernelManager
