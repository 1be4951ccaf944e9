"""memkit.Offload: the same outputs, gradients and updates as the model in memory, real state_dict values while
offloaded, exact restore, safe files, and its place in the registry, estimate and CLI."""

import copy
import errno
import json
import os
import warnings

import pytest
import torch
from _cpu_estimate import estimate_cpu
from torch import nn

import memkit
from memkit.optimizations import _offload_file as file_mod
from memkit.optimizations import _offload_store as store_mod
from memkit.optimizations import offload as offload_mod
from memkit.optimizations.offload import Offload, OffloadError, onloaded
from memkit.presets import PRESETS
from memkit.step import Step, model_output

# `make test-fast` keeps one preset of each block layout (tests/conftest.py); every preset runs in `make test` and CI
FAST_CASES = {"test_block_level_also_offloads_the_layers_outside_the_blocks": {"flux", "wan", "pixart", "unet"}}

TOL = 1e-6


@pytest.fixture
def cpu_moves(monkeypatch):
    """Run to="cpu" on the CPU through the copying path CUDA takes (else it is a no-op here)."""
    monkeypatch.setattr(offload_mod, "_CPU_MOVES", True)


def _pair(preset: str, seed: int = 0):
    ref = memkit.load_model(preset, seed=seed)
    return ref, copy.deepcopy(ref), memkit.make_inputs(ref, seed=seed)


def _max_diff(xs, ys) -> float:
    return max(((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True) if x.numel()), default=0.0)


def _run(net, inputs):
    """The output, with the same random numbers on every call (DiT's label dropout draws some in train mode)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_output(net(**inputs))


def _assert_same_training(ref, model, inputs, steps: int = 3, lr: float = 1e-2):
    """Inference output, then ``steps`` training steps (forward, backward, AdamW step) equal to ``TOL``."""
    with torch.no_grad():
        assert _max_diff([_run(ref, inputs)], [_run(model, inputs)]) <= TOL
    opt_r = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt_m = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        outs = []
        for net in (ref, model):
            out = _run(net, inputs)
            outs.append(out.detach().clone())
            out.float().pow(2).mean().backward()
        assert _max_diff(*[[o] for o in outs]) <= TOL
        grads = [[p.grad for p in net.parameters()] for net in (ref, model)]
        # every parameter the model in memory trains gets its gradient (Qwen-Image's last block has dead weights)
        live = [(r, g) for r, g in zip(*grads, strict=True) if r is not None]
        assert all(g is not None for _, g in live) and _max_diff(*zip(*live, strict=True)) <= TOL
        opt_r.step(), opt_m.step()
        opt_r.zero_grad(), opt_m.zero_grad()
    with torch.no_grad():  # the updates were written back: a fresh forward reads them from the store
        model(**inputs)
        assert _max_diff([_run(ref, inputs)], [_run(model, inputs)]) <= TOL
    ref_state, state = ref.state_dict(), model.state_dict()
    assert _max_diff(list(ref_state.values()), [state[k] for k in ref_state]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("group", ["block", "leaf"])
@pytest.mark.parametrize("to", ["disk", "cpu"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_outputs_and_three_training_steps_equal_the_model_in_memory(preset, to, group, cpu_moves, tmp_path):
    ref, model, inputs = _pair(preset)
    with Offload(to=to, group=group, path=tmp_path if to == "disk" else None).apply(model) as handle:
        assert handle.offloader.groups, "nothing was offloaded"
        _assert_same_training(ref, model, inputs)
        assert handle.offloader.loads > len(handle.offloader.groups)  # groups really came and went


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("preset", ["unet", "flux"])
def test_prefetch_depths_give_the_same_training(preset, prefetch, tmp_path):
    ref, model, inputs = _pair(preset)
    with Offload(to="disk", prefetch=prefetch, path=tmp_path).apply(model) as handle:
        _assert_same_training(ref, model, inputs, steps=2)
        groups = handle.offloader.groups
        assert sum(g.real is not None for g in groups) == 0  # inference leaves none behind
        memkit.train_step(model, inputs, torch.optim.SGD(model.parameters(), lr=0.1))
        assert all(g.real is not None for g in groups)  # after an optimizer step: all, until the next forward


def test_training_keeps_only_the_groups_in_use():
    """Saved views of offloaded weights must not hold their storage: the parameter bytes of a tracked training
    step (no optimizer) stay far below the model's."""
    model = memkit.load_model("unet")
    inputs = memkit.make_inputs(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with Offload(to="disk", prefetch=1).apply(model) as handle:
        memkit.train_step(model, inputs)  # learns the order
        model.zero_grad(set_to_none=True)
        biggest = max(g.nbytes for g in handle.offloader.groups)
        with memkit.track(model, inputs=inputs) as tl:
            memkit.train_step(model, inputs)
    peak_params = max(tl.peak_by_category().get("parameter", 0), 0)
    resident = total - sum(g.nbytes for g in handle.offloader.groups)
    assert peak_params <= resident + 4 * biggest < total


def _mapped(folder) -> dict[str, list[tuple[int, int]]]:
    """The offload files under ``folder`` this process has mapped (``/proc/self/maps``): path -> address ranges."""
    out: dict[str, list[tuple[int, int]]] = {}
    folder = os.path.realpath(folder)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().startswith(folder):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.setdefault(fields[5].strip().removesuffix(" (deleted)"), []).append((lo, hi))
    return out


def _resident(folder) -> dict[str, int]:
    """The bytes of each offload file under ``folder`` that are in this process's memory (``/proc/self/smaps``: the
    Rss of its mappings): path -> bytes, for every file mapped."""
    out: dict[str, int] = {}
    folder, path = os.path.realpath(folder), None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if fields[0][-1] != ":":  # a mapping's first line: address range, perms, offset, dev, inode, path
                path = fields[5].strip().removesuffix(" (deleted)") if len(fields) == 6 else None
                path = path if path and path.startswith(folder) else None
            elif fields[0] == "Rss:" and path is not None:
                out[path] = out.get(path, 0) + int(fields[1]) * 1024
    return out


def _in(ranges: list[tuple[int, int]], t: torch.Tensor) -> bool:
    return any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in ranges)


needs_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")


@needs_maps
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_block_level_also_offloads_the_layers_outside_the_blocks(preset, tmp_path):
    """At block level the embedders and final layers are groups too (one per layer): what stays resident is only
    the model's own parameters and one-element ones. Every group, block or layer, computes on the one mapping of
    its own file, and once the forward is done no page of any file is in memory."""
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    own = {id(p) for p in model.parameters(recurse=False)}
    with Offload(to="disk", path=tmp_path).apply(model) as handle:
        groups, store = handle.offloader.groups, handle.offloader.store
        owned = {id(p) for g in groups for p in g.params}
        stay = [n for n, p in model.named_parameters() if id(p) not in owned]
        assert all(id(p) in own or p.numel() <= 1 for n, p in model.named_parameters() if n in stay), stay
        layers = [g for g in groups if not g.block]
        assert layers and all(len(g.modules) == 1 for g in layers)
        assert {n for g in layers for n in g.names} == {
            n for n, p in model.named_parameters()
            if id(p) not in own and p.numel() > 1 and not any(n.startswith(b.name + ".") for b in groups if b.block)
        }  # fmt: skip
        with torch.no_grad():
            model(**inputs)  # learns the order
            model(**inputs)
            computed_on: dict[int, bool] = {}

            def note(g):
                def hook(m, a):
                    ranges = _mapped(tmp_path).get(store.files[g.gid], [])
                    computed_on[g.gid] = all(_in(ranges, p) for p in g.params)

                return hook

            hooks = [m.register_forward_pre_hook(note(g)) for g in groups for m in g.modules]
            model(**inputs)
            for h in hooks:
                h.remove()
        assert computed_on == {g.gid: True for g in groups}
        maps = _mapped(tmp_path)
        assert sorted(maps) == sorted(store.files.values()) and all(len(r) == 1 for r in maps.values())  # kept
        assert set(_resident(tmp_path).values()) == {0}  # every group dropped: its pages given back


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_group_of_any_layout_loads_back_exactly_and_aligned(mapped, monkeypatch, tmp_path):
    """Mixed dtypes and sizes come back exactly, mapped (POSIX) or read into fresh memory (where files are not
    mapped); in the file, tensors whose bytes are a multiple of 64 start on a 64-byte boundary (as torch's
    allocator places them, so kernels take the same paths), the others on their element size, and safetensors
    reads the same values."""
    from safetensors import safe_open

    monkeypatch.setattr(store_mod, "_posix_mapping", lambda: mapped)
    store = store_mod.DiskStore(torch.device("cpu"), tmp_path)
    try:
        odd = {
            "h": torch.randn(3).half(), "i": torch.arange(11, dtype=torch.int64), "w": torch.randn(33, 7),
            "bf": torch.randn(2, 2).to(torch.bfloat16), "big": torch.randn(16, 16), "flag": torch.tensor([True, False]),
        }  # fmt: skip
        store.save(0, list(odd), list(odd.values()))
        assert store.map is mapped
        for _ in range(2):
            got = store.load(0)
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, odd.values(), strict=True))
            assert got[4].data_ptr() % 64 == 0  # 1 KiB: a multiple of 64
            assert all(t.data_ptr() % t.element_size() == 0 for t in got)
            assert all(t.untyped_storage()._cdata == got[0].untyped_storage()._cdata for t in got) is mapped
            del got
        assert store.mapped == (2 if mapped else 0)
        with safe_open(store.files[0], "pt") as f:
            assert all(torch.equal(f.get_tensor(k), v) for k, v in odd.items())
    finally:
        store.close()


class _Stack(nn.Module):
    """Six blocks of one layout, run in order with residuals."""

    def __init__(self, n: int = 6, d: int = 16):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


@needs_maps
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_inference_keeps_in_memory_only_the_group_in_use(prefetch, tmp_path):
    """Each block computes on its own file's mapping, the one kept for every forward; when a block ends only its
    file has pages in memory (the others' given back; a read ahead fills the page cache, not the process), and
    after each forward none: RSS holds only the group in use."""
    ref = _Stack()
    model, x = copy.deepcopy(ref), torch.randn(4, 16)
    holding, after = [], []
    with Offload(to="disk", prefetch=prefetch, path=tmp_path).apply(model) as handle:
        files = handle.offloader.store.files
        groups = handle.offloader.groups

        def record(block, args, out):
            maps = _mapped(tmp_path)
            (g,) = [g for g in groups if block in g.modules]
            assert all(_in(maps.get(files[g.gid], []), p) for p in block.parameters())
            holding.append(sorted(path for path, n in _resident(tmp_path).items() if n) == [files[g.gid]])

        hooks = [b.register_forward_hook(record) for b in model.blocks]
        with torch.no_grad():
            for _ in range(4):
                assert torch.equal(model(x), ref(x))
                after.append(sum(_resident(tmp_path).values()))
        for h in hooks:
            h.remove()
        maps = _mapped(tmp_path)
        assert len(maps) == len(model.blocks) and all(len(r) == 1 for r in maps.values())  # one each, kept
    assert holding == [True] * 4 * len(model.blocks)
    assert after == [0, 0, 0, 0]


def _stack_loss(net: nn.Module, x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "model":
        return net(x).pow(2).mean()
    out = x  # the blocks called one by one: no model forward, so no saved-tensor hooks; each linear saves a view
    for b in net.blocks:  # of its weight itself, aliasing the mapping after the offloader has let the group go
        out = out + b(out)
    return out.pow(2).mean()


@needs_maps
@pytest.mark.parametrize("how", ["model", "blocks called directly"])
def test_training_keeps_in_memory_only_the_groups_in_use(how, tmp_path):
    """3 steps (forward, backward, AdamW) equal the model in memory. Through the model the weights autograd saves
    are references, rebuilt in the backward: when the backward starts only the last block's file has pages in
    memory. Called block by block, autograd keeps views of every block's mapping for the backward, and still only
    the last block's pages are in memory on the first step: the others were given back when the offloader dropped
    their groups, and the backward reads them again from the file. (On later steps the optimizer step has
    onloaded every group, and with no model forward nothing drops them.)"""
    ref = _Stack()
    model, x = copy.deepcopy(ref), torch.randn(4, 16)
    with Offload(to="disk", prefetch=1, path=tmp_path).apply(model):
        resident_at_backward = []
        opts = [torch.optim.AdamW(net.parameters(), lr=1e-2) for net in (ref, model)]
        for _ in range(3):
            for net in (ref, model):
                loss = _stack_loss(net, x, how)
                if net is model:
                    resident_at_backward.append(sum(1 for n in _resident(tmp_path).values() if n))
                loss.backward()
            assert _max_diff([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()]) <= TOL
            for opt in opts:
                opt.step()
                opt.zero_grad()
        with torch.no_grad():
            assert _max_diff([ref(x)], [model(x)]) <= TOL
    assert _max_diff(list(ref.parameters()), list(model.parameters())) <= TOL
    if how == "model":
        assert resident_at_backward == [1, 1, 1]
    else:
        assert resident_at_backward == [1, len(model.blocks), len(model.blocks)]


def test_a_tensor_held_from_a_load_keeps_its_values_and_never_writes_the_file(tmp_path):
    """Loads of one file share its mapping, kept between loads; giving its pages back (``release``) loses nothing,
    a holder reads them again from the file. Writing into a load copies the pages it touches: the file never sees
    it. A group written back gets a new file and a new mapping, and the old one, with the holder's pages, is let go
    (never given back): a tensor held from before keeps its values."""
    store = store_mod.DiskStore(torch.device("cpu"), tmp_path)
    try:
        old = [torch.full((64, 64), 1.0), torch.full((64,), -1.0)]
        store.save(0, ["w", "b"], old)
        ahead = store.prefetch(0).result()
        held = store.load(0)
        assert held[0].untyped_storage()._cdata == ahead[0].untyped_storage()._cdata  # the kept mapping
        store.release(0)
        assert all(torch.equal(a, b) for a, b in zip(held, old, strict=True))  # read again from the file
        held[0].add_(10.0)  # copy-on-write: this mapping's pages only
        assert all(torch.equal(a, b) for a, b in zip(store.read(0), old, strict=True))
        new = [torch.full((64, 64), 2.0), torch.full((64,), -2.0)]
        store.write_back(0, new)
        store.release(0)  # nothing kept for the group now: the held pages stay
        assert torch.equal(held[0], old[0] + 10.0) and torch.equal(held[1], old[1])
        again = store.load(0)
        assert all(torch.equal(a, b) for a, b in zip(again, new, strict=True))
        assert again[0].untyped_storage()._cdata != held[0].untyped_storage()._cdata
        assert all(torch.equal(a, b) for a, b in zip(store.read(0), new, strict=True))
    finally:
        store.close()


@pytest.mark.skipif(not hasattr(os, "writev"), reason="os.writev (POSIX)")
def test_a_group_is_written_in_one_system_call(monkeypatch, tmp_path):
    """Header and tensors in one ``os.writev``: the kernel sees one long write and can fill the page cache with
    large folios, which it maps with huge pages (separate writes leave small folios at each one's start)."""
    real, calls = os.writev, []
    monkeypatch.setattr(os, "writev", lambda fd, buffers: calls.append(len(buffers)) or real(fd, buffers))
    store = store_mod.DiskStore(torch.device("cpu"), tmp_path)
    try:
        tensors = [torch.randn(64, 64), torch.randn(64), torch.randn(3)]
        store.save(0, ["w", "b", "c"], tensors)
        assert calls == [1 + len(tensors)]
        assert all(torch.equal(a, b) for a, b in zip(store.load(0), tensors, strict=True))
    finally:
        store.close()


@pytest.mark.skipif(not hasattr(os, "writev"), reason="os.writev (POSIX)")
def test_writes_cut_short_by_the_system_still_give_the_whole_file(monkeypatch, tmp_path):
    """``os.writev`` may write less than it is given (a signal, a pipe-sized limit): the rest is written after, from
    where it stopped, inside a tensor or between them, and the file loads back exactly."""
    real, calls = os.writev, []

    def short(fd, buffers):
        calls.append(1)
        head = [memoryview(b).cast("B")[:300] for b in buffers[:1]]  # at most 300 bytes a call
        return real(fd, head)

    monkeypatch.setattr(os, "writev", short)
    store = store_mod.DiskStore(torch.device("cpu"), tmp_path)
    try:
        tensors = [torch.randn(17, 9), torch.arange(5, dtype=torch.int64), torch.randn(64)]
        store.save(0, ["a", "b", "c"], tensors)
        assert len(calls) > 5
        assert all(torch.equal(a, b) for a, b in zip(store.load(0), tensors, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(store.read(0), tensors, strict=True))
    finally:
        store.close()


@needs_maps
def test_a_tracker_sees_each_mapping_as_parameter_memory_made_and_freed(tmp_path):
    """The mapped weights are allocations a tracker records when the group is loaded (the op says so) and frees
    when its pages are given back: one block's weights at prefetch 0, not the model's, and none after the
    forward."""
    model, x = _Stack(), torch.randn(4, 16)
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    with Offload(to="disk", prefetch=0, path=tmp_path).apply(model) as handle:
        with torch.no_grad():
            model(x)
            with memkit.track(model, inputs=(x,)) as tl:
                model(x)
        assert handle.offloader.store.mapped == 2 * len(model.blocks)
    events = tl.to_pandas()
    made = events[(events.op == "mmap") & (events.action == "alloc")]
    assert len(made) == len(model.blocks) and set(made.category) == {"parameter"}
    assert all(block <= n < block + 4096 for n in made.bytes)  # the file: its header, then the weights
    freed = events[(events.category == "parameter") & (events.action == "free")]
    assert sorted(freed.bytes) == sorted(made.bytes)  # each freed, as the next block is loaded
    assert tl.peak_by_category()["parameter"] < 2 * (block + 4096)
    assert tl.live_by_category()["parameter"][-1] == tl.baseline_by_category["parameter"] < 64  # placeholders


@pytest.mark.parametrize("to", ["disk", "cpu"])
def test_state_dict_has_real_values_while_offloaded_and_load_state_dict_writes_back(to, cpu_moves):
    ref, model, inputs = _pair("flux")
    other = memkit.load_model("flux", seed=1).state_dict()
    with Offload(to=to).apply(model) as handle:
        assert all(g.real is None for g in handle.offloader.groups)
        state = model.state_dict()
        assert state.keys() == ref.state_dict().keys()
        for k, v in ref.state_dict().items():
            assert torch.equal(state[k], v), k
        model.load_state_dict(other)
        with torch.no_grad():
            model(**inputs)  # offloads (writing back) and onloads again
        assert all(torch.equal(model.state_dict()[k], v) for k, v in other.items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.items())


def test_remove_restores_bit_for_bit_the_same_parameters_and_deletes_the_files(tmp_path):
    ref, model, inputs = _pair("pixart")
    params = {n: p for n, p in model.named_parameters()}
    handle = Offload(to="disk", path=tmp_path).apply(model)
    folder = handle.folder
    assert folder.startswith(str(tmp_path)) and len(os.listdir(folder)) == len(handle.offloader.groups)
    memkit.train_step(model, inputs)
    linux = os.path.exists("/proc/self/maps")
    assert any(g.real is not None for g in handle.offloader.groups)  # the backward's last groups: onloaded
    assert _mapped(tmp_path) if linux else True
    handle.remove()
    assert not os.path.exists(folder) and os.listdir(tmp_path) == []
    assert _mapped(tmp_path) == {} if linux else True  # no weight left on a deleted file's mapping (its disk space)
    assert {n: p for n, p in model.named_parameters()} == params  # same objects
    assert all(a is b for a, b in zip(params.values(), model.parameters(), strict=True))
    for (k, v), (k2, v2) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2) and v2.is_contiguous() == v.is_contiguous()
    with torch.no_grad():
        assert torch.equal(_run(ref, inputs), _run(model, inputs))
    handle.remove()  # twice: harmless


def test_files_are_safetensors_with_the_weights(tmp_path):
    from safetensors import safe_open

    ref, model, _ = _pair("dit")
    with Offload(to="disk", path=tmp_path).apply(model) as handle:
        names = dict(ref.named_parameters())
        seen = 0
        for g in handle.offloader.groups:
            with safe_open(handle.offloader.store.files[g.gid], "pt") as f:
                for key in f.keys():
                    assert torch.equal(f.get_tensor(key), names[key].detach())
                    seen += 1
        assert seen == sum(len(g.params) for g in handle.offloader.groups)


def test_two_models_never_share_files_even_given_one_folder(tmp_path):
    a, b = memkit.load_model("wan", seed=0), memkit.load_model("wan", seed=1)
    inputs = memkit.make_inputs(a)
    with torch.no_grad():
        want_a, want_b = model_output(a(**inputs)), model_output(b(**inputs))
    with Offload(to="disk", path=tmp_path).apply(a) as ha, Offload(to="disk", path=tmp_path).apply(b) as hb:
        assert ha.folder != hb.folder and os.path.dirname(ha.folder) == os.path.dirname(hb.folder) == str(tmp_path)
        with torch.no_grad():
            assert torch.equal(model_output(a(**inputs)), want_a)
            assert torch.equal(model_output(b(**inputs)), want_b)
    with pytest.raises(ValueError, match="offloaded already"):
        with Offload(to="disk").apply(a):
            Offload(to="disk").apply(a)


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written."""

    def __init__(self, path, mode, room):
        self.f, self.room = open(path, mode), room

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _fill_disk(monkeypatch, room: int, how: str = "writev") -> None:
    """Writes fail with ENOSPC once ``room`` more bytes are written: through ``os.writev`` (a short write, then the
    error, as a filling disk does) or, where there is none (``how="write"``: Windows), through ``write``."""
    if how == "write":
        monkeypatch.delattr(os, "writev")

        def fake_open(path, mode="r", *args, **kwargs):
            return _FullDisk(path, mode, room) if "w" in mode else open(path, mode, *args, **kwargs)

        monkeypatch.setattr(file_mod, "open", fake_open, raising=False)  # the module that writes the files
        return
    real, left = os.writev, [room]

    def writev(fd, buffers):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        fits, n = [], 0
        for b in buffers:
            b = memoryview(b).cast("B")[: left[0] - n]
            fits.append(b)
            n += len(b)
        done = real(fd, fits)
        left[0] -= done
        return done

    monkeypatch.setattr(os, "writev", writev)


@pytest.mark.parametrize("how", ["writev", "write"])
def test_disk_full_on_apply_raises_a_clear_error_and_leaves_the_model_unchanged(how, monkeypatch, tmp_path):
    ref, model, inputs = _pair("flux")
    _fill_disk(monkeypatch, room=1000, how=how)
    with pytest.raises(OffloadError, match="No space left on device.*stay in memory") as info:
        Offload(to="disk", path=tmp_path).apply(model)
    assert info.value.errno == errno.ENOSPC and str(tmp_path) in str(info.value)
    assert os.listdir(tmp_path) == []  # no half-written files, no folder
    monkeypatch.undo()
    for (k, v), v2 in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(v, v2), k
    _assert_same_training(ref, model, inputs, steps=1)
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("how", ["writev", "write"])
def test_disk_full_on_write_back_keeps_the_weights_in_memory_and_usable(how, monkeypatch, tmp_path):
    ref, model, inputs = _pair("flux")
    with Offload(to="disk", path=tmp_path).apply(model) as handle:
        opt_r, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))
        for net, opt in ((ref, opt_r), (model, opt_m)):
            model_output(net(**inputs)).float().pow(2).mean().backward()
            opt.step()
        _fill_disk(monkeypatch, room=0, how=how)
        with pytest.raises(OffloadError, match="No space left"):
            with torch.no_grad():
                model(**inputs)  # the forward offloads the updated groups: the write-back fails
        assert any(g.real is not None for g in handle.offloader.groups)  # kept in memory, not lost
        monkeypatch.undo()
        with torch.no_grad():
            assert _max_diff([_run(ref, inputs)], [_run(model, inputs)]) <= TOL


def test_read_only_folder_raises_a_clear_error_and_leaves_the_model_unchanged(tmp_path):
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        pytest.skip("running as root: chmod 0o500 does not stop root from writing")
    ref, model, _ = _pair("dit")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OffloadError, match="locked.*model is unchanged"):
            Offload(to="disk", path=locked).apply(model)
    finally:
        locked.chmod(0o700)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters(), strict=True))


@pytest.mark.parametrize("used", [False, True], ids=["before use", "while kept mapped"])
@pytest.mark.parametrize("damage", ["truncate", "header", "dtype"])
def test_a_damaged_file_gives_a_clear_error_on_load(damage, used, tmp_path):
    """Damaged before its first load, or after (its mapping kept: the file's inode, size and modification time are
    checked on every load, so it is mapped and checked again, never read past its end)."""
    _, model, inputs = _pair("dit")
    with Offload(to="disk", path=tmp_path, prefetch=0).apply(model) as handle:
        path = handle.offloader.store.files[0]
        if used:
            with torch.no_grad():
                model(**inputs)
            assert 0 in handle.offloader.store._kept
        raw = good = open(path, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        if damage == "truncate":
            raw = raw[: len(raw) - 7]
        elif damage == "header":
            raw = raw[:8] + b"x" + raw[9:]
        else:
            header = raw[8 : 8 + n].replace(b'"F32"', b'"I32"', 1)  # same length, another dtype
            assert header != raw[8 : 8 + n]
            raw = raw[:8] + header + raw[8 + n :]
        open(path, "wb").write(raw)
        with pytest.raises(OffloadError, match=r"(truncated|corrupt)") as info:
            with torch.no_grad():
                model(**inputs)
        assert path in str(info.value)
        assert handle.offloader.groups[0].real is None  # not half-onloaded
        open(path, "wb").write(good)  # repaired: the model works again
        with torch.no_grad():
            model(**inputs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"to": "gpu"}, r"to must be one of \['cpu', 'disk'\], got 'gpu'"),
        ({"group": "layer"}, r"group must be one of \['block', 'leaf'\], got 'layer'"),
        ({"blocks_per_group": 0}, r"blocks_per_group must be an int >= 1, got 0"),
        ({"blocks_per_group": True}, r"blocks_per_group must be an int >= 1, got True"),
        ({"prefetch": -1}, r"prefetch must be an int >= 0, got -1"),
        ({"to": "cpu", "path": "/tmp"}, r"path is only used with to='disk'"),
        ({"to": "disk", "path": 3}, r"path must be a folder"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Offload(**kwargs)


def test_parse_and_str_round_trip_and_refuse_bad_values():
    for text in ("disk", "cpu", "disk:leaf", "disk:blocks=2:prefetch=0"):
        config = Offload.parse(text)
        assert str(config) == f"offload:{text}" and Offload.parse(str(config).split(":", 1)[1]) == config
    assert Offload.parse("disk:leaf:prefetch=2") == Offload(to="disk", group="leaf", prefetch=2)
    with pytest.raises(ValueError, match=r"TO\[:GROUP\]"):
        Offload.parse("disk:sometimes")
    with pytest.raises(ValueError, match="to must be one of"):
        Offload.parse("tape")


def test_to_cpu_on_a_cpu_model_says_it_moves_nothing():
    memkit.optimizations._common._warned.clear()
    ref, model, inputs = _pair("dit")
    with pytest.warns(UserWarning, match="nothing moves"):
        handle = Offload(to="cpu").apply(model)
    assert not hasattr(handle, "offloader")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Offload(to="cpu").apply(model):  # said once
            _assert_same_training(ref, model, inputs, steps=1)


def test_ema_reads_the_real_weights_of_an_offloaded_model():
    ref, model, inputs = _pair("flux")
    results = []
    for net, offload in ((ref, False), (model, True)):
        ema = memkit.EMA(decay=0.5).apply(net)
        off = Offload(to="disk").apply(net) if offload else None
        runner = Step(optimizer="sgd").bind(net, ema)
        for _ in range(2):
            runner.run(inputs)
        with torch.no_grad():
            net(**inputs)  # offloaded again: copy_to must write back
        shadows = [s.clone() for s in ema.ema.shadow_params]
        ema.ema.copy_to(net)
        with torch.no_grad():
            net(**inputs)
            results.append((shadows, model_output(net(**inputs)).clone()))
        if off is not None:
            off.remove()
        ema.remove()
    assert _max_diff(results[0][0], results[1][0]) <= TOL
    assert _max_diff([results[0][1]], [results[1][1]]) <= TOL


def test_onloaded_gives_real_values_and_offloads_again():
    ref, model, _ = _pair("dit")
    with Offload(to="disk").apply(model) as handle:
        with onloaded(model):
            assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters(), strict=True))
        assert all(g.real is None for g in handle.offloader.groups)


def _diffusers_release() -> tuple[int, ...]:
    import diffusers

    from memkit.optimizations.offload_check import _release

    return _release(diffusers.__version__)


@pytest.mark.skipif(
    _diffusers_release() < (0, 41),
    reason="diffusers_check runs against diffusers >= 0.41 (older: refused, tested below)",
)
def test_diffusers_harness_reports_diffusers_disk_failures_and_memkit_passes():
    pytest.importorskip("accelerate", reason="diffusers' group offloading needs accelerate")
    from memkit.optimizations.offload_check import diffusers_check, table

    rows = {r.variant: r for r in diffusers_check("wan")}
    assert rows["memkit-disk"].passed and rows["memkit-disk-reused"].passed
    assert rows["diffusers-memory"].passed
    disk = rows["diffusers-disk"]
    assert not disk.passed and disk.d_grad > TOL and disk.d_state_dict > 1e-3  # gradients from garbage weights
    assert rows["diffusers-disk-reused"].d_output > 1e-3  # the first model's files
    assert "FAIL" in table(rows.values()) and table([rows["memkit-disk"]]).count("pass") == 1


def _param_peak(tl) -> int:
    return tl.peak_by_category().get("parameter", 0)


@pytest.mark.parametrize("to", ["cpu", "disk"])
def test_estimate_for_cuda_counts_only_the_groups_on_the_device(to):
    kwargs = dict(size="tiny", mode="inference", device="cuda")
    plain = estimate_cpu("unet", **kwargs)
    tl = estimate_cpu("unet", optimizations=[Offload(to=to, prefetch=0)], **kwargs)
    model = memkit.load_model("unet")
    groups = offload_mod.Offload(to="disk")._groups(model)
    offloaded = sum(g.nbytes for g in groups)
    biggest = max(g.nbytes for g in groups)
    assert _param_peak(plain) >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert _param_peak(tl) <= _param_peak(plain) - offloaded + 2 * biggest + 8 * 512
    assert _param_peak(tl) < _param_peak(plain)
    if to == "cpu":
        assert tl.meta["host_bytes"]["parameter"] == offloaded and tl.meta["disk_bytes"] == 0
    else:
        assert tl.meta["disk_bytes"] == offloaded and "parameter" not in tl.meta["host_bytes"]


def test_cli_offload_flag_runs_the_estimate(capsys):
    from memkit.cli import main

    argv = ["estimate", "pixart", "--size", "tiny", "--device", "cuda", "--inference", "--offload", "disk"]
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    plain = estimate_cpu("pixart", size="tiny", mode="inference", device="cuda", dtype=torch.bfloat16)
    assert result["peak_by_category"]["parameter"] < plain.peak_by_category()["parameter"]
    assert "offload:disk" in json.dumps(result)


def test_compare_with_an_optimizer_passes_the_correctness_column():
    cmp = memkit.compare(
        "dit",
        {"offload": [Offload(to="disk")], "leaf": [Offload(to="disk", group="leaf", prefetch=2)]},
        step=Step(optimizer="adamw", steps=3),
        repeats=0,
        progress=False,
    )
    for name in ("offload", "leaf"):
        r = cmp.results[name]
        assert r.passed and r.max_abs_d_param <= TOL and r.max_abs_d_grad <= TOL, name


def test_compare_without_an_optimizer_reads_real_weights_and_shows_the_saving():
    cmp = memkit.compare(
        "unet", {"disk": [Offload(to="disk", prefetch=0)]}, step=Step(steps=2), repeats=0, progress=False
    )
    r, base = cmp.results["disk"], cmp.results["baseline"]
    assert r.passed and r.max_abs_d_param == 0.0  # the weights compared after the step are real, not placeholders
    assert _param_peak(r.timeline) < 0.5 * _param_peak(base.timeline)


class _FakeCuda:
    """Stands in for torch.cuda: logs what the prefetch path asks of streams and events."""

    def __init__(self):
        self.log = []
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.name = "side"

            def wait_event(self, event):
                fake.log.append(("wait", self.name, event))

        class Event:
            def record(self, stream):
                fake.log.append(("record", stream.name))

        self.Stream, self.Event = Stream, Event
        self.current = Stream()
        self.current.name = "compute"
        self.active = None

    def stream(self, s):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.active = s.name
                fake.log.append(("enter", s.name))

            def __exit__(self, *exc):
                fake.active = None
                fake.log.append(("exit", s.name))

        return Ctx()

    def current_stream(self, device=None):
        return self.current


def test_cuda_prefetch_copies_on_a_side_stream_and_the_compute_stream_waits(monkeypatch):
    """The logic of the CUDA path, on CPU tensors: copies inside the side stream, an event after them, and the
    compute stream waiting on that event (and recording the tensors) before the weights are handed out."""
    fake = _FakeCuda()
    copies = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        copies.append((fake.active, kwargs.get("non_blocking")))
        return real_to(self, *args, **kwargs)

    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append(s.name), raising=False)
    store = store_mod.HostStore(torch.device("cpu"))
    store.streams = store_mod.CudaStreams(fake, torch.device("cpu"))
    weights = [torch.randn(3, 4), torch.randn(5)]
    store.save(0, ["a", "b"], weights)
    monkeypatch.setattr(torch.Tensor, "to", to)
    pending = store.prefetch(0)
    assert copies == [("side", True), ("side", True)]
    assert [e[0] for e in fake.log] == ["enter", "record", "exit"] and fake.log[1][1] == "side"
    out = pending.result()
    assert fake.log[-1][:2] == ("wait", "compute") and recorded == ["compute", "compute"]
    assert all(torch.equal(a, b) and a is not b for a, b in zip(out, weights, strict=True))


def test_on_an_accelerator_the_mapping_is_host_memory_and_each_copy_a_parameter_allocation(tmp_path):
    """On a device other than the CPU (the meta device stands in for CUDA here), a load maps the file as the host
    side of the copy: a tracker counts that in host memory, off the device's timeline, and each copy on the
    device as a parameter allocation, a read ahead's too (made on the reader thread, told on the caller's)."""
    store = store_mod.DiskStore(torch.device("meta"), tmp_path)
    try:
        store.save(0, ["w"], [torch.randn(64, 64)])
        with memkit.track() as tl:
            got = store.load(0)
            later = store.prefetch(0).result()
        assert got[0].device.type == later[0].device.type == "meta" and got[0].shape == (64, 64)
        rows = tl.to_pandas()
        assert list(zip(rows.action, rows.bytes, rows.category, rows.device, strict=True)) == [
            ("alloc", 64 * 64 * 4, "parameter", "meta"), ("alloc", 64 * 64 * 4, "parameter", "meta"),
        ]  # fmt: skip
        assert tl.meta["host_peak_bytes"] >= 64 * 64 * 4  # the mapping: header and weights
    finally:
        store.close()


class _HeldGroups:
    """Stands between an offloader and its store: which groups are held, loaded or being read ahead, from the
    store's own calls (``load``/``prefetch`` take a group, ``release`` gives it back)."""

    def __init__(self, store):
        self.store, self.held = store, set()

    def load(self, gid):
        self.held.add(gid)
        return self.store.load(gid)

    def prefetch(self, gid):
        self.held.add(gid)
        return self.store.prefetch(gid)

    def release(self, gid):
        self.held.discard(gid)
        return self.store.release(gid)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_prefetch_k_holds_exactly_k_groups_in_flight(prefetch, tmp_path):
    """Six blocks, one group each, from the second step (the order is learned on the first): before block 0 the
    first k groups are being read; while block i runs, it and the k after it are held (fewer only at the end);
    after an inference forward none. In training the backward holds block i and the k before it."""
    model, x, n, k = _Stack(), torch.randn(4, 16), 6, prefetch
    with Offload(to="disk", prefetch=k, path=tmp_path).apply(model) as handle:
        spy = handle.offloader.store = _HeldGroups(handle.offloader.store)
        gid = {id(g.modules[0]): g.gid for g in handle.offloader.groups}
        order = [gid[id(b)] for b in model.blocks]
        assert sorted(order) == list(range(n))
        seen = {}

        def note(key):
            def hook(*args):
                seen.setdefault(key, set(spy.held))  # the first call: a hook that returned it would replace values

            return hook

        hooks = [model.register_forward_pre_hook(note("start")), model.register_forward_hook(note("end"))]
        for i, b in enumerate(model.blocks):
            hooks += [b.register_forward_pre_hook(note(("fwd", i))), b.register_full_backward_hook(note(("bwd", i)))]

        def groups(blocks):
            return {order[j] for j in blocks if 0 <= j < n}

        model(x.requires_grad_()).sum().backward()  # the first step learns the order
        for training in (False, True):
            seen.clear()
            with torch.set_grad_enabled(training):
                out = model(x)
            assert seen["start"] == groups(range(k))
            for i in range(n):
                assert seen[("fwd", i)] == groups(range(i, i + k + 1)), (training, i)
            if not training:
                assert spy.held == set()
                continue
            assert seen["end"] == groups(range(n - 1 - k, n))
            out.sum().backward()
            for i in range(n):
                assert seen[("bwd", i)] == groups(range(i - k, i + 1)), i
        for h in hooks:
            h.remove()


def test_the_diffusers_harness_refuses_a_diffusers_it_was_not_run_against(monkeypatch):
    import diffusers

    from memkit.optimizations import offload_check

    monkeypatch.setattr(diffusers, "__version__", "0.40.0")
    with pytest.raises(RuntimeError, match=r"diffusers >= 0.41 .* this is diffusers 0.40.0"):
        offload_check.diffusers_check("flux")
    assert offload_check._release("0.41.0.dev0") == (0, 41) >= offload_check._DIFFUSERS_CHECKED
