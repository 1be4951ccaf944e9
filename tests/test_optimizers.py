"""The optimizers by name: each is its library's class, its state after a real CPU step is what the library keeps
(counted from its ``optimizer.state`` storages, and from the layout its docs give), the update's temporaries are
what the CPU allocator saw, and an estimate on fake tensors equals the real tracked run to the byte."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import typing

import diffusers
import pytest
import torch
from oracles import tracked_and_profiled, tracked_steps
from torch._subclasses.fake_tensor import FakeTensorMode

import memkit
from memkit.cli import main
from memkit.memory.events import CUDA_BLOCK, round_alloc
from memkit.optimizers import EXTRA, OPTIMIZERS, MissingLibraryError, OptimizerName, make_optimizer

# `make test-fast` keeps these cases (tests/conftest.py): a plain, an 8-bit and a factored optimizer; every optimizer
# runs in `make test` and CI
FAST_CASES = {
    "test_the_updates_temporaries_are_what_the_cpu_allocator_saw": {"adamw", "adamw8bit", "came"},
    "test_an_estimate_on_cpu_equals_the_real_first_and_steady_step": {"adamw-bf16", "adamw8bit-fp32", "came-bf16"},
}

bnb = pytest.importorskip("bitsandbytes")
prodigyopt = pytest.importorskip("prodigyopt")
came_pytorch = pytest.importorskip("came_pytorch")

CLASSES = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "adamw8bit": bnb.optim.AdamW8bit,
    "paged-adamw8bit": bnb.optim.PagedAdamW8bit,
    "adafactor": torch.optim.Adafactor,
    "prodigy": prodigyopt.Prodigy,
    "came": came_pytorch.CAME,
    "lion": bnb.optim.Lion,
}
OPTIONAL = {"adamw8bit": "bitsandbytes", "paged-adamw8bit": "bitsandbytes", "lion": "bitsandbytes"}
OPTIONAL |= {"prodigy": "prodigyopt", "came": "came_pytorch"}
PACKAGES = {"bitsandbytes": "bitsandbytes", "prodigyopt": "prodigyopt", "came_pytorch": "came-pytorch"}

BLOCK = 256  # bitsandbytes 0.50's blocksize for 8-bit optimizer state
MIN_8BIT = 4096  # below this many elements bitsandbytes keeps fp32 state
PAGED_FROM = 100_000  # from this many elements a paged optimizer's moments are CUDA managed memory


class Net(torch.nn.Module):
    """A matrix above the 8-bit threshold whose size is no multiple of 256 (6,720 elements: 27 blocks), one above
    the paged threshold (101,376), vectors below both, and a 3-D weight (Adafactor and CAME factor its last two
    dimensions). No parameter is all zeros (as in memkit's presets: Prodigy keeps a 0-dim ``p0`` for one, which an
    estimate on fake tensors cannot know)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(70, 96)
        self.norm = torch.nn.LayerNorm(96)
        self.fc2 = torch.nn.Linear(96, 1056)
        self.scale = torch.nn.Parameter(torch.rand(8, 11, 12) + 0.5)
        with torch.no_grad():
            self.norm.bias.uniform_(-0.1, 0.1)

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))
        return h.view(-1, 8, 11, 12) * self.scale


def net(dtype: torch.dtype = torch.float32):
    """A builder of :class:`Net` in ``dtype`` by construction (an estimate refuses ``.to()``)."""

    def build():
        torch.manual_seed(0)
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return Net()
        finally:
            torch.set_default_dtype(before)

    return build


def net_inputs(model):
    dtype = next(model.parameters()).dtype
    return {"x": torch.ones(16, 70, dtype=dtype)}


def state_storages(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """The oracle: each storage in ``optimizer.state`` once (storage key -> bytes), independent of the tracker."""
    out = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out[v.untyped_storage()._cdata] = v.untyped_storage().nbytes()
    return out


def documented_state(name: str, params: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """(device storages, paged storages) the library keeps after its first step, from the layout its docs give
    (memkit.optimizers' catalogue), by shape and dtype alone: the test a silently swapped optimizer fails."""
    device, paged = [], []
    for p in params:
        n, b = p.numel(), p.element_size()
        # a factored second moment: one entry per row (all but the last dim) and per column (all but the one before)
        rows, cols = (math.prod(p.shape[:-1]), math.prod(p.shape[:-2]) * p.shape[-1]) if p.dim() >= 2 else (0, 0)
        if name in ("adamw", "adam"):
            device += [n * b, n * b, 4]  # moments, 0-dim fp32 step
        elif name == "sgd":
            device += [n * b]
        elif name in ("adamw8bit", "paged-adamw8bit"):
            if n < MIN_8BIT:
                device += [4 * n, 4 * n]
            else:
                moments = paged if name.startswith("paged") and n >= PAGED_FROM else device
                moments += [n, n]
                device += [4 * -(-n // BLOCK)] * 2  # absmax per block, each moment
        elif name == "adafactor":
            device += [b * rows, b * cols] if p.dim() >= 2 else [b * n]
            device += [4]
        elif name == "prodigy":
            device += [n * b] * 4  # exp_avg, exp_avg_sq, s, p0
        elif name == "came":
            device += [4 * n, b]  # fp32 first moment, RMS in the parameter's dtype
            device += [4 * rows, 4 * cols] * 2 if p.dim() >= 2 else [4 * n]  # second moment, instability
        elif name == "lion":
            device += [4 * n]
    if name in ("adamw8bit", "paged-adamw8bit") and any(p.numel() >= MIN_8BIT for p in params):
        device += [256 * 4, 256 * 4]  # the two quantization maps, shared by every parameter
    return device, paged


def real_steps(name: str, n: int, build=None, inputs=net_inputs) -> tuple[list[memkit.Timeline], object]:
    """Steps 1..n of a real CPU training loop, each tracked in its own window; and the runner."""
    model = (build or net())()
    x = inputs(model)
    runner = memkit.Step(optimizer=name, steps=1).bind(model)
    return tracked_steps(runner, x, n), runner


def end_state(tl: memkit.Timeline) -> int:
    return tl.bytes_by_category_at(len(tl) - 1)["optimizer_state"]


# ---- names, classes, errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_name_builds_its_librarys_class(name):
    opt = make_optimizer(name, Net().parameters())
    assert isinstance(opt, CLASSES[name])
    others = [c for n, c in CLASSES.items() if n != name and not issubclass(CLASSES[name], c)]
    assert not any(isinstance(opt, c) for c in others), type(opt).__mro__
    assert getattr(opt, "is_paged", False) == (name == "paged-adamw8bit")
    runner = memkit.Step(optimizer=name).bind(Net())
    assert isinstance(runner.optimizer, CLASSES[name])


def test_the_names_the_type_hint_and_the_cli_agree():
    assert typing.get_args(OptimizerName) == OPTIMIZERS
    assert typing.get_type_hints(memkit.Step)["optimizer"] == typing.Optional[OptimizerName]  # noqa: UP045
    assert memkit.step.OPTIMIZERS is OPTIMIZERS and memkit.step.make_optimizer is make_optimizer
    assert set(CLASSES) == set(OPTIMIZERS)


def test_an_unknown_name_is_refused_naming_the_argument_and_the_names(capsys):
    for call in (
        lambda: make_optimizer("lamb", []),
        lambda: memkit.Step(optimizer="lamb"),
        lambda: memkit.estimate("flux", size="tiny", optimizer="lamb"),
    ):
        with pytest.raises(ValueError, match="optimizer must be .*one of") as e:
            call()
        assert all(repr(n) in str(e.value) for n in OPTIMIZERS) and "'lamb'" in str(e.value)
    assert main(["estimate", "flux", "--optimizer", "lamb"]) == 2
    assert "argument --optimizer: invalid choice: 'lamb'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_a_missing_library_names_the_optimizer_the_package_and_the_extra(name, monkeypatch, capsys):
    module = OPTIONAL[name]
    getattr(diffusers, memkit.PRESETS["flux"].model_class)  # diffusers imports bitsandbytes with its Flux model
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    message = rf"optimizer='{name}' needs {PACKAGES[module]}.*pip install \"memkit\[{EXTRA}\]\""
    with pytest.raises(MissingLibraryError, match=message) as e:
        make_optimizer(name, Net().parameters())
    assert isinstance(e.value, ImportError)
    with pytest.raises(MissingLibraryError, match=message):
        memkit.Step(optimizer=name).bind(Net())
    with pytest.raises(MissingLibraryError, match=message):
        memkit.estimate(net(), net_inputs, optimizer=name, memoize=False)
    assert main(["estimate", "flux", "--size", "tiny", "--optimizer", name]) == 2
    err = capsys.readouterr().err
    assert f"memkit[{EXTRA}]" in err and "Traceback" not in err


@pytest.mark.slow  # a fresh interpreter
def test_the_optional_libraries_are_imported_only_when_used():
    code = (
        "import sys, memkit, memkit.cli, memkit.step, memkit.estimation\n"
        "from memkit.optimizers import make_optimizer, OPTIMIZERS\n"
        "import torch\n"
        "make_optimizer('adamw', [torch.nn.Parameter(torch.ones(2))])\n"
        "loaded = [m for m in ('bitsandbytes', 'prodigyopt', 'came_pytorch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- real CPU steps ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_after_one_real_step_is_what_the_library_keeps(name, dtype):
    (tl,), runner = real_steps(name, 1, net(dtype))
    storages = state_storages(runner.optimizer)
    device, paged = documented_state(name, list(runner.model.parameters()))
    assert end_state(tl) == sum(storages.values())  # the tracker counts every state storage, once
    assert sorted(storages.values()) == sorted(device + paged)  # on a CPU paged state is plain memory
    # all of it made in the step, but bitsandbytes' two quantization maps, made with the optimizer
    qmaps = 2 * 256 * 4 if name.endswith("8bit") else 0
    assert tl.baseline_by_category["optimizer_state"] == qmaps


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_updates_temporaries_are_what_the_cpu_allocator_saw(name):
    # The first update alone, under the tracker and torch.profiler: every byte the step allocates (state and
    # temporaries, bitsandbytes' CPU kernel's dequantized moments included) is in the tracker's peak.
    model = net()()
    opt = make_optimizer(name, model.parameters())
    memkit.step.model_output(model(**net_inputs(model))).float().pow(2).mean().backward()
    tl, (peak, end) = tracked_and_profiled(opt.step, model=model, optimizer=opt)
    assert tl.peak_bytes - tl.baseline_bytes == peak
    made = sum(state_storages(opt).values()) - tl.baseline_by_category["optimizer_state"]  # qmaps: at construction
    assert tl.end_bytes - tl.baseline_bytes == end == made
    assert tl.peak_phase == "optimizer"


def test_bitsandbytes_cpu_kernel_runs_in_the_tracker_and_gives_the_same_update():
    # memkit calls bitsandbytes' own CPU kernel in place of its opaque op while a tracker is active: the same
    # parameters bit for bit, and the kernel's fp32 copies of the moments visible (peak above the state's end)
    def steps(tracked: bool):
        model = net()()
        runner = memkit.Step(optimizer="adamw8bit", steps=1).bind(model)
        x = net_inputs(model)
        for _ in range(2):
            if tracked:
                with memkit.track(inputs=x, **runner.tracked_objects()) as tl:
                    runner.run(x)
            else:
                runner.run(x)
        return [p.detach().clone() for p in model.parameters()], tl if tracked else None

    plain, _ = steps(False)
    seen, tl = steps(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, seen, strict=True))
    df = tl.to_pandas()
    ops = set(df[df.phase == "optimizer"].op)
    assert "bitsandbytes.dequantize_blockwise.default" in ops  # the kernel's inside, seen op by op


# ---- estimates -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_estimate_on_cpu_equals_the_real_first_and_steady_step(name, dtype):
    (first, steady), runner = real_steps(name, 2, net(dtype))
    tl = memkit.estimate(net(dtype), net_inputs, optimizer=name, device="cpu", dtype=dtype)
    assert tl.meta["first_step_peak_bytes"] == first.peak_bytes
    assert tl.meta["steady_peak_bytes"] == steady.peak_bytes
    start = tl.meta["step_starts"][1]
    assert tl.bytes_by_category_at(start - 1)["optimizer_state"] == steady.baseline_by_category["optimizer_state"]
    assert tl.peak_between(start) == steady.peak_bytes
    assert steady.baseline_by_category["optimizer_state"] == sum(state_storages(runner.optimizer).values())
    assert tl.meta["host_bytes"] == {} and tl.meta["lower_bound_ops"] == []


@pytest.mark.parametrize("name", ["adamw8bit", "adafactor", "prodigy", "came"])
def test_an_estimate_of_a_later_step_runs_the_untracked_steps_on_fake_tensors_too(name):
    (*_, third), _ = real_steps(name, 3, net())
    tl = memkit.estimate(net(), net_inputs, optimizer=name, device="cpu", dtype=torch.float32, steps=3)
    assert tl.peak_bytes == third.peak_bytes


@pytest.mark.parametrize("steps", [None, 3])
def test_a_cuda_estimate_keeps_paged_moments_in_host_memory(steps):
    # bitsandbytes pages the moments of parameters of 100,000 elements or more (CUDA managed memory, outside the
    # caching allocator): fc2's two uint8 moments, unrounded, whether the window saw them made or not
    paged = memkit.estimate(net(torch.bfloat16), net_inputs, optimizer="paged-adamw8bit", steps=steps)
    plain = memkit.estimate(net(torch.bfloat16), net_inputs, optimizer="adamw8bit", steps=steps)
    moments = 2 * Net().fc2.weight.numel()
    assert moments % CUDA_BLOCK == 0  # so the device timeline drops exactly these bytes
    assert paged.meta["host_bytes"] == {"optimizer_state": moments}
    assert plain.meta["host_bytes"] == {}
    assert paged.peak_bytes == plain.peak_bytes - moments
    cpu = memkit.estimate(net(torch.bfloat16), net_inputs, optimizer="paged-adamw8bit", device="cpu", steps=steps)
    assert cpu.meta["host_bytes"] == {}  # on a CPU there is no paging


def test_a_cuda_estimate_runs_bitsandbytes_update_as_its_fused_kernel():
    # on CUDA the 8-bit update is one fused in-place kernel (bitsandbytes' fake kernel: no allocation); on the CPU
    # its Python kernel dequantizes the moments to fp32
    def update(device):
        tl = memkit.estimate(net(torch.bfloat16), net_inputs, optimizer="adamw8bit", steps=2, device=device)
        df = tl.to_pandas()
        return df[(df.phase == "optimizer") & (df.action == "alloc")]

    assert update("cuda").empty  # the steady step: its state exists, and the update allocates nothing
    cpu = update("cpu")
    assert "bitsandbytes.dequantize_blockwise.default" in set(cpu.op)
    assert cpu.bytes.max() == 4 * Net().fc2.weight.numel()  # an fp32 copy of the largest moment


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_estimate_of_tiny_flux_equals_the_real_tracked_run(name):
    dtype = torch.bfloat16
    build = lambda: memkit.load_model("flux", dtype=dtype)  # noqa: E731
    (first, steady), runner = real_steps(name, 2, build, memkit.make_inputs)
    tl = memkit.estimate("flux", size="tiny", optimizer=name, device="cpu", dtype=dtype)
    assert (tl.meta["first_step_peak_bytes"], tl.meta["steady_peak_bytes"]) == (first.peak_bytes, steady.peak_bytes)
    start = tl.meta["step_starts"][1]
    state = sum(state_storages(runner.optimizer).values())
    assert tl.bytes_by_category_at(start - 1)["optimizer_state"] == steady.baseline_by_category["optimizer_state"]
    assert steady.baseline_by_category["optimizer_state"] == state
    assert (
        first.peak_by_category()
        == memkit.estimate("flux", size="tiny", optimizer=name, device="cpu", dtype=dtype, steps=1).peak_by_category()
    )


# In CI: one optimizer per state layout (fp32 moments, bitsandbytes' 8-bit blocks, paged host moments, factored
# rows and columns); the others in `make test-extended` (~10-25 s each at full size). Their state at tiny size is
# checked against the library in CI (test_state_after_one_real_step_is_what_the_library_keeps).
FULL_SIZE_CI = {"adamw", "adamw8bit", "came"}  # paged-adamw8bit (18 s): its state is adamw8bit's, in make test-extended


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [n if n in FULL_SIZE_CI else pytest.param(n, marks=pytest.mark.extended) for n in OPTIMIZERS]
)
def test_a_full_size_estimate_keeps_the_documented_state(name):
    # full Flux in bf16 on a GPU: the state at the steady step's start is the documented layout of every
    # parameter, each storage rounded to the allocator's 512-byte blocks; paged moments in host memory
    tl = memkit.estimate("flux", optimizer=name, progress=False)
    with FakeTensorMode():
        params = list(memkit.load_model("flux", size="full", dtype=torch.bfloat16).parameters())
    device, paged = documented_state(name, params)
    start = tl.meta["step_starts"][1]
    state = tl.bytes_by_category_at(start - 1)["optimizer_state"]
    assert state == sum(round_alloc(n, CUDA_BLOCK) for n in device)
    assert tl.meta["host_bytes"].get("optimizer_state", 0) == sum(paged)
    assert tl.meta["memoized"] == (name != "paged-adamw8bit")  # host state is not spliced


@pytest.mark.slow
@pytest.mark.parametrize(
    # CI time: CAME (12 s) with prodigy and adafactor in make test-extended; 8-bit AdamW's splice in CI
    "name",
    ["adamw8bit", *(pytest.param(n, marks=pytest.mark.extended) for n in ("came", "prodigy", "adafactor"))],
)
def test_a_memoized_estimate_equals_running_every_block(name):
    from test_memo import assert_same, both, deep

    assert_same(*both(deep("flux"), optimizer=name, device="cpu"))


def test_the_command_line_estimates_with_each_optimizer(capsys):
    code = main(["estimate", "flux", "--size", "tiny", "--optimizer", "adamw8bit", "--json"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["optimizer"] == "adamw8bit"
