"""Byte-exact on every x86 kernel path memkit models, and honest (a flagged lower bound) on the others.

Each oneDNN ISA this CPU supports is forced with ``ONEDNN_MAX_CPU_ISA`` in its own subprocess
(``_cpu_path_probe.py``), which tracks and profiles flash attention and AdamW training steps in fp32, bf16
and fp16. A value the CPU lacks is skipped, naming the missing flags: CI machines differ from run to run.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
import torch

import memkit
from memkit.memory import track
from memkit.memory.workspace import cpu_path as cp

PROBE = Path(__file__).with_name("_cpu_path_probe.py")
ALL_PRESETS = ",".join(sorted(memkit.PRESETS))
# (id, environment, presets trained): every preset on the modelled AVX2 path and on the CPU's own path;
# attention (and one preset) on the paths between, to keep the file fast.
RUNS = {
    "AVX2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, ALL_PRESETS),
    "no-limit": ({}, "flux,wan"),
    "AVX512_CORE": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, ""),
    "AVX512_CORE_BF16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "flux"),
    "AVX512_CORE_FP16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16"}, ""),
    "AVX512_CORE_AMX": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, ""),
    "aten-default+AVX2": ({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "default"}, ""),
}


def _missing(run: str) -> list[str]:
    isa = RUNS[run][0].get("ONEDNN_MAX_CPU_ISA")
    if not cp.cpu_path().x86:
        return ["x86"]
    return cp.missing_flags(isa) if isa else []


def _probe(run: str) -> dict:
    env, presets = RUNS[run]
    env = {**os.environ, **env, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(PROBE), presets], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@cache
def _results() -> dict[str, dict]:
    runnable = [r for r in RUNS if not _missing(r)]
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(runnable, pool.map(_probe, runnable), strict=True))


@pytest.mark.parametrize("run", list(RUNS))
def test_tracker_equals_profiler_on_each_kernel_path(run):
    if missing := _missing(run):
        pytest.skip(f"{run}: this CPU lacks {', '.join(missing)}")
    results = dict(_results()[run])
    path = results.pop("_path")
    for case, (tracked, profiled, tracked_end, profiled_end, lower_bound) in results.items():
        where = f"{run} {case} ({path})"
        assert tracked_end == profiled_end, where
        if lower_bound:
            assert set(lower_bound) <= {f"aten.{op}" for op in cp.MATMUL_OPS | cp.ATTENTION_OPS}, where
            assert tracked <= profiled, where
        else:
            assert tracked == profiled, f"{where}: tracked {tracked} != profiler {profiled}"
    if run.endswith("AVX2"):  # the modelled path: every case exact, nothing flagged
        assert not any(r[4] for r in results.values()), run


def _path(**kw) -> cp.CpuPath:
    return cp.CpuPath(**{"x86": True, "aten_capability": "AVX2", "onednn_isa": "AVX2", "amx": False, **kw})


def _tracked_ops(dtype):
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    w = torch.randn(8, 8, dtype=dtype)
    with track(inputs=[q, k, v, w]) as tl:
        (torch.nn.functional.scaled_dot_product_attention(q, k, v) @ w).sum().backward()
    return tl.meta["lower_bound_ops"]


def test_lower_bound_ops_are_flagged_on_an_unmodelled_path(monkeypatch):
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(x86=False, aten_capability="SVE256", onednn_isa="NONE"))
    flagged = _tracked_ops(torch.bfloat16)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in flagged
    assert "aten.mm" in flagged or "aten.bmm" in flagged
    assert flagged == sorted(flagged)
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(onednn_isa="AVX512_CORE_BF16"))
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in _tracked_ops(torch.bfloat16)
    assert _tracked_ops(torch.float16) == []  # fp16 takes the modelled path below AVX512_CORE_FP16


def test_lower_bound_ops_empty_on_a_modelled_path(monkeypatch):
    monkeypatch.setattr(cp, "cpu_path", _path)
    assert _tracked_ops(torch.bfloat16) == []
    assert _tracked_ops(torch.float16) == []
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(onednn_isa="AVX512_CORE_AMX", amx=True))
    assert _tracked_ops(torch.float32) == []
