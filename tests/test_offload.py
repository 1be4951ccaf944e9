"""memkit.Offload: the same outputs, gradients and updates as the model in memory, real state_dict values while
offloaded, exact restore, safe files, and its place in the registry, estimate and CLI."""

import copy
import errno
import json
import os
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

import memkit
from memkit.optimizations import _offload_store as store_mod
from memkit.optimizations import offload as offload_mod
from memkit.optimizations.offload import Offload, OffloadError, onloaded
from memkit.presets import PRESETS
from memkit.step import Step, model_output

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
        assert all(g is not None for g in grads[1]) and _max_diff(*grads) <= TOL
        opt_r.step(), opt_m.step()
        opt_r.zero_grad(), opt_m.zero_grad()
    with torch.no_grad():  # the updates were written back: a fresh forward reads them from the store
        model(**inputs)
        assert _max_diff([_run(ref, inputs)], [_run(model, inputs)]) <= TOL
    ref_state, state = ref.state_dict(), model.state_dict()
    assert _max_diff(list(ref_state.values()), [state[k] for k in ref_state]) <= TOL


@pytest.mark.parametrize("group", ["block", "leaf"])
@pytest.mark.parametrize("to", ["disk", "cpu"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_outputs_and_three_training_steps_equal_the_model_in_memory(preset, to, group, cpu_moves, tmp_path):
    ref, model, inputs = _pair(preset)
    with Offload(to=to, group=group, path=tmp_path if to == "disk" else None).apply(model) as handle:
        assert handle.offloader.groups, "nothing was offloaded"
        _assert_same_training(ref, model, inputs)
        assert handle.offloader.loads > len(handle.offloader.groups)  # groups really came and went


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


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_block_level_also_offloads_the_layers_outside_the_blocks(preset, tmp_path):
    """At block level the embedders and final layers are groups too (one per layer): what stays resident is only
    the model's own parameters and one-element ones. Their buffers are fresh each time (a layout no block shares
    would otherwise stay in the pool) and are freed when the layer is done."""
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    own = {id(p) for p in model.parameters(recurse=False)}
    with Offload(to="disk", path=tmp_path).apply(model) as handle:
        groups = handle.offloader.groups
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
            buffers = handle.offloader.store.buffers
            made = buffers.allocated
            pool = {b.untyped_storage()._cdata for b, _ in buffers.sets}
            seen: list[int] = []

            def note(g):
                return lambda m, a: seen.extend(p.untyped_storage()._cdata for p in g.params)

            hooks = [m.register_forward_pre_hook(note(g)) for g in groups for m in g.modules]
            model(**inputs)
            for h in hooks:
                h.remove()
        # every group, blocks and the layers outside them alike, read into the same few buffers: none made
        assert buffers.allocated == made <= 2 and len(pool) == made and set(seen) <= pool


def test_a_group_of_any_layout_is_carved_out_of_a_pooled_buffer_aligned_and_exact(tmp_path):
    """The pool's buffers are flat bytes of the largest group's size; a group's tensors are views into one, each
    starting on a 64-byte boundary, whatever their dtypes: a small layer of float16 and int8-sized shapes reads
    back exactly the values saved."""
    from memkit.optimizations._offload_store import DiskStore

    store = DiskStore(torch.device("cpu"), tmp_path, buffers=2)
    try:
        big = [torch.randn(33, 7), torch.randn(5)]
        odd = [torch.randn(3).half(), torch.arange(11, dtype=torch.int64), torch.randn(2, 2).to(torch.bfloat16)]
        store.save(0, ["w", "b"], big)
        store.save(1, ["x", "y", "z"], odd)
        nbytes = {0: -(-33 * 7 * 4 // 64) * 64 + 64, 1: 64 + 128 + 64}
        assert store.buffers.nbytes == max(nbytes.values())
        for gid, saved in ((1, odd), (0, big), (1, odd)):
            got = store.load(gid)
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, saved, strict=True))
            base = got[0].untyped_storage()
            assert all(t.untyped_storage()._cdata == base._cdata for t in got)  # one buffer
            assert all(t.data_ptr() % 64 == 0 for t in got) and base.nbytes() == store.buffers.nbytes
            del got, base
        assert store.buffers.allocated == 1 and store.buffers.reused == 2  # the one buffer, three times
    finally:
        store.close()


class _Stack(nn.Module):
    """Six blocks of one layout (so one set of buffers fits every block), run in order with residuals."""

    def __init__(self, n: int = 6, d: int = 16):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_inference_reads_every_step_into_the_same_few_buffers(prefetch, tmp_path):
    """Steady-state forwards allocate no weights: every block's weights sit in one of ``prefetch + 1`` sets of
    buffers that stay alive across steps (reused, not freed and allocated again), never one still in use."""
    ref = _Stack()
    model, x = copy.deepcopy(ref), torch.randn(4, 16)
    seen: list[tuple[int, weakref.ref]] = []
    with Offload(to="disk", prefetch=prefetch, path=tmp_path).apply(model) as handle:
        groups = handle.offloader.groups

        def record(block, args):
            mine = {p.data_ptr() for p in block.parameters()}
            others = {t.data_ptr() for g in groups if g.real is not None and block not in g.modules for t in g.real}
            assert mine.isdisjoint(others)  # another onloaded group's buffers are not this one's
            seen.extend((p.data_ptr(), weakref.ref(p.untyped_storage())) for p in block.parameters())

        hooks = [b.register_forward_pre_hook(record) for b in model.blocks]
        with torch.no_grad():
            for _ in range(4):
                assert torch.equal(model(x), ref(x))
        for h in hooks:
            h.remove()
        assert len(seen) == 4 * sum(len(g.params) for g in groups)
        assert len({ptr for ptr, _ in seen}) <= (prefetch + 1) * len(groups[0].params)
        assert all(r() is not None for _, r in seen)  # alive in the pool: freed storages would be gone
        assert handle.offloader.store.buffers.allocated <= prefetch + 1


def _stack_loss(net: nn.Module, x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "model":
        return net(x).pow(2).mean()
    out = x  # the blocks called one by one: no model forward, so no saved-tensor hooks; each linear saves a view
    for b in net.blocks:  # of its weight itself, aliasing the buffer after the offloader has let the group go
        out = out + b(out)
    return out.pow(2).mean()


@pytest.mark.parametrize("how", ["model", "blocks called directly"])
def test_training_never_reuses_a_buffer_autograd_still_holds(how, tmp_path):
    """3 steps (forward, backward, AdamW) equal the model in memory. Through the model the saved weights are
    references (buffers get reused); called block by block, autograd keeps views of the buffers for the backward,
    so the pool must leave those alone (reusing one would feed the backward another block's weights)."""
    ref = _Stack()
    model, x = copy.deepcopy(ref), torch.randn(4, 16)
    with Offload(to="disk", prefetch=1, path=tmp_path).apply(model):
        storages: list[set[int]] = []  # per step: where the blocks' last weights were read (saved by autograd)
        hooks = [
            b.register_forward_pre_hook(lambda b, a: storages[-1].add(b[-1].weight.data_ptr())) for b in model.blocks
        ]
        opts = [torch.optim.AdamW(net.parameters(), lr=1e-2) for net in (ref, model)]
        for _ in range(3):
            storages.append(set())
            for net in (ref, model):
                _stack_loss(net, x, how).backward()
            assert _max_diff([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()]) <= TOL
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for h in hooks:
            h.remove()
        with torch.no_grad():
            assert _max_diff([ref(x)], [model(x)]) <= TOL
    assert _max_diff(list(ref.parameters()), list(model.parameters())) <= TOL
    for step in storages:
        if how == "model":
            assert len(step) <= 2  # prefetch + 1 sets, reused block after block
        else:
            assert len(step) == len(model.blocks)  # all held by autograd until the backward: none reused


def test_a_buffer_is_never_handed_out_while_a_read_ahead_or_its_caller_holds_it(monkeypatch, tmp_path):
    """With the reader thread slow, buffers taken for reads in flight or still held are not given to the next
    read (which then reads into fresh memory of its own size, outside the pool); a pool buffer freed by its holder
    is."""
    store = store_mod.DiskStore(torch.device("cpu"), tmp_path, buffers=2)
    weights = {gid: [torch.full((64, 64), float(gid)), torch.full((64,), -float(gid))] for gid in range(4)}
    for gid, tensors in weights.items():
        store.save(gid, ["w", "b"], tensors)
    fill = store._fill

    def slow(gid, out):
        time.sleep(0.05)  # still reading when the next reads take their buffers
        return fill(gid, out)

    def ptrs(tensors):
        return {t.data_ptr() for t in tensors}

    monkeypatch.setattr(store, "_fill", slow)
    try:
        ahead = [store.prefetch(0), store.prefetch(1)]  # the pool's two buffers, both in flight
        loaded = store.load(2)  # none free: fresh memory of its own size
        held = {gid: f.result() for gid, f in enumerate(ahead)}
        held[2] = loaded
        assert ptrs(held[0]).isdisjoint(ptrs(held[1])) and ptrs(held[2]).isdisjoint(ptrs(held[0]) | ptrs(held[1]))
        pool = {b.untyped_storage()._cdata for b, _ in store.buffers.sets}
        assert [held[g][0].untyped_storage()._cdata in pool for g in range(3)] == [True, True, False]
        assert (store.buffers.allocated, store.buffers.fresh) == (2, 1)
        first = ptrs(held[0])
        for gid, tensors in held.items():
            assert all(torch.equal(a, b) for a, b in zip(tensors, weights[gid], strict=True)), gid
        del held[0], loaded, ahead  # its holder lets group 0's buffer go: the next read reuses it, not group 1's
        held[3] = store.prefetch(3).result()
        assert ptrs(held[3]) == first and store.buffers.reused == 1
        assert all(torch.equal(a, b) for a, b in zip(held[3], weights[3], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(held[1], weights[1], strict=True))  # untouched
    finally:
        store.close()


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
    handle.remove()
    assert not os.path.exists(folder) and os.listdir(tmp_path) == []
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


def _fill_disk(monkeypatch, room: int) -> None:
    def fake_open(path, mode="r", *args, **kwargs):
        return _FullDisk(path, mode, room) if "w" in mode else open(path, mode, *args, **kwargs)

    monkeypatch.setattr(store_mod, "open", fake_open, raising=False)


def test_disk_full_on_apply_raises_a_clear_error_and_leaves_the_model_unchanged(monkeypatch, tmp_path):
    ref, model, inputs = _pair("flux")
    _fill_disk(monkeypatch, room=1000)
    with pytest.raises(OffloadError, match="No space left on device.*stay in memory") as info:
        Offload(to="disk", path=tmp_path).apply(model)
    assert info.value.errno == errno.ENOSPC and str(tmp_path) in str(info.value)
    assert os.listdir(tmp_path) == []  # no half-written files, no folder
    monkeypatch.undo()
    for (k, v), v2 in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(v, v2), k
    _assert_same_training(ref, model, inputs, steps=1)
    assert not model._forward_pre_hooks


def test_disk_full_on_write_back_keeps_the_weights_in_memory_and_usable(monkeypatch, tmp_path):
    ref, model, inputs = _pair("flux")
    with Offload(to="disk", path=tmp_path).apply(model) as handle:
        opt_r, opt_m = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))
        for net, opt in ((ref, opt_r), (model, opt_m)):
            model_output(net(**inputs)).float().pow(2).mean().backward()
            opt.step()
        _fill_disk(monkeypatch, room=0)
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


@pytest.mark.parametrize("damage", ["truncate", "header", "dtype"])
def test_a_damaged_file_gives_a_clear_error_on_load(damage, tmp_path):
    _, model, inputs = _pair("dit")
    with Offload(to="disk", path=tmp_path, prefetch=0).apply(model) as handle:
        path = handle.offloader.store.files[0]
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
    plain = memkit.estimate("unet", **kwargs)
    tl = memkit.estimate("unet", optimizations=[Offload(to=to, prefetch=0)], **kwargs)
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
    plain = memkit.estimate("pixart", size="tiny", mode="inference", device="cuda", dtype=torch.bfloat16)
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
