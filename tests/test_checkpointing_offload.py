"""Checkpointing provider "offload": a checkpointed block's kept inputs wait in CPU memory until its recompute.

This machine has no GPU, so the block's device and CPU memory are the same thing. Two kinds of test follow:
- the real CPU path: nothing to move, so the provider must copy nothing and be exactly provider "torch";
- the moving path, with a stand-in: ``_offload_target`` (the one function that decides where a block's inputs
  wait) is pointed at a *separate copy in CPU memory* for CPU tensors, so the real copy-down / copy-back code
  runs. The stand-in shows that the block's own inputs are released after the forward, that the recompute
  reads only the copies, that one copy goes down per input in the forward and comes back only in the backward,
  and that gradients do not change. It cannot show the device memory going down (the copies live in the same
  memory the tracker counts), the pinned, non-blocking CUDA copies, or the RNG state of a CUDA block's dropout.
"""

import gc
import warnings
import weakref

import pytest
import torch
from _cpu_estimate import estimate_cpu

import memkit
from memkit.optimizations import checkpointing as ck
from memkit.optimizations import parse

# `make test-fast` keeps one preset of each block layout (tests/conftest.py); every preset runs in `make test` and CI
FAST_CASES = {"test_same_outputs_and_gradients_on_the_cpu_and_through_the_stand_in": {"flux", "wan", "pixart", "unet"}}

_CPU_ONLY = "checkpointing provider='offload': the blocks' inputs are in CPU memory already"


@pytest.fixture
def stand_in(monkeypatch):
    """Treat CPU tensors as if on a device: their kept copies go to a separate tensor in CPU memory."""
    monkeypatch.setattr(ck, "_offload_target", lambda device: torch.device("cpu"))


@pytest.fixture
def copies(monkeypatch):
    """Count the copies down (to the host) and back (to the device), by phase: 'forward' until set otherwise."""
    counts = {"phase": "forward", "down": {"forward": 0, "backward": 0}, "back": {"forward": 0, "backward": 0}}
    to_host, to_device = ck._to_host, ck._to_device

    def down(t, host):
        counts["down"][counts["phase"]] += 1
        return to_host(t, host)

    def back(t, device):
        counts["back"][counts["phase"]] += 1
        return to_device(t, device)

    monkeypatch.setattr(ck, "_to_host", down)
    monkeypatch.setattr(ck, "_to_device", back)
    return counts


def _run(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # DiT drops class labels at random in training
    out = memkit.step.model_output(model(**inputs))
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, ref):
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
    assert got[1].keys() == ref[1].keys()
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.filterwarnings("ignore:checkpointing provider=.offload.")  # the CPU-only notice
@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_same_outputs_and_gradients_on_the_cpu_and_through_the_stand_in(preset, monkeypatch):
    model = memkit.load_model(preset)  # fp32
    inputs = memkit.make_inputs(model)
    ref = _run(model, inputs)
    for pattern in ("all", "every:2"):
        with memkit.Checkpointing(pattern=pattern, provider="offload").apply(model):
            _assert_same(_run(model, inputs), ref)  # the CPU path: nothing moves
            with monkeypatch.context() as m:
                m.setattr(ck, "_offload_target", lambda device: torch.device("cpu"))
                _assert_same(_run(model, inputs), ref)  # the moving path


class _Stack(torch.nn.Module):
    def __init__(self, n: int, dim: int = 64):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
            for _ in range(n)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_the_stand_in_frees_the_blocks_own_inputs_and_recomputes_from_the_copies(stand_in, copies):
    # Block i > 0 reads the previous block's output; "torch" keeps it alive for the recompute, "offload" keeps
    # only its copy (block 0's input is the caller's x, alive anyway).
    torch.manual_seed(0)
    model, x = _Stack(4), torch.randn(32, 64, requires_grad=True)
    model(x).pow(2).sum().backward()
    ref = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    alive = {}
    for provider in ("torch", "offload"):
        seen = []
        record = lambda module, args, seen=seen: seen.append(weakref.ref(args[0]))  # noqa: E731
        hooks = [b.register_forward_pre_hook(record) for b in model.blocks]
        model.zero_grad(set_to_none=True)
        x.grad = None
        with memkit.Checkpointing(provider=provider).apply(model):
            loss = model(x).pow(2).sum()
            for h in hooks:
                h.remove()
            gc.collect()
            alive[provider] = [r() is not None for r in seen]
            copies["phase"] = "backward"
            loss.backward()
            copies["phase"] = "forward"
        for g, r in zip([x.grad] + [p.grad for p in model.parameters()], ref, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    assert alive == {"torch": [True] * 4, "offload": [True, False, False, False]}
    # one copy down per block input in the forward; back only in the backward, one per recompute
    assert copies["down"] == {"forward": 4, "backward": 0}
    assert copies["back"] == {"forward": 0, "backward": 4}


def test_the_stand_in_keeps_the_inputs_off_the_device_in_exact_bytes(stand_in):
    # At the start of the backward, "torch" keeps blocks 1..3's inputs (activations; block 0's is the input x).
    # "offload" keeps none of them on the device: their copies (and x's) are made under off_device(), so the
    # tracker counts them as host memory, 4 inputs at most. Had it kept the originals too, the device would
    # hold as much as "torch".
    torch.manual_seed(0)
    model, inputs = _Stack(4), {"x": torch.randn(32, 64)}
    one_input = 32 * 64 * 4
    kept, host = {}, {}
    for provider in ("torch", "offload"):
        with memkit.Checkpointing(provider=provider).apply(model), memkit.track(model, inputs=inputs) as tl:
            memkit.train_step(model, inputs)
        model.zero_grad(set_to_none=True)
        events = tl.to_pandas()
        kept[provider] = tl.bytes_by_category_at(int(events.index[events.phase == "backward"][0]))["activation"]
        host[provider] = tl.meta["host_peak_bytes"]
    assert kept["torch"] - kept["offload"] == 3 * one_input, kept
    assert host == {"torch": 0, "offload": 4 * one_input}


@pytest.mark.slow
def test_an_estimate_for_cuda_moves_the_inputs_off_the_gpu_and_one_for_the_cpu_does_not():
    kw = dict(size="small", dtype=torch.bfloat16, progress=False)
    kept, host = {}, {}
    for device in ("cuda", "cpu"):
        for provider in ("torch", "offload"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the CPU-only notice
                tl = estimate_cpu(
                    "ltx-video", optimizations=[memkit.Checkpointing(provider=provider)], device=device, **kw
                )
            events = tl.to_pandas()
            at = int(events.index[events.phase == "backward"][0])
            kept[device, provider] = tl.bytes_by_category_at(at)["activation"]
            host[device, provider] = tl.meta["host_bytes"].get("activation", 0)
    # the block inputs on the GPU at the start of the backward are in host memory instead, one copy each
    # (the conditioning every block reads is copied once); on the CPU nothing moves
    assert kept["cuda", "offload"] < kept["cuda", "torch"]
    saved = kept["cuda", "torch"] - kept["cuda", "offload"]
    # host memory holds them in exact bytes, the GPU in the caching allocator's 512-byte blocks
    assert saved > 0 and 0.99 * saved <= host["cuda", "offload"]
    assert kept["cpu", "offload"] == kept["cpu", "torch"] and host["cpu", "offload"] == host["cuda", "torch"] == 0


def test_a_diffusers_model_copies_each_tensor_down_once_and_back_per_block_in_the_backward(stand_in, copies):
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model)
    names = {id(m): n for n, m in model.named_modules()}
    per_block, everything = {}, {}
    real = ck._run_offloaded

    def spy(fn, *args, **kwargs):
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        per_block[names[id(fn.__self__)]] = len({id(t) for t in tensors})
        everything.update({id(t): t for t in tensors})  # held: ids stay distinct
        return real(fn, *args, **kwargs)

    with memkit.Checkpointing(provider="offload").apply(model):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(ck, "_run_offloaded", spy)
            model.zero_grad(set_to_none=True)
            loss = memkit.step.model_output(model(**inputs)).pow(2).mean()
        copies["phase"] = "backward"
        loss.backward()
    assert list(per_block) == [name for name, _ in memkit.Checkpointing().select(model)]  # in the order they ran
    n = sum(per_block.values())  # each block's distinct tensors: each comes back once for its recompute
    assert n >= 2 * len(per_block)  # at least hidden states and the conditioning per block
    assert len(everything) < n  # the blocks share the conditioning: copied down once, not once per block
    assert copies["down"] == {"forward": len(everything), "backward": 0}
    assert copies["back"] == {"forward": 0, "backward": n}


def test_a_tensor_changed_in_place_between_blocks_is_copied_again(stand_in, copies):
    shared = torch.randn(4, 8)
    blocks = [torch.nn.Linear(8, 8) for _ in range(2)]
    x = torch.randn(4, 8, requires_grad=True)
    ck._run_offloaded(lambda a, b: blocks[0](a + b), x, shared)
    ck._run_offloaded(lambda a, b: blocks[1](a + b), x, shared)
    assert copies["down"]["forward"] == 2  # x and shared, once each
    shared.mul_(2)  # its version changes: the copy would be stale
    ck._run_offloaded(lambda a, b: blocks[1](a + b), x, shared)
    assert copies["down"]["forward"] == 3


def test_on_the_cpu_nothing_moves_the_peak_is_torchs_and_it_says_so_once(monkeypatch):
    monkeypatch.setattr(memkit.optimizations._common, "_warned", set())

    def no_copy(*args):
        raise AssertionError("provider 'offload' copied a tensor on a CPU-only run")

    monkeypatch.setattr(ck, "_to_host", no_copy)
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model, height=128, width=128)
    timelines = {}
    with pytest.warns(UserWarning) as record:
        for provider in ("torch", "offload", "offload"):
            with memkit.Checkpointing(provider=provider).apply(model), memkit.track(model, inputs=inputs) as tl:
                memkit.train_step(model, inputs)
            model.zero_grad(set_to_none=True)
            timelines.setdefault(provider, tl)
    said = [str(w.message) for w in record if str(w.message).startswith(_CPU_ONLY)]
    assert len(said) == 1, said  # two steps, two blocks each: said once
    assert "as provider='torch'" in said[0]
    assert timelines["offload"].peak_bytes == timelines["torch"].peak_bytes
    assert timelines["offload"].peak_by_category() == timelines["torch"].peak_by_category()


@pytest.mark.filterwarnings("ignore:checkpointing provider=.offload.")  # the CPU-only notice
def test_remove_restores_the_model(stand_in):
    model = memkit.load_model("flux")
    before = {
        name: (m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", "absent"))
        for name, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    }
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with memkit.Checkpointing(provider="offload").apply(model) as handle:
        _run(model, memkit.make_inputs(model))
    assert not handle.active
    after = {
        name: (m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", "absent"))
        for name, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    }
    assert after == before
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    stack = _Stack(3)
    with memkit.Checkpointing(provider="offload").apply(stack):
        assert all("forward" in vars(b) for b in stack.blocks)
        stack(torch.randn(2, 64)).sum().backward()
    assert not any("forward" in vars(b) for b in stack.blocks)


def test_parse_names_and_registry():
    config = memkit.Checkpointing.parse("all@offload")
    assert config == memkit.Checkpointing(pattern="all", provider="offload")
    assert str(config) == "checkpointing:all@offload"
    assert parse("checkpointing:all@offload") == config
    assert memkit.Checkpointing.parse("every:2@offload") == memkit.Checkpointing(pattern="every:2", provider="offload")
    assert "all@offload" in memkit.optimizations.REGISTRY["checkpointing"].choices
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memkit.Checkpointing(provider="offload")  # configuring warns nothing: only a CPU-only run does


def test_in_an_estimate_for_cuda_the_inputs_go_to_cpu_memory_and_in_one_for_the_cpu_nothing_moves(copies):
    # The fake CPU tensors of an estimate for "cuda" stand for device ones: the real copy-down runs for them.
    from memkit.memory.placement import planning

    torch.manual_seed(0)
    model, x = _Stack(3), torch.randn(4, 64)
    down = {}
    for device in ("cuda", "cpu"):
        copies["down"]["forward"] = 0
        with planning(device), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CPU-only notice
            with memkit.Checkpointing(provider="offload").apply(model):
                model(x).sum().backward()
        down[device] = copies["down"]["forward"]
    assert down == {"cuda": 3, "cpu": 0}  # one per block input; none when the blocks' memory is CPU memory


def test_a_host_copy_is_released_with_the_tensor_it_copies(stand_in, monkeypatch):
    made, to_host = [], ck._to_host
    monkeypatch.setattr(ck, "_to_host", lambda t, host: made.append(to_host(t, host)) or made[-1])
    x = torch.randn(4, 8, requires_grad=True)
    ck._run_offloaded(torch.nn.Linear(8, 8), x).sum().backward()
    [copy] = made
    made.clear()
    copy = weakref.ref(copy)
    gc.collect()
    assert copy() is not None  # kept while x lives: the next block that reads x reuses it
    del x
    gc.collect()
    assert copy() is None


def test_in_an_estimate_for_cuda_the_recompute_reads_a_copy_back_not_the_host_copy(monkeypatch):
    # The copy back is a new tensor on the block's device: an estimate for "cuda" counts it there. Reading the host
    # copy itself would leave it out of the device's backward.
    from memkit.memory.placement import planning

    host_copies, to_host = [], ck._to_host
    monkeypatch.setattr(ck, "_to_host", lambda t, host: host_copies.append(to_host(t, host)) or host_copies[-1])
    torch.manual_seed(0)
    model, x = _Stack(2), torch.randn(4, 64)
    read = []
    first = model.blocks[1][0]  # the block's first layer reads its input, in the forward and in the recompute
    first.register_forward_pre_hook(lambda module, args: read.append(args[0].untyped_storage().data_ptr()))
    with planning("cuda"), memkit.Checkpointing(provider="offload").apply(model):
        model(x).sum().backward()
    kept = {t.untyped_storage().data_ptr() for t in host_copies}
    assert len(read) == 2 and read[1] not in kept  # the forward, then the recompute


def test_a_tensor_passed_twice_to_a_block_comes_back_once(stand_in, copies):
    x = torch.randn(4, 8, requires_grad=True)
    out = ck._run_offloaded(lambda a, b: torch.tanh(a * b), x, x)
    copies["phase"] = "backward"
    out.sum().backward()
    assert copies["down"] == {"forward": 1, "backward": 0} and copies["back"] == {"forward": 0, "backward": 1}
