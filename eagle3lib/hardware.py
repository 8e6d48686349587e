"""The compute dtype that is fast on the machine at hand, for params that say `dtype: auto`.

bf16 halves memory traffic, but a CPU without bf16 instructions (avx512_bf16 / amx_bf16 on x86, the bf16
feature on Arm) emulates its matmuls and runs them at about half the fp32 speed (docs/design.md §3). So auto
is bf16 on GPUs that support it and on CPUs with native bf16, fp32 elsewhere; where the flags cannot be read,
a short matmul timing decides.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path

NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 (avx512_bf16, amx_bf16), aarch64 (bf16)
# The shape of a SmolLM2 MLP matmul over a 512-token row: what training and extraction spend their time on.
PROBE_SHAPE = (512, 576, 1536)


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo ('flags' on x86, 'Features' on Arm); None where unreadable."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.is_file():
            return None
        cpuinfo = path.read_text(errors="replace")
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def machine(cpuinfo: str | None = None) -> dict:
    """What the run ran on, for its index: the CPU's model, its cores, whether it has native bf16 (None where its
    flags are unreadable), and the GPUs torch sees (name and memory), if any."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.is_file() else ""
    model = next(
        (line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.split(":")[0].strip() == "model name"),
        platform.processor() or platform.machine(),
    )
    flags = cpu_flags(cpuinfo) if cpuinfo else None
    info = {
        "cpu": model,
        "cores": os.cpu_count(),
        "native_bf16": None if flags is None else bool(flags & NATIVE_BF16_FLAGS),
    }
    import torch

    if torch.cuda.is_available():
        info["gpus"] = [
            f"{torch.cuda.get_device_name(i)}, {torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB"
            for i in range(torch.cuda.device_count())
        ]
    return info


def describe(info: dict) -> str:
    """machine()'s record in one line: 'CPU, N cores, native bf16[; GPU, ...]'."""
    if not info:
        return "not recorded"
    bf16 = {True: "native bf16", False: "no native bf16", None: "bf16 unknown"}[info.get("native_bf16")]
    gpus = info.get("gpus")
    return f"{info.get('cpu', '?')}, {info.get('cores', '?')} cores, {bf16}" + (f"; {', '.join(gpus)}" if gpus else "")


def matmul_gflops(dtype_name: str, shape=PROBE_SHAPE, seconds: float = 0.15) -> float:
    """GFLOP/s of a [m,k]x[k,n] matmul in the given dtype on the CPU, best of repeats within `seconds`."""
    import torch

    m, k, n = shape
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b  # warm-up: first-call dispatch and allocation
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


@functools.cache
def auto_dtype(device: str = "cpu") -> tuple[str, str]:
    """(dtype, why) for `dtype: auto` on `device`: 'bfloat16' or 'float32' and a sentence saying why."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", f"{torch.cuda.get_device_name()} supports bf16"
        return "float32", "this GPU has no bf16 support"
    flags = cpu_flags()
    if flags is not None:
        native = sorted(flags & NATIVE_BF16_FLAGS)
        if native:
            return "bfloat16", f"the CPU has native bf16 ({', '.join(native)})"
        if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
            return "float32", (
                f"the CPU has no native bf16 (no {'/'.join(sorted(NATIVE_BF16_FLAGS))} flag): bf16 would be emulated"
            )
    fp32, bf16 = matmul_gflops("float32"), matmul_gflops("bfloat16")
    pick = "bfloat16" if bf16 > fp32 else "float32"
    return (
        pick,
        f"CPU flags unreadable; a {'x'.join(map(str, PROBE_SHAPE))} matmul ran {fp32:.0f} GFLOP/s in fp32, {bf16:.0f} in bf16",
    )


def resolve(dtype: str | None, device: str = "cpu") -> str | None:
    """A params dtype with 'auto' replaced by this machine's pick; other values (and None) as they are."""
    return auto_dtype(device)[0] if dtype == "auto" else dtype
