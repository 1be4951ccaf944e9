"""Kernel-internal buffers (``memkit/memory/workspace/``) in a few seconds: the flash-attention formulas against the
profiler at small fp32 shapes (the modelled path on every x86 CPU), the wrapped Python numbers, which CPU path
is modelled for synthetic flag sets, and the learned buffers (signatures, the cache, the environment variables,
a failed worker) with a stand-in worker, plus the real worker's ``measure`` and ``main`` run in-process.

Fast enough to run against every mutant (``python -m bench.mutation workspace``). Expected values come from the
profiler, from tensor sizes or from torch itself, never from a previous run's output.
"""

import hashlib
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from oracles import assert_equals_profiler, profiler_window, tracked_and_profiled
from torch.profiler import ProfilerActivity, profile

from memkit.memory import track, workspace
from memkit.memory.workspace import _learn_worker as worker
from memkit.memory.workspace import attention, learned
from memkit.memory.workspace import cpu_path as cp
from memkit.memory.workspace.scalars import _wrapped_scalars, reused_bytes, saved_scalars_fn

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SDPA = torch.nn.functional.scaled_dot_product_attention
ALL_FLAGS = frozenset(f for need in cp.ONEDNN_ISAS.values() for f in need) | {"sse4_1"}


# The profiler's first session in a process costs seconds: paid once here, at import (mutation testing forks each
# mutant's test run from a process that imported this file).
with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
    torch.ones(1)


def _path(**kw) -> cp.CpuPath:
    return cp.CpuPath(**{"x86": True, "aten_capability": "AVX2", "onednn_isa": "AVX2", "amx": False, **kw})


NOT_X86 = _path(x86=False, aten_capability="SVE256", onednn_isa="NONE")


@pytest.fixture
def fresh_learned(monkeypatch):
    """learned.py with an empty cache and no worker, restored afterwards."""
    monkeypatch.setattr(learned, "_cache", {})
    monkeypatch.setattr(learned, "_worker", None)
    monkeypatch.setattr(learned, "_broken", None)
    yield
    learned._stop()


# ---- attention.py against the profiler ---------------------------------------------------------------------------


def _attention_step(q_shape, kv_len=None, dtype=torch.float32, *, contiguous_grad=False):
    b, h, q_len, d = q_shape
    q = torch.randn(b, h, q_len, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, h, kv_len or q_len, d, dtype=dtype, requires_grad=True) for _ in range(2))
    w = torch.randn(b, q_len, h, d, dtype=dtype)

    def step():
        out = SDPA(q, k, v)
        if contiguous_grad:  # the gradient reaches the kernel in (batch, q_len, heads, head_dim) layout already
            (out.transpose(1, 2) * w).sum().backward()
        else:  # sum()'s expanded gradient: the kernel makes a contiguous copy
            out.sum().backward()

    return step, [q, k, v, w]


@pytest.mark.parametrize(
    "q_shape, kv_len, threads",
    [
        ((1, 2, 40, 8), None, 1),  # q split 32 (q_len < 192)
        ((1, 1, 40, 8), 100, 2),  # cross-attention: the kv split follows k, per-thread buffers
        ((1, 1, 192, 4), 600, 1),  # q split 64 from 192; kv split at most 512
        ((1, 1, 768, 4), None, 2),  # q split 256 from 768
    ],
)
def test_flash_attention_buffers_equal_the_profiler_in_fp32(q_shape, kv_len, threads):
    torch.set_num_threads(threads)
    step, inputs = _attention_step(q_shape, kv_len)
    tl, (peak, end) = tracked_and_profiled(step, inputs=inputs)
    assert_equals_profiler(tl, peak, end)
    internal = tl.column("bytes")[tl.column("storage") == -1]
    assert len(internal) == 4 and internal.min() > 0  # the forward's and the backward's, each alloc + free


def test_a_gradient_already_in_the_kernels_layout_is_not_copied():
    torch.set_num_threads(1)
    step, inputs = _attention_step((1, 2, 40, 8), contiguous_grad=True)
    tl, (peak, end) = tracked_and_profiled(step, inputs=inputs)
    assert_equals_profiler(tl, peak, end)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_flash_attention_in_other_dtypes_equals_the_profiler(dtype):
    # fp16 is modelled below AVX512_CORE_FP16 (reduced-precision twins of the buffers); fp64 accumulates in fp64
    if not cp.modelled(FLASH._schema.name.split("::")[-1], dtype):
        pytest.skip(f"{dtype} flash attention is learned, not modelled, on {cp.cpu_path().onednn_isa}")
    torch.set_num_threads(2)
    step, inputs = _attention_step((1, 1, 40, 8), 72, dtype)
    tl, (peak, end) = tracked_and_profiled(step, inputs=inputs)
    assert_equals_profiler(tl, peak, end)


def test_the_formulas_are_what_workspace_fn_gives_for_flash_attention(monkeypatch):
    monkeypatch.setattr(cp, "cpu_path", _path)
    q = torch.randn(1, 1, 40, 8)
    out = FLASH(q, q, q)
    fn = workspace.workspace_fn(FLASH)
    assert fn((q, q, q), {}, out) == attention.flash_cpu_forward((q, q, q), {}, out) > 0
    assert workspace.workspace_fn(FLASH, "cuda:0") is None and workspace.lower_bound_fn(FLASH, "cuda") is None
    assert workspace.workspace_fn(FLASH, "cpu") is not None
    assert workspace.lower_bound_fn(FLASH)((q, q, q), {}) is False


# The formulas model the AVX2 kernel path. On a CPU that takes another path the tests above learn the buffers
# instead, so here the kernels run under the profiler in a child process limited to AVX2 (torch only, no memkit),
# and the formulas are checked against what it measured, call by call.
_FLASH_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch._C._profiler import _EventType

    def buffers(fn):  # peak minus end of the CPU allocator over one call: the kernel's internal buffers
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
        sizes = []
        def walk(nodes):
            for n in nodes:
                if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu":
                    sizes.append((n.start_time_ns, n.extra_fields.alloc_size))
                walk(n.children)
        walk(prof.profiler.kineto_results.experimental_event_tree())
        live = peak = 0
        for _, size in sorted(sizes):
            live += size
            peak = max(peak, live)
        return out, peak - live

    aten = torch.ops.aten
    result = {"capability": torch.backends.cpu.get_cpu_capability(), "cases": []}
    for b, h, q_len, kv_len, d, dtype, threads, layout in json.loads(sys.argv[1]):
        torch.set_num_threads(threads)
        dt = getattr(torch, dtype)
        q = torch.randn(b, h, q_len, d, dtype=dt)
        k, v = (torch.randn(b, h, kv_len, d, dtype=dt) for _ in range(2))
        (out, lse), forward = buffers(lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v))
        grad = torch.randn(b, q_len, h, d, dtype=dt).transpose(1, 2) if layout else torch.randn_like(out)
        _, backward = buffers(
            lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False)
        )
        result["cases"].append([forward, backward])
    print(json.dumps(result))
    """
)
_FLASH_CASES = [
    # batch, heads, q_len, kv_len, head_dim, dtype, threads, grad already in the kernel's layout
    (1, 2, 40, 40, 8, "float32", 1, False),  # q split 32 (q_len < 192)
    (1, 1, 40, 100, 8, "float32", 2, False),  # cross-attention: the kv split follows k; per-thread buffers
    (1, 1, 192, 600, 4, "float32", 1, True),  # q split 64 from 192; kv split at most 512; no gradient copy
    (2, 1, 768, 24, 16, "float32", 2, False),  # q split 256 from 768; kv shorter than q
    (1, 2, 40, 72, 8, "bfloat16", 2, False),  # reduced precision: fp32 accumulators and bf16 twins
    (1, 1, 200, 30, 12, "bfloat16", 1, True),
    (1, 1, 40, 72, 8, "float64", 2, False),  # accumulates in fp64
]


@pytest.fixture(scope="module")
def avx2_flash_buffers():
    if "avx2" not in cp.cpu_flags() or "fma" not in cp.cpu_flags():
        pytest.skip("this CPU has no AVX2 path to measure the formulas against")
    cases = [list(c) for c in _FLASH_CASES]
    # What the kernels allocate depends on torch and the cases, not on memkit: kept across runs (mutation testing
    # runs this test once per mutant of the formulas).
    key = hashlib.sha256(repr((torch.__version__, _FLASH_CHILD, cases)).encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / f"memkit-avx2-flash-{key}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _FLASH_CHILD, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["capability"] == "AVX2", result
    cache.write_text(json.dumps(result["cases"]))
    return result["cases"]


@pytest.mark.parametrize("i", range(len(_FLASH_CASES)))
def test_flash_attention_formulas_equal_the_avx2_kernels_measured_in_a_child(avx2_flash_buffers, i):
    b, h, q_len, kv_len, d, dtype, threads, layout = _FLASH_CASES[i]
    dt = getattr(torch, dtype)
    q = torch.empty(b, h, q_len, d, dtype=dt, device="meta")
    k = v = torch.empty(b, h, kv_len, d, dtype=dt, device="meta")
    out = torch.empty_like(q)
    grad = torch.empty(b, q_len, h, d, dtype=dt, device="meta").transpose(1, 2) if layout else torch.empty_like(q)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        forward = attention.flash_cpu_forward((q, k, v), {}, (out, None))
        backward = attention.flash_cpu_backward((grad, q, k, v, out, None), {}, None)
    finally:
        torch.set_num_threads(before)
    assert [forward, backward] == avx2_flash_buffers[i]
    assert type(forward) is int and type(backward) is int  # bytes, never a float from a division


# ---- scalars.py --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("number", [2.0, 3, True])
def test_wrapped_numbers_equal_the_profiler(number):
    torch.set_num_threads(1)
    x = torch.randn(100)
    tl, (peak, end) = tracked_and_profiled(lambda: x * number, inputs=[x])
    assert (tl.peak_bytes - tl.baseline_bytes, tl.end_bytes - tl.baseline_bytes) == (peak, end)
    assert tl.column("bytes")[tl.column("storage") == -1].tolist() != []


def test_a_complex_number_is_short_only_by_the_unmodelled_cast_of_the_tensor():
    torch.set_num_threads(1)
    x = torch.randn(100)
    tl, (peak, end) = tracked_and_profiled(lambda: x * 1j, inputs=[x])
    assert peak == tl.peak_bytes - tl.baseline_bytes + x.to(torch.complex64).nbytes  # the kernel's cast of x


def test_wrapped_scalars_by_argument():
    x = torch.randn(3)
    slots = (0, 1)
    f64, i64 = torch.float64.itemsize, torch.int64.itemsize  # Python float and int wrap as these
    assert _wrapped_scalars(slots, (x, 2.0)) == 2 * f64 + x.element_size()  # cast to float32
    assert _wrapped_scalars(slots, (x.double(), 2.0)) == 2 * f64  # no cast
    assert _wrapped_scalars(slots, (x, 2)) == 2 * i64 + x.element_size()
    assert _wrapped_scalars(slots, (x, True)) == 2 * 1 + x.element_size()
    assert _wrapped_scalars(slots, (x, 1j)) == 2 * 16 + 8
    assert _wrapped_scalars(slots, (2.0, 3.0)) == 4 * f64  # no tensor to cast to
    assert _wrapped_scalars((1,), (2.0, x)) == 0  # only the given slots
    assert _wrapped_scalars((0, 1, 2), (x, 2.0)) == 2 * f64 + 4  # a slot past the arguments
    assert _wrapped_scalars(slots, (x, "a")) == 0 and _wrapped_scalars(slots, (x, None)) == 0


def test_saved_numbers_are_those_autograd_keeps():
    x = torch.randn(3, requires_grad=True)
    for func, args, attr, op in (
        (aten.div.Tensor, (x, 2.0), "_saved_other", lambda: x / 2.0),
        (aten.mul.Tensor, (x, 3), "_saved_other", lambda: x * 3),
        (aten.mul_.Tensor, (x, 3.0), "_saved_other", None),
    ):
        fn = saved_scalars_fn(func)
        found = fn(args)
        number = args[1]
        assert found == ((attr, 8, number),)  # float64 or int64
        if op is not None:
            saved = getattr(op().grad_fn, attr)  # what autograd itself keeps
            assert saved.untyped_storage().nbytes() == found[0][1] and saved.item() == number
        with torch.no_grad():
            assert fn(args) == ()
        assert fn((x.detach(), number)) == ()
        assert fn((x,)) == ()  # the number's slot missing
        assert fn((x, x)) == ()
    assert saved_scalars_fn(aten.mul.Tensor, "cuda:0") is None
    assert saved_scalars_fn(aten.mul.Tensor, "cpu") is not None
    assert saved_scalars_fn(aten.add.Tensor) is None
    assert saved_scalars_fn(aten.__and__.Tensor) is None
    assert saved_scalars_fn(aten.fmod.Tensor)((2.0, x)) == (("_saved_self", 8, 2.0),)
    assert saved_scalars_fn(aten.fmod.Tensor)((x, 2.0)) == ()  # other is not saved


def test_reused_bytes_counts_only_the_saved_numbers_passed_again():
    g = torch.randn(3)
    saved = [(123, 2.0), (456, 5)]
    assert reused_bytes((0, 1), (g, 2.0), saved) == 8
    assert reused_bytes((0, 1), (g, 5), saved) == 8
    assert reused_bytes((0, 1), (g, 3.0), saved) == 0  # another value
    assert reused_bytes((0, 1), (g, 5.0), saved) == 0  # another type
    assert reused_bytes((0, 1), (g, True), [(1, True)]) == 1
    assert reused_bytes((0, 1, 2), (g, 2.0), saved) == 8
    assert reused_bytes((0,), (g, 2.0), saved) == 0
    assert reused_bytes((0, 1), (2.0, 2.0), saved) == 16


# ---- cpu_path.py ----------------------------------------------------------------------------------------------------


def test_supported_isas_and_missing_flags_for_synthetic_flag_sets():
    assert cp.supported_isas(frozenset()) == []
    assert cp.supported_isas(frozenset({"sse4_1", "avx", "avx2"})) == ["SSE41", "AVX", "AVX2"]
    avx512 = frozenset({"sse4_1", "avx", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert cp.supported_isas(avx512)[-1] == "AVX512_CORE" and "AVX2_VNNI" not in cp.supported_isas(avx512)
    assert cp.supported_isas(ALL_FLAGS) == list(cp.ONEDNN_ISAS)
    for isa, need in cp.ONEDNN_ISAS.items():  # exactly the flags an ISA needs are enough for it
        assert isa in cp.supported_isas(frozenset(need)) and cp.missing_flags(isa, frozenset(need)) == []
    assert cp.missing_flags("AVX2", frozenset({"avx"})) == ["avx2"]
    assert cp.missing_flags("AVX512_CORE_VNNI", frozenset({"avx512f", "avx512vl"})) == [
        "avx512_vnni",
        "avx512bw",
        "avx512dq",
    ]
    assert cp.missing_flags("AVX512_CORE_FP16", avx512) == ["avx512_bf16", "avx512_fp16", "avx512_vnni"]
    assert cp.missing_flags("AVX10_1_512_AMX", ALL_FLAGS) == []
    real = cp.cpu_flags()
    assert cp.supported_isas() == cp.supported_isas(real)
    assert cp.missing_flags("AVX512_CORE_AMX") == cp.missing_flags("AVX512_CORE_AMX", real)


def test_cpu_flags_are_the_first_flags_line_of_proc_cpuinfo(monkeypatch, tmp_path):
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        text = ""
    lines = [ln for ln in text.splitlines() if ln.startswith("flags")]
    expected = frozenset(lines[0].split(":", 1)[1].split()) if lines else frozenset()
    assert cp.cpu_flags() == expected
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor : 0\nflags_x\t: nope\nflags\t\t: avx sse4_1 avx2\nflags : other\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(fake if p == "/proc/cpuinfo" else p, *a, **k))
    assert cp.cpu_flags() == frozenset({"nope"})  # startswith("flags"): the first such line
    fake.write_text("processor : 0\nflags\t\t: avx sse4_1 avx2\nflags : other\n")
    assert cp.cpu_flags() == frozenset({"avx", "sse4_1", "avx2"})
    fake.write_text("processor : 0\n")
    assert cp.cpu_flags() == frozenset()

    def missing(*a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr("builtins.open", missing)
    assert cp.cpu_flags() == frozenset()


def test_at_most_compares_on_the_isa_ladder():
    assert _path(onednn_isa="AVX2").at_most("AVX2")
    assert _path(onednn_isa="AVX2").at_most("AVX512_CORE")
    assert not _path(onednn_isa="AVX512_CORE").at_most("AVX2")
    assert not _path(onednn_isa="NONE").at_most("AVX512_CORE_AMX")
    assert _path(onednn_isa="SSE41").at_most("SSE41")


def test_modelled_by_op_dtype_and_path():
    for op in ("mm", "addmm", "_scaled_dot_product_flash_attention_for_cpu"):
        assert cp.modelled(op, torch.float32, NOT_X86) is False
        assert cp.modelled(op, torch.float32, _path(onednn_isa="AVX512_CORE_AMX")) is True
        assert cp.modelled(op, torch.bfloat16, _path(onednn_isa="AVX2_VNNI_2")) is True
        assert cp.modelled(op, torch.bfloat16, _path(onednn_isa="AVX512_CORE")) is False
        assert cp.modelled(op, torch.float16, _path(onednn_isa="AVX512_CORE_BF16")) is True
        assert cp.modelled(op, torch.float16, _path(onednn_isa="AVX10_1_512")) is False
        assert cp.modelled(op, torch.bfloat16, _path(onednn_isa="NONE")) is True
    assert cp.modelled("add", torch.bfloat16, NOT_X86) is True  # no internal buffers on any path
    assert cp.modelled("convolution", torch.bfloat16, NOT_X86) is True  # learned always, not by path


def test_modelled_defaults_to_this_process_path(monkeypatch):
    monkeypatch.setattr(cp, "cpu_path", lambda: NOT_X86)
    assert cp.modelled("mm", torch.float32) is False
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(onednn_isa="AVX512_CORE"))
    assert cp.modelled("mm", torch.bfloat16) is False and cp.modelled("mm", torch.float16) is True


def test_cpu_path_reads_the_isa_limit(monkeypatch):
    monkeypatch.setattr(cp, "supported_isas", lambda flags=None: list(cp.ONEDNN_ISAS)[:8])
    monkeypatch.setattr(cp.platform, "machine", lambda: "x86_64")
    for env, expected in (
        ({}, "AVX512_CORE_BF16"),
        ({"ONEDNN_MAX_CPU_ISA": "avx2"}, "AVX2"),
        ({"DNNL_MAX_CPU_ISA": "AVX512_CORE"}, "AVX512_CORE"),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, "AVX512_CORE_BF16"),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16"}, "AVX512_CORE_BF16"),
    ):
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        path = cp.cpu_path.__wrapped__()
        assert (path.x86, path.onednn_isa, path.amx) == (True, expected, False), env
    monkeypatch.setattr(cp.platform, "machine", lambda: "aarch64")
    assert cp.cpu_path.__wrapped__().onednn_isa == "NONE" and not cp.cpu_path.__wrapped__().x86


# ---- workspace/__init__.py -----------------------------------------------------------------------------------------


def test_workspace_fn_is_none_for_ops_without_internal_buffers():
    assert workspace.workspace_fn(aten.empty.memory_format) is None  # no Tensor argument, no formula
    assert workspace.workspace_fn(aten.mul.Tensor, "cuda:0") is None
    assert workspace.workspace_fn(aten.mm.default, "meta") is None
    assert workspace.lower_bound_fn(aten.mul.Tensor) is None  # nothing to learn on any path
    assert workspace.lower_bound_fn(aten.mm.default, "cuda:1") is None
    x = torch.randn(3)
    fn = workspace.workspace_fn(aten.mul.Tensor, "cpu")
    assert fn((x, 2.0), {}, x * 2.0) == _wrapped_scalars((0, 1), (x, 2.0)) > 0
    assert fn((x, x), {}, x * x) == 0


def test_matmuls_are_learned_only_off_the_modelled_path(monkeypatch):
    calls = []

    def fake(func, args, kwargs):
        calls.append(str(func))
        return {"aten.mm.default": 1000}.get(str(func))

    monkeypatch.setattr(learned, "learned_bytes", fake)
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    monkeypatch.setattr(cp, "cpu_path", _path)
    fn, bound = workspace.workspace_fn(aten.mm.default), workspace.lower_bound_fn(aten.mm.default)
    assert fn((a, b), {}, a @ b) == 0 and bound((a, b), {}) is False and calls == []
    monkeypatch.setattr(cp, "cpu_path", lambda: NOT_X86)
    assert fn((a, b), {}, a @ b) == 1000 and bound((a, b), {}) is False
    assert calls == ["aten.mm.default"] * 2
    add = workspace.workspace_fn(aten.addmm.default)
    assert add((torch.zeros(2), a, b), {}, None) == 0  # None learned: counted as 0...
    assert workspace.lower_bound_fn(aten.addmm.default)((torch.zeros(2), a, b), {}) is True  # ...and flagged
    assert fn((a.to("meta"), b.to("meta")), {}, None) == 0  # not a CPU tensor: nothing to learn
    assert fn((1, 2), {}, None) == 2 * 8 + 2 * 8  # no tensor: just the wrapped numbers


def test_convolutions_are_learned_on_every_path(monkeypatch):
    monkeypatch.setattr(cp, "cpu_path", _path)
    monkeypatch.setattr(learned, "learned_bytes", lambda func, args, kwargs: 77)
    conv = aten.convolution.default
    x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 3, 3)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert workspace.workspace_fn(conv)(args, {}, None) == 77
    assert workspace.lower_bound_fn(conv)(args, {}) is False
    monkeypatch.setattr(learned, "learned_bytes", lambda func, args, kwargs: None)
    assert workspace.lower_bound_fn(conv)(args, {}) is True


def test_lower_bound_ops_with_learning_off(monkeypatch):
    monkeypatch.setenv("MEMKIT_LEARN_WORKSPACE", "0")
    monkeypatch.setattr(cp, "cpu_path", lambda: NOT_X86)
    q = torch.randn(1, 1, 8, 4, requires_grad=True)
    with track(inputs=[q]) as tl:
        SDPA(q, q, q).sum().backward()
    assert tl.meta["lower_bound_ops"] == [
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    ]
    assert learned.learned_bytes(FLASH, (q, q, q), {}) is None


# ---- learned.py -------------------------------------------------------------------------------------------------


def test_signatures_are_layouts_not_values(monkeypatch):
    monkeypatch.setenv("MEMKIT_LEARN_MAX_BYTES", "100000")
    a = torch.randn(4, 6)
    t = a.t()[1:]
    key, spec_args, spec_kwargs, threads = learned._signature(aten.mm.default, (t, a), {"z": 1, "b": [a, 2.5]})
    assert spec_args[0] == worker.TensorSpec((5, 4), (1, 6), 1, 24, torch.float32)
    assert spec_kwargs == {"b": (spec_args[1], 2.5), "z": 1} and list(spec_kwargs) == ["b", "z"]
    assert threads == torch.get_num_threads()
    assert key == ("aten.mm.default", spec_args, (("b", (spec_args[1], 2.5)), ("z", 1)), threads)
    assert key == learned._signature(aten.mm.default, (a.t()[1:], a), {"b": [a, 2.5], "z": 1})[0]
    torch.set_num_threads(threads + 1)
    assert learned._signature(aten.mm.default, (t, a), {"z": 1, "b": [a, 2.5]})[0] != key
    for value in (None, True, 3, 2.5, "s", torch.float16, torch.device("cpu"), torch.strided, torch.channels_last):
        assert learned._spec(value, [0]) == value
    total = [0]
    learned._spec((a, [t]), total)
    assert total == [2 * a.untyped_storage().nbytes()]  # each tensor's whole storage


def test_what_cannot_be_learned(monkeypatch, fresh_learned):
    asked = []
    monkeypatch.setattr(learned, "_ask", lambda *a: asked.append(a) or 5)
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(learned._Unlearnable, match="a torch.sparse_coo tensor"):
        learned._spec(sparse, [0])
    with pytest.raises(learned._Unlearnable, match="an argument of type object"):
        learned._spec(object(), [0])
    assert learned.learned_bytes(aten.mm.default, (sparse, sparse), {}) is None
    monkeypatch.setenv("MEMKIT_LEARN_MAX_BYTES", "64")
    a = torch.randn(4, 4)  # 64 bytes: at the limit
    assert learned.learned_bytes(aten.mm.default, (a,), {}) == 5
    with pytest.raises(learned._Unlearnable, match="128 bytes of tensors, over MEMKIT_LEARN_MAX_BYTES"):
        learned._signature(aten.mm.default, (a, a), {})
    assert learned.learned_bytes(aten.mm.default, (a, a), {}) is None
    monkeypatch.delenv("MEMKIT_LEARN_MAX_BYTES")
    assert learned._max_bytes() == 2 * 1024**3
    monkeypatch.setenv("MEMKIT_LEARN_WORKSPACE", "0")
    assert not learned.enabled() and learned.learned_bytes(aten.mm.default, (a, a), {}) is None
    monkeypatch.setenv("MEMKIT_LEARN_WORKSPACE", "1")
    assert learned.enabled()
    monkeypatch.delenv("MEMKIT_LEARN_WORKSPACE")
    assert learned.enabled()
    assert len(asked) == 1


def test_each_signature_is_asked_once_and_cached(monkeypatch, fresh_learned):
    asked = []
    answers = {(2, 2): 64, (3, 3): None}
    monkeypatch.setattr(learned, "_ask", lambda op, args, kwargs, threads: asked.append(op) or answers[args[0].shape])
    a, b = torch.randn(2, 2), torch.randn(3, 3)
    assert learned.learned_bytes(aten.mm.default, (a, a), {}) == 64
    assert learned.learned_bytes(aten.mm.default, (a + 1, a), {}) == 64
    assert learned.learned_bytes(aten.mm.default, (b, b), {}) is None
    assert learned.learned_bytes(aten.mm.default, (b, b), {}) is None
    assert learned.learned_bytes(aten.add.Tensor, (a, a), {}) == 64
    assert asked == ["aten::mm.default", "aten::mm.default", "aten::add.Tensor"]
    assert learned.cache_info() == {"learned": 2, "failed": 1}


def test_the_worker_is_asked_with_the_calls_keyword_arguments_and_thread_count(monkeypatch, fresh_learned):
    asked = []
    monkeypatch.setattr(learned, "_ask", lambda *request: asked.append(request) or 32)
    a = torch.randn(2, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert learned.learned_bytes(aten.addmm.default, (a, a, a), {"beta": 2.0, "alpha": 0.5}) == 32
    finally:
        torch.set_num_threads(before)
    ((op, args, kwargs, threads),) = asked
    assert op == "aten::addmm.default" and len(args) == 3 and threads == 2
    assert kwargs == {"alpha": learned._spec(0.5, [0]), "beta": learned._spec(2.0, [0])}


def test_workspace_fn_and_lower_bound_fn_pass_the_call_through(monkeypatch):
    # What the learned sizes and the formulas are given is this call's arguments, keyword arguments and outputs.
    monkeypatch.setattr(cp, "cpu_path", lambda: NOT_X86)  # nothing modelled: matmuls are learned
    seen = []
    monkeypatch.setattr(learned, "learned_bytes", lambda func, args, kwargs: seen.append((func, args, kwargs)) or 48)
    a, kwargs = torch.randn(2, 2), {"out_dtype": None}
    assert workspace.workspace_fn(aten.mm.default, "cpu")((a, a), kwargs, a) == 48
    assert workspace.lower_bound_fn(aten.mm.default, "cpu:0")((a, a), kwargs) is False
    assert seen == [(aten.mm.default, (a, a), kwargs)] * 2
    monkeypatch.setattr(learned, "learned_bytes", lambda func, args, kwargs: None)
    assert workspace.lower_bound_fn(aten.mm.default, "cpu")((a, a), kwargs) is True

    formula_got = []
    monkeypatch.setattr(cp, "cpu_path", _path)
    monkeypatch.setitem(workspace._CPU, FLASH, lambda *call: formula_got.append(call) or 7)
    q, out = torch.randn(1, 1, 4, 2), object()
    assert workspace.workspace_fn(FLASH)((q, q, q), {"scale": 0.5}, out) == 7
    assert formula_got == [((q, q, q), {"scale": 0.5}, out)]
    # An op with a formula and no tensor arguments adds no wrapped numbers of its own.
    monkeypatch.setitem(workspace._CPU, aten.ones.default, lambda args, kwargs, out: 0)
    assert workspace.workspace_fn(aten.ones.default)(([2],), {}, None) == 0


def test_a_matmul_is_learned_by_its_dtype_on_a_path_that_models_only_some(monkeypatch):
    path = _path(onednn_isa="AVX512_CORE", aten_capability="AVX512")
    monkeypatch.setattr(cp, "cpu_path", lambda: path)
    fp32, bf16 = torch.randn(2, 2), torch.randn(2, 2, dtype=torch.bfloat16)
    assert cp.modelled("mm", torch.float32) and not cp.modelled("mm", torch.bfloat16)  # the premise
    assert workspace._needs_learning("mm", (bf16, bf16)) and not workspace._needs_learning("mm", (fp32, fp32))


FAKE_WORKER = textwrap.dedent(
    """
    import os, pickle, struct, sys
    mode = os.environ["FAKE_MODE"]
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(repr((sys.argv[1:], os.environ.get("PYTHONPATH", ""))) + "\\n")
    out, inp = sys.stdout.buffer, sys.stdin.buffer

    def write(obj):
        data = pickle.dumps(obj)
        out.write(struct.pack(">I", len(data)) + data)
        out.flush()

    if mode == "silent":
        sys.exit(0)
    if mode == "half-ready":
        out.write(struct.pack(">I", 100) + b"x" * 10)
        out.flush()
        sys.exit(0)
    write(("busy", 0) if mode == "not-ready" else ("ready", 0))
    while True:
        head = inp.read(4)
        if len(head) < 4:
            break
        (n,) = struct.unpack(">I", head)
        body = inp.read(n)
        if mode == "die":
            sys.exit(0)
        if mode == "error":
            write(("error", "RuntimeError: no"))
        else:
            write(("ok", len(body)))
    """
)


@pytest.fixture
def fake_worker(monkeypatch, tmp_path, fresh_learned):
    """learned.py starting a stand-in worker (no torch: it starts in milliseconds) that answers the request's
    length in bytes; FAKE_MODE makes it fail in one of several ways."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{script}" "$@"\n')
    exe.chmod(0o755)
    log = tmp_path / "log"
    monkeypatch.setattr(learned.sys, "executable", str(exe))
    monkeypatch.setenv("FAKE_LOG", str(log))

    def set_mode(mode):
        monkeypatch.setenv("FAKE_MODE", mode)
        return log

    return set_mode


def _request_len(op, args, kwargs, threads):
    return len(pickle.dumps((op, args, kwargs, threads), protocol=4))


def test_the_worker_is_started_once_and_answers_each_request(fake_worker):
    log = fake_worker("ok")
    a = torch.randn(2, 3)
    spec = (learned._spec(a, [0]),)
    assert learned._ask("aten::neg.default", spec, {}, 1) == _request_len("aten::neg.default", spec, {}, 1)
    first = learned._worker
    assert learned._ask("aten::neg.default", spec, {"k": 1}, 2) == _request_len("aten::neg.default", spec, {"k": 1}, 2)
    assert learned._worker is first and first.poll() is None  # the same worker, still running
    argv, pythonpath = eval(log.read_text().strip())
    assert argv == ["-m", "memkit.memory.workspace._learn_worker"]
    assert pythonpath.split(os.pathsep) == [p for p in sys.path if p]
    learned._stop()
    assert learned._worker is None and first.wait(timeout=5) == 0
    learned._stop()  # twice is fine
    assert learned._ask("aten::neg.default", spec, {}, 1) > 0  # a new worker after a stop
    assert len(log.read_text().splitlines()) == 2


@pytest.mark.parametrize("mode", ["silent", "half-ready", "not-ready", "die"])
def test_a_failed_worker_gives_none_warns_once_and_is_not_asked_again(fake_worker, monkeypatch, mode):
    fake_worker(mode)
    a = torch.randn(2, 2)
    with pytest.warns(UserWarning, match=r"memkit: the workspace worker failed \(EOFError: .*\); ops it would"):
        assert learned.learned_bytes(aten.mm.default, (a, a), {}) is None
    assert learned._broken.startswith("the workspace worker failed (EOFError")
    said = {"not-ready": "the worker answered 'busy' instead of 'ready')", "half-ready": "mid-answer)"}
    assert learned._broken.endswith(said.get(mode, "closed its pipe)"))
    assert learned._worker is None
    monkeypatch.setenv("FAKE_MODE", "ok")
    assert learned._ask("aten::mm.default", (), {}, 1) is None  # broken for the rest of the process
    assert learned.cache_info() == {"learned": 0, "failed": 1}


def test_an_error_answer_gives_none_without_breaking_the_worker(fake_worker):
    fake_worker("error")
    assert learned._ask("aten::mm.default", (), {}, 1) is None
    assert learned._broken is None and learned._worker.poll() is None


def test_read_needs_a_whole_answer():
    data = pickle.dumps(("ok", 12))
    assert learned._read(io.BytesIO(struct.pack(">I", len(data)) + data)) == ("ok", 12)
    with pytest.raises(EOFError, match="closed its pipe$"):
        learned._read(io.BytesIO(b"\x00\x00"))
    with pytest.raises(EOFError, match="^the worker closed its pipe mid-answer$"):
        learned._read(io.BytesIO(struct.pack(">I", len(data)) + data[:-1]))


# ---- _learn_worker.py, in-process ----------------------------------------------------------------------------------


def test_resolve_and_rebuild():
    assert worker._resolve("aten::mm.default") is aten.mm.default
    assert worker._resolve("aten::add.Tensor") is aten.add.Tensor
    assert worker._resolve("aten::mm") is aten.mm.default
    base = torch.randn(30)
    view = base.as_strided((2, 3), (1, 4), 5)
    spec = learned._spec(view, [0])
    t = worker._tensor(spec)
    assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == (view.shape, view.stride(), 5, torch.float32)
    assert t.untyped_storage().nbytes() == base.untyped_storage().nbytes()
    whole = t.as_strided((30,), (1,), 0)
    assert whole.abs().max() <= 1 and whole.std() > 0.1  # random values in [-1, 1]
    ints = worker._tensor(learned._spec(torch.ones(5, dtype=torch.int64), [0]))
    assert ints.dtype == torch.int64 and ints.tolist() == [0] * 5
    empty = worker._tensor(learned._spec(torch.empty(0), [0]))
    assert empty.shape == (0,) and empty.untyped_storage().nbytes() == 4
    rebuilt = worker._rebuild((spec, [spec, 2], 3, None))
    assert isinstance(rebuilt, tuple) and isinstance(rebuilt[1], list)
    assert rebuilt[0].shape == (2, 3) and rebuilt[1][0].shape == (2, 3) and rebuilt[1][1:] == [2]
    assert rebuilt[2:] == (3, None)


@pytest.mark.parametrize("threads", [1, 2])
def test_measure_equals_the_profiler(threads):
    q = torch.randn(1, 1, 40, 8)
    spec = learned._spec(q, [0])
    torch.set_num_threads(threads)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = FLASH(q, q, q)
    del out
    peak, end = profiler_window(prof)
    assert end == q.nbytes + q.nbytes // q.shape[-1]  # the outputs: out and logsumexp
    torch.set_num_threads(3 - threads)  # measure sets the thread count it is given
    measured = worker.measure("aten::_scaled_dot_product_flash_attention_for_cpu", (spec, spec, spec), {}, threads)
    assert measured == peak - end > 0  # beyond the outputs
    assert torch.get_num_threads() == threads
    a = learned._spec(torch.randn(8, 8), [0])
    assert worker.measure("aten::add.Tensor", (a, a), {"alpha": 2}, 1) == 0  # nothing beyond the output
    # keyword arguments reach the op: mm.out writes into the given tensor (and cannot run without it)
    assert worker.measure("aten::mm.out", (a, a), {"out": a}, 1) == 0
    with pytest.raises(RuntimeError, match="alpha"):
        worker.measure("aten::add.Tensor", (a, a), {"alpha": "two"}, 1)


def test_main_answers_each_request_until_stdin_closes(monkeypatch):
    a = learned._spec(torch.randn(4, 4), [0])
    requests = [("aten::add.Tensor", (a, a), {}, 1), ("aten::nope.default", (), {}, 1)]
    stdin = io.BytesIO(b"".join(struct.pack(">I", len(d)) + d for d in map(pickle.dumps, requests)))
    stdout = io.BytesIO()

    class Stream:
        def __init__(self, buffer):
            self.buffer = buffer

    monkeypatch.setattr(sys, "stdin", Stream(stdin))
    monkeypatch.setattr(sys, "stdout", Stream(stdout))
    worker.main()
    assert sys.stdout is sys.stderr  # nothing else may reach the pipe
    stdout.seek(0)
    answers = [worker._read(stdout) for _ in range(3)]
    assert answers[0] == ("ready", 0) and answers[1] == ("ok", 0)
    assert answers[2][0] == "error" and answers[2][1].startswith("AttributeError: ")
    assert worker._read(stdout) is None


def test_worker_protocol_round_trip():
    stream = io.BytesIO()
    worker._write(stream, ("ok", 7))
    assert stream.getvalue()[:4] == struct.pack(">I", len(pickle.dumps(("ok", 7), protocol=4)))
    stream.seek(0)
    assert worker._read(stream) == ("ok", 7) and learned._read(io.BytesIO(stream.getvalue())) == ("ok", 7)
    assert worker._read(io.BytesIO(b"\x00")) is None
