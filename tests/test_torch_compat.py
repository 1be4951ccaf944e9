"""``memkit._torch_compat``: one test per shim, on whichever torch runs the suite (``make test-matrix`` runs this file
under the oldest and the newest supported torch), plus the version range, its warning and the FSDP floor."""

from __future__ import annotations

import importlib
import re
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import memkit
from memkit import _torch_compat as compat

needs_fsdp = pytest.mark.skipif(compat.torch_version() < compat.FSDP_MIN, reason="FSDP2 needs torch >= 2.11")


@pytest.fixture
def torch_is(monkeypatch):
    """Make the compat module read another torch version (its only source: torch_version_text)."""

    def set_version(text: str) -> None:
        monkeypatch.setattr(compat, "torch_version_text", lambda: text)

    return set_version


# ---- the range ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"), [("2.13.0+cpu", (2, 13)), ("2.8.0", (2, 8)), ("2.16.0.dev20260101", (2, 16)), ("3.0", (3, 0))]
)
def test_versions_are_read_as_major_minor(text, expected):
    assert compat._parse(text) == expected


def test_a_version_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValueError, match="torch version must look like 'MAJOR.MINOR...', got 'nightly'"):
        compat._parse("nightly")


def test_the_running_torch_is_read_from_torch_itself():
    assert compat.torch_version_text() == torch.__version__
    assert compat.torch_version() == tuple(int(x) for x in torch.__version__.split(".")[:2])


def test_the_declared_range_is_pyproject_s():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'"torch([^"]+)"', pyproject).group(1)
    assert declared == compat.SUPPORTED
    low, high = re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", declared).groups()[:2], declared.split("<")[1]
    assert compat.TORCH_MIN == tuple(map(int, low)) and compat.TORCH_BELOW == compat._parse(high)


def test_the_suite_runs_on_a_supported_torch():
    assert compat.TORCH_MIN <= compat.torch_version() < compat.TORCH_BELOW
    assert compat.warn_if_unsupported() is False


@pytest.mark.parametrize("text", ["2.6.0", "2.7.1+cu126", "2.15.0", "3.0.0"])
def test_import_memkit_warns_once_naming_the_range_outside_it(torch_is, text):
    torch_is(text)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        importlib.reload(memkit)
    ours = [w for w in said if "memkit supports" in str(w.message)]
    assert len(ours) == 1
    message = str(ours[0].message)
    assert f"memkit supports torch {compat.SUPPORTED} (2.8 to 2.14); this is torch {text}." in message
    assert issubclass(ours[0].category, RuntimeWarning)


@pytest.mark.parametrize("text", ["2.8.0", "2.9.1", "2.14.1"])
def test_import_memkit_is_quiet_inside_the_range(torch_is, text):
    torch_is(text)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        importlib.reload(memkit)
    assert not [w for w in said if "memkit supports" in str(w.message)]


def test_require_torch_names_the_version_a_feature_needs(torch_is):
    compat.require_torch((2, 8), "anything")  # the running torch is supported
    torch_is("2.9.1")
    compat.require_torch((2, 9), "anything")
    said = r"^memkit.FSDP needs torch >= 2.11; this is torch 2.9.1, where .*: pip install 'torch>=2.11,<2.15'$"
    with pytest.raises(RuntimeError, match=said):
        compat.require_torch(compat.FSDP_MIN, "memkit.FSDP")


@pytest.mark.parametrize("how", ["estimate", "apply"])
def test_fsdp_below_2_11_is_refused_by_memkit_not_inside_torch(torch_is, how):
    torch_is("2.9.1")
    with pytest.raises(RuntimeError, match="needs torch >= 2.11; this is torch 2.9.1") as info:
        if how == "estimate":
            memkit.estimate("flux", size="tiny", parallel=memkit.FSDP(world_size=2))
        else:
            memkit.FSDP(world_size=2).apply(nn.Linear(2, 2))
    assert "/memkit/" in traceback.extract_tb(info.tb)[-1].filename
    assert not torch.distributed.is_initialized()


# ---- autograd -----------------------------------------------------------------------------------------------------
def test_graph_task_running_is_true_only_inside_a_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(compat.graph_task_running()))
    assert compat.graph_task_running() is False
    y.sum().backward()
    assert seen == [True]


def test_current_autograd_node_is_the_node_running_its_backward():
    seen = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(compat.current_autograd_node())
            return g * 2

    y = Double.apply(torch.ones(2, requires_grad=True))
    assert compat.current_autograd_node() is None
    y.sum().backward()
    assert seen[0] is not None and seen[0].name() == y.grad_fn.name()


def test_outer_saved_tensors_hooks_are_the_innermost_active_pair():
    def pack(t):
        return t

    def unpack(t):
        return t

    assert compat.outer_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert compat.outer_saved_tensors_hooks() == (pack, unpack)
        assert compat.outer_saved_tensors_hooks() == (pack, unpack)  # read, not popped
    assert compat.outer_saved_tensors_hooks() is None


def test_swap_outside_dispatch_puts_functions_in_and_back():
    rng, resize = torch.get_rng_state, torch.UntypedStorage.resize_

    def mine_rng():
        return rng()

    def mine_resize(storage, n):
        return resize(storage, n)

    saved = compat.swap_outside_dispatch(mine_rng, mine_resize)
    try:
        assert saved == (rng, resize)
        assert torch.get_rng_state is mine_rng and torch.UntypedStorage.resize_ is mine_resize
    finally:
        compat.swap_outside_dispatch(*saved)
    assert torch.get_rng_state is rng and torch.UntypedStorage.resize_ is resize


# ---- CPU probe, profiler, CUDA history ------------------------------------------------------------------------------
def test_amx_agrees_with_torch_s_own_probe_and_reaches_the_cpu_path(monkeypatch):
    from memkit.memory.workspace import cpu_path as cp

    public = getattr(torch.cpu, "_is_amx_tile_supported", None)
    private = getattr(torch._C._cpu, "_is_amx_tile_supported", None)
    assert public is not None or private is not None  # one of the two exists on every supported torch
    assert compat.amx_tile_supported() == bool((public or private)())

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert compat.amx_tile_supported() is True
    monkeypatch.setattr(cp, "supported_isas", lambda: ["AVX2", "AVX512_CORE", "AVX512_CORE_AMX"])
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    cp.cpu_path.cache_clear()
    try:
        assert cp.cpu_path().amx is True
    finally:
        monkeypatch.undo()
        cp.cpu_path.cache_clear()


def test_amx_falls_back_to_the_private_probe_of_older_torch(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.setattr(torch._C._cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert compat.amx_tile_supported() is True
    monkeypatch.delattr(torch._C._cpu, "_is_amx_tile_supported")
    assert compat.amx_tile_supported() is False


def test_profiler_allocations_see_an_allocation_and_its_free():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = torch.empty(2**20, dtype=torch.uint8)
        del x
    sizes = [size for _, size in compat.profiler_allocations(prof, "cpu")]
    assert 2**20 in sizes and -(2**20) in sizes
    assert sizes.index(2**20) < sizes.index(-(2**20))
    assert compat.profiler_allocations(prof, "cuda") == []


def test_cuda_history_missing_names_the_first_absent_private_function(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_record_memory_history", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **k: None, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {}, raising=False)
    assert compat.cuda_history_missing() is None
    monkeypatch.delattr(torch._C, "_cuda_record_memory_history")
    assert compat.cuda_history_missing() == "torch._C._cuda_record_memory_history"
    monkeypatch.delattr(torch.cuda.memory, "_snapshot")
    assert compat.cuda_history_missing() == "torch.cuda.memory._snapshot"


def test_memory_history_calls_reach_torch_s_private_functions(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **k: calls.append(k), raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": []}, raising=False)
    compat.record_memory_history(enabled=None)
    assert calls == [{"enabled": None}]
    assert compat.memory_snapshot() == {"segments": []}


# ---- FSDP2 (torch >= 2.11) ------------------------------------------------------------------------------------------
@needs_fsdp
def test_register_fake_backend_makes_the_fake_process_group_available():
    compat.register_fake_backend()
    assert "fake" in torch.distributed.Backend.backend_list


def test_register_fake_backend_refuses_an_old_torch(torch_is):
    torch_is("2.10.0")
    with pytest.raises(RuntimeError, match=r"needs torch >= 2.11; this is torch 2.10.0"):
        compat.register_fake_backend()


@needs_fsdp
def test_fsdp_internals_are_the_classes_whose_methods_memkit_wraps():
    found = compat.fsdp_internals()
    assert callable(found.group.wait_for_unshard)
    assert isinstance(vars(found.param)["all_gather_inputs"], property)
    assert callable(found.propagator._propagate_tensor_meta_non_cached)
    assert found.allocators and all("allocate" in vars(cls) for cls in found.allocators)
    assert "DefaultAllocMixin" in [cls.__name__ for cls in found.allocators]


@needs_fsdp
def test_fsdp_params_unsharded_tensors_and_forgetting_a_sharded_module():
    import torch.distributed._composable_state as states
    from torch.distributed.fsdp import fully_shard

    from memkit.parallel import fake_process_group

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert compat.fsdp_params(model) == []
    with fake_process_group(2) as mesh:
        fully_shard(model, mesh=mesh)
        params = compat.fsdp_params(model)
        assert len(params) == 4 and all(type(p).__name__ == "FSDPParam" for p in params)
        group = model._get_fsdp_state()._fsdp_param_group
        assert compat.fsdp_unsharded_tensors(group) == [t for p in params for t in p.all_gather_outputs]
        assert model in states._module_state_mapping
        compat.forget_fsdp_state(model)
        assert model not in states._module_state_mapping


@needs_fsdp
def test_a_dtensor_s_local_shard_is_read_and_replaced():
    from torch.distributed.tensor import DTensor, Shard

    from memkit.parallel import fake_process_group

    assert compat.local_tensor(torch.ones(2)) is None
    with fake_process_group(2) as mesh:
        local = torch.ones(2, 3)
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        shard = compat.local_tensor(dt)  # from_local keeps a view of ``local``: the same memory
        assert type(shard) is torch.Tensor and shard.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        other = torch.zeros(2, 3)
        compat.set_local_tensor(dt, other)
        assert compat.local_tensor(dt) is other and dt.to_local().sum() == 0


def test_the_makefile_s_matrix_runs_the_two_ends_of_the_range():
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    matrix = re.search(r"^MATRIX_TORCH := (.+)$", makefile, re.M).group(1).split()
    newest = (compat.TORCH_BELOW[0], compat.TORCH_BELOW[1] - 1)  # torch's next release after 2.x is 2.(x+1)
    assert matrix == [f"{compat.TORCH_MIN[0]}.{compat.TORCH_MIN[1]}", f"{newest[0]}.{newest[1]}"]
    # and the oldest diffusers the package declares
    from memkit.models import DIFFUSERS_FLOOR

    assert re.search(r"^DIFFUSERS_MIN := (.+)$", makefile, re.M).group(1) == DIFFUSERS_FLOOR


def test_the_command_line_says_which_torch_fsdp_needs_without_a_traceback(capsys, monkeypatch):
    from memkit.cli import main

    monkeypatch.setattr(compat, "torch_version", lambda: (2, 8))
    assert main(["estimate", "flux", "--size", "tiny", "--fsdp", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs torch >= 2.11" in err and "Traceback" not in err


def test_fake_module_to_casts_fake_modules_that_torch_refuses_to_swap():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from memkit._torch_compat import fake_module_to

    original = torch.nn.Module.to
    with FakeTensorMode():
        layer = torch.nn.Linear(4, 2)
        try:  # why the shim exists: torch 2.13 swaps a fake parameter, which its fake mode's weakref forbids
            layer.to(torch.bfloat16)
        except RuntimeError as e:
            assert "swap" in str(e)
        layer = torch.nn.Linear(4, 2)
        with fake_module_to():
            frozen = torch.nn.Linear(4, 2).requires_grad_(False)
            assert layer.to(torch.bfloat16) is layer and frozen.to("cpu", torch.float16) is frozen
    assert torch.nn.Module.to is original  # put back
    assert isinstance(layer.weight, FakeTensor) and isinstance(layer.weight, torch.nn.Parameter)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16 and layer.weight.requires_grad
    assert frozen.weight.dtype == torch.float16 and not frozen.weight.requires_grad
    assert tuple(layer.weight.shape) == (2, 4)
    real = torch.nn.Linear(4, 2)
    with fake_module_to():  # real modules take torch's own path: values kept
        before = real.weight.detach().clone()
        real.to(torch.float64)
    assert torch.equal(real.weight, before.double())


def test_known_values_let_data_dependent_ops_run_on_fake_masks():
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode

    from memkit._torch_compat import known_constant, known_values

    limit = fake_tensor.CONSTANT_NUMEL_LIMIT
    assert known_constant(lambda: torch.ones(2)).tolist() == [1.0, 1.0]  # outside fake mode: the tensor itself
    with FakeTensorMode():
        mask = known_constant(lambda: torch.tensor([[True, False, True], [True, True, True]]))
        x = torch.randn(2, 3, 4)
        assert isinstance(mask, FakeTensor) and mask.constant is not None
        other = known_constant(lambda: torch.ones(2, 3, dtype=torch.bool))
        with pytest.raises(DynamicOutputShapeException):  # why: a row of a mask is past torch's one element (and
            torch.nonzero(other[0])  # the view made the mask forget its values)
        with known_values({"mask": mask, "x": x}):
            assert torch.nonzero(mask[0]).shape == (2, 1)  # Mochi's valid tokens of one sample
            assert x[0][mask[0]].shape == (2, 4)
            assert mask.long().sum(1).tolist() == [2, 3]  # Lumina2's caption lengths, read with .tolist()
            zeros = torch.zeros(2, 3, dtype=torch.bool)  # HunyuanVideo 1.5's image mask, built in its forward
            assert x[~zeros].shape == (6, 4) and bool(torch.all(zeros == 0))
            assert torch.zeros(7, 7).constant is None  # past the largest known input: an ordinary fake tensor
            big = mask.view(2, 1, 3).repeat(1, 3, 1)  # larger than nonzero of a known input: not computed
            assert big.constant is None and mask.constant is not None and big.shape == (2, 3, 3)
        assert fake_tensor.CONSTANT_NUMEL_LIMIT == limit
        with known_values({"x": x}):  # no known input: nothing changes
            assert fake_tensor.CONSTANT_NUMEL_LIMIT == limit and torch.zeros(1, 2).constant is None
