"""dtype: auto picks the machine's fast dtype from its CPU flags (or a matmul timing), and says why."""

import pytest

from eagle3lib import hardware
from eagle3lib.params import load_params
from eagle3lib.workbook.stage import open_stage

XEON_WITH_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n"
XEON_WITHOUT = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_cpu_flags_read_x86_and_arm_cpuinfo():
    assert "avx512_bf16" in hardware.cpu_flags(XEON_WITH_BF16)
    assert "bf16" in hardware.cpu_flags(GRAVITON3)
    assert hardware.cpu_flags("processor\t: 0\n") is None


@pytest.mark.parametrize(
    ("cpuinfo", "picked"), [(XEON_WITH_BF16, "bfloat16"), (XEON_WITHOUT, "float32"), (GRAVITON3, "bfloat16")]
)
def test_auto_is_bf16_only_where_the_cpu_has_it_natively(monkeypatch, cpuinfo, picked):
    hardware.auto_dtype.cache_clear()
    read = hardware.cpu_flags
    monkeypatch.setattr(hardware, "cpu_flags", lambda: read(cpuinfo))
    try:
        dtype, why = hardware.auto_dtype("cpu")
    finally:
        hardware.auto_dtype.cache_clear()
    assert dtype == picked
    assert ("native bf16" in why) and (("no native" in why) == (picked == "float32"))


def test_unreadable_flags_fall_back_to_timing_both_dtypes(monkeypatch):
    hardware.auto_dtype.cache_clear()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: None)
    monkeypatch.setattr(hardware, "matmul_gflops", lambda d: {"float32": 60.0, "bfloat16": 30.0}[d])
    try:
        assert hardware.auto_dtype("cpu") == (
            "float32",
            "CPU flags unreadable; a 512x576x1536 matmul ran 60 GFLOP/s in fp32, 30 in bf16",
        )
    finally:
        hardware.auto_dtype.cache_clear()


def test_matmul_probe_measures_a_positive_rate():
    assert hardware.matmul_gflops("float32", shape=(64, 64, 64), seconds=0.01) > 0


def test_params_resolve_auto_before_anything_runs_and_stages_record_why(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text("target: {dtype: auto}\ntrain: {dtype: float32}\nbench: {dtype: auto}\n")
    p = load_params(f)
    picked, why = hardware.auto_dtype("cpu")
    assert (p.target.dtype, p.train.dtype, p.bench.dtype) == (picked, "float32", picked)
    assert p.dtype_choices == {k: {"auto": True, "picked": picked, "why": why} for k in ("target.dtype", "bench.dtype")}
    dumped = p.model_dump()  # what hashes and the run folder's params hold: what ran
    assert "auto" not in (dumped["target"]["dtype"], dumped["bench"]["dtype"]) and "dtype_choices" not in dumped
    stage = open_stage("00_prepare", f, tmp_path / "run")
    assert f"target.dtype: auto -> {picked}: {why}" in capsys.readouterr().out
    saved = stage.save({"n": 1}, {"tokens": 1})
    assert saved["headline"]["dtype (auto)"] == picked
    assert saved["figures"]["dtype_auto"] == {"target.dtype": p.dtype_choices["target.dtype"]}  # prepare reads no bench
    bench = open_stage("05_benchmark", f, tmp_path / "run").save({})
    assert set(bench["figures"]["dtype_auto"]) == {"target.dtype", "bench.dtype"}
