"""Byte-exact on every x86 kernel path, and honest (a flagged lower bound) where a buffer can be neither
modelled nor learned.

Each oneDNN ISA this CPU supports is forced with ``ONEDNN_MAX_CPU_ISA`` in its own subprocess
(``_cpu_path_probe.py``), which tracks and profiles flash attention and AdamW training steps in fp32, bf16
and fp16. A value the CPU lacks is skipped, naming the missing flags: CI machines differ from run to run.
Paths with formulas (``workspace/attention.py``) and paths whose buffers are learned from the allocator
(``workspace/learned.py``) must both be exact; with learning switched off, the unmodelled ones are flagged.
"""

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import CORE_PRESETS
from oracles import assert_equals_profiler, tracked_and_profiled

from memkit.memory import track, workspace
from memkit.memory.workspace import cpu_path as cp
from memkit.memory.workspace import learned

pytestmark = pytest.mark.slow  # one subprocess per CPU path, every preset trained on two of them (minutes)

PROBE = Path(__file__).with_name("_cpu_path_probe.py")
ALL_PRESETS = ",".join(sorted(CORE_PRESETS))  # one preset per code path: a subprocess per CPU path runs them all
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
    "no-limit, learning off": ({"MEMKIT_LEARN_WORKSPACE": "0"}, "flux"),
}
LEARNABLE = {f"aten.{op}" for op in cp.MATMUL_OPS | cp.ATTENTION_OPS | workspace.LEARNED_OPS}


def _missing(run: str) -> list[str]:
    isa = RUNS[run][0].get("ONEDNN_MAX_CPU_ISA")
    if not cp.cpu_path().x86:
        return ["x86"]
    return cp.missing_flags(isa) if isa else []


@cache  # per run: under xdist each worker runs only the subprocesses of the cases it was given
def _probe(run: str) -> dict:
    env, presets = RUNS[run]
    env = {**os.environ, **env, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(PROBE), presets], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    # CI time: "no-limit, learning off" (13-15 s, the learned workspaces switched off) in make test-extended
    "run",
    [pytest.param(r, marks=pytest.mark.extended) if r == "no-limit, learning off" else r for r in RUNS],
)
def test_tracker_equals_profiler_on_each_kernel_path(run):
    if missing := _missing(run):
        pytest.skip(f"{run}: this CPU lacks {', '.join(missing)}")
    if run == "no-limit" and cp.cpu_path() == _path():
        pytest.skip("no-limit: this CPU's own path is AVX2 (ATen and oneDNN), the AVX2 run's")
    results = dict(_probe(run))
    path = results.pop("_path")
    bf16_modelled = results.pop("_bf16_modelled")
    learning = "learning off" not in run
    for case, (tracked, profiled, tracked_end, profiled_end, lower_bound) in results.items():
        where = f"{run} {case} ({path})"
        assert tracked_end == profiled_end, where
        if learning:  # modelled or learned: every case exact, nothing flagged
            assert lower_bound == [], where
            assert tracked == profiled, f"{where}: tracked {tracked} != profiler {profiled}"
        elif lower_bound:
            assert set(lower_bound) <= LEARNABLE, where
            assert tracked <= profiled, where
        else:
            assert tracked == profiled, f"{where}: tracked {tracked} != profiler {profiled}"
        if not learning and "bfloat16" in case and not bf16_modelled:
            assert lower_bound, f"{where}: an unmodelled bf16 path must be flagged when learning is off"


def _path(**kw) -> cp.CpuPath:
    return cp.CpuPath(**{"x86": True, "aten_capability": "AVX2", "onednn_isa": "AVX2", "amx": False, **kw})


def _tracked_ops(dtype):
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    w = torch.randn(8, 8, dtype=dtype)
    with track(inputs=[q, k, v, w]) as tl:
        (torch.nn.functional.scaled_dot_product_attention(q, k, v) @ w).sum().backward()
    return tl.meta["lower_bound_ops"]


def _exact_small_step(dtype):
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    w = torch.randn(8, 8, dtype=dtype, requires_grad=True)
    x = torch.randn(1, 4, 12, 12, dtype=dtype, requires_grad=True)
    c = torch.randn(4, 4, 3, 3, dtype=dtype, requires_grad=True)

    def step():
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v) @ w
        (y.sum() + torch.nn.functional.conv2d(x, c, padding=1).sum()).backward()

    tl, (peak, end) = tracked_and_profiled(step, inputs=[q, k, v, w, x, c])
    assert_equals_profiler(tl, peak, end)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_learned_buffers_are_exact_where_no_formula_applies(monkeypatch, dtype):
    # A non-x86 path models no matmul or attention kernel: every one of them is learned from the allocator.
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(x86=False, aten_capability="SVE256", onednn_isa="NONE"))
    before = learned.cache_info()["learned"]
    _exact_small_step(dtype)
    assert learned.cache_info()["learned"] > before


def test_formula_paths_need_no_learning(monkeypatch):
    monkeypatch.setattr(cp, "cpu_path", _path)
    q = torch.randn(1, 2, 40, 8, dtype=torch.bfloat16)
    called = []
    monkeypatch.setattr(learned, "learned_bytes", lambda *a: called.append(a) or 0)
    with track(inputs=[q]):
        torch.nn.functional.scaled_dot_product_attention(q, q, q) @ torch.ones(8, 8, dtype=torch.bfloat16)
    assert called == []  # the AVX2 path has formulas for attention and no matmul buffers


def test_lower_bound_ops_are_flagged_when_learning_is_off(monkeypatch):
    monkeypatch.setenv("MEMKIT_LEARN_WORKSPACE", "0")
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(x86=False, aten_capability="SVE256", onednn_isa="NONE"))
    flagged = _tracked_ops(torch.bfloat16)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in flagged
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in flagged
    assert "aten.mm" in flagged or "aten.bmm" in flagged
    assert flagged == sorted(flagged)
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(onednn_isa="AVX512_CORE_BF16"))
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in _tracked_ops(torch.bfloat16)
    assert _tracked_ops(torch.float16) == []  # fp16 takes the modelled path below AVX512_CORE_FP16
    monkeypatch.setattr(cp, "cpu_path", _path)
    assert _tracked_ops(torch.bfloat16) == []
    assert _tracked_ops(torch.float16) == []
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    with track(inputs=[x]) as tl:
        torch.nn.functional.conv2d(x, torch.randn(2, 2, 3, 3)).sum().backward()
    assert tl.meta["lower_bound_ops"] == ["aten.convolution", "aten.convolution_backward"]


def test_a_failed_worker_flags_lower_bounds_and_warns(monkeypatch):
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(x86=False, aten_capability="SVE256", onednn_isa="NONE"))
    monkeypatch.setattr(learned, "_cache", {})
    monkeypatch.setattr(learned, "_worker", None)
    monkeypatch.setattr(learned, "_broken", None)
    monkeypatch.setattr(learned.sys, "executable", "/bin/false")
    with pytest.warns(UserWarning, match="workspace worker failed"):
        flagged = _tracked_ops(torch.bfloat16)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in flagged
    assert learned.cache_info()["failed"] > 0


def test_tensors_over_the_limit_are_flagged_not_learned(monkeypatch):
    monkeypatch.setenv("MEMKIT_LEARN_MAX_BYTES", "64")
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(x86=False, aten_capability="SVE256", onednn_isa="NONE"))
    assert "aten.mm" in _tracked_ops(torch.float32) or "aten.bmm" in _tracked_ops(torch.float32)
