"""The tracker's numbers against the allocator's own, measured independently by torch.profiler."""

import pytest
import torch
from oracles import assert_equals_profiler, tracked_and_profiled

import memkit
from memkit.memory import CATEGORIES, phase, tag, track


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_peak_equals_profiler_for_every_tiny_preset(preset, threads):
    torch.set_num_threads(threads)
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    opt = torch.optim.AdamW(model.parameters())
    memkit.train_step(model, inputs, opt)  # optimizer state exists: the measured step is a steady one

    tl, (prof_peak, prof_end) = tracked_and_profiled(
        lambda: memkit.train_step(model, inputs, opt), model=model, optimizer=opt, inputs=inputs
    )
    assert tl.peak_bytes - tl.baseline_bytes == prof_peak
    assert tl.end_bytes - tl.baseline_bytes == prof_end


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_first_step_peak_equals_profiler_including_gradients_and_new_optimizer_state(preset):
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    opt = torch.optim.AdamW(model.parameters())
    tl, (prof_peak, prof_end) = tracked_and_profiled(
        lambda: memkit.train_step(model, inputs, opt), model=model, optimizer=opt, inputs=inputs
    )
    assert tl.peak_bytes - tl.baseline_bytes == prof_peak
    assert tl.end_bytes - tl.baseline_bytes == prof_end
    # After the step the optimizer state is alive and categorized as such, to the byte.
    state_bytes = sum(
        v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    end = tl.bytes_by_category_at(len(tl) - 1)
    assert end["optimizer_state"] == state_bytes
    assert end["gradient"] == 0  # zero_grad(set_to_none=True) freed them


def test_baseline_counts_registered_objects_by_category():
    model = memkit.load_model("dit")
    inputs = memkit.make_inputs(model)
    with track(model, inputs=inputs) as tl:
        pass
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    base = tl.baseline_by_category
    assert base["parameter"] == params
    assert base["buffer"] == buffers
    assert base["input"] == sum(t.untyped_storage().nbytes() for t in inputs.values() if torch.is_tensor(t))
    assert tl.peak_bytes == tl.baseline_bytes and len(tl) == 0


def test_categories_and_phases_of_a_training_step():
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model, height=64, width=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with track(model, optimizer=opt, inputs=inputs) as tl:
        out = memkit.step.model_output(model(**inputs))
        loss = out.pow(2).mean()
        at_backward = tl.live_bytes[-1] if len(tl) else tl.baseline_bytes
        loss.backward()
        grads_end = len(tl)
        opt.step()
    phases = [p for p, _, _ in tl.phase_spans()]
    assert phases[0] == "forward" and "backward" in phases and phases[-1] in ("optimizer", "other")
    assert "optimizer" in phases
    # gradients: exactly the bytes of every param.grad, at the end of backward
    grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    assert tl.bytes_by_category_at(grads_end - 1)["gradient"] == grad_bytes
    # activations: forward allocations alive at backward start, so at most what was live then
    act = tl.bytes_by_category_at(grads_end - 1)
    assert 0 < tl.peak_by_category()["activation"] <= at_backward
    assert act["parameter"] == sum(p.untyped_storage().nbytes() for p in model.parameters())
    momentum = sum(s["momentum_buffer"].untyped_storage().nbytes() for s in opt.state.values())
    assert tl.bytes_by_category_at(len(tl) - 1)["optimizer_state"] == momentum
    assert sum(tl.peak_by_category().values()) == tl.peak_bytes
    assert set(tl.peak_by_category()) == set(CATEGORIES)


def test_checkpoint_recompute_is_activation_in_backward():
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model)
    with memkit.Checkpointing(pattern="all").apply(model):
        with track(model, inputs=inputs) as tl:
            memkit.train_step(model, inputs)
    df = tl.to_pandas()
    recomputed = df[(df.phase == "backward") & (df.category == "activation") & (df.action == "alloc")]
    assert len(recomputed) > 0


def test_views_are_not_allocations():
    x = torch.randn(1000)
    with track(inputs={"x": x}) as tl:
        v = x.view(10, 100).t()[2:5]
        x.add_(x)
        del v
    assert len(tl) == 0 and tl.peak_bytes == x.untyped_storage().nbytes()


def test_free_is_recorded_when_the_storage_dies_not_when_a_view_dies():
    with track() as tl:
        a = torch.empty(256)
        view = a[10:]
        del a
        n_before = len(tl)
        del view
    assert n_before == 1  # the view kept the storage alive
    assert tl.column("action").tolist() == [0, 1]
    assert tl.end_bytes == tl.baseline_bytes and tl.peak_bytes - tl.baseline_bytes == 1024


def test_nested_tracking_is_supported_and_each_sees_its_window():
    with track() as outer:
        a = torch.empty(100)
        with track() as inner:
            b = torch.empty(50)
            del b
        del a
    assert inner.peak_bytes - inner.baseline_bytes == 200
    assert outer.peak_bytes - outer.baseline_bytes == 600
    assert len(outer) == 4 and len(inner) == 2


def test_tag_and_phase_reach_active_trackers():
    with track() as tl:
        with phase("ema"):
            shadow = torch.zeros(64)
            tag([shadow], "ema")
    assert tl.to_pandas().iloc[0][["category", "phase"]].tolist() == ["ema", "ema"]
    assert tl.peak_by_category()["ema"] == 256
    del shadow


def test_timeline_is_live_inside_the_block():
    with track() as tl:
        x = torch.empty(32)
        assert len(tl) == 1 and tl.peak_bytes - tl.baseline_bytes == 128
        del x
    assert len(tl) == 2


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="category must be one of"):
        tag(torch.zeros(1), "weights")
    with pytest.raises(ValueError, match="phase must be one of"):
        with phase("warmup"):
            pass
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        with track(model="flux"):
            pass
    with pytest.raises(ValueError, match="alloc_granularity"):
        with track(alloc_granularity=0):
            pass


def test_alloc_granularity_rounds_like_the_cuda_allocator():
    with track(alloc_granularity=512) as tl:
        a = torch.empty(1)  # 4 bytes → 512
        b = torch.empty(129)  # 516 bytes → 1024
    assert tl.column("bytes").tolist() == [512, 1024]
    del a, b


def test_state_restored_after_track_no_hooks_left():
    model = memkit.load_model("sd3")
    inputs = memkit.make_inputs(model)
    with track(model, inputs=inputs):
        memkit.train_step(model, inputs)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_cuda_history_on_a_cpu_machine_is_a_clear_error_or_silently_off():
    from memkit.memory import CudaHistoryError

    with pytest.raises(CudaHistoryError, match="CUDA"):
        with track(cuda_history=True):
            pass
    with track() as tl:  # the default: off where there is no CUDA
        torch.empty(4)
    assert "cuda" not in tl.meta and len(tl) == 2


def test_track_records_cuda_history_when_asked(monkeypatch):
    import memkit.memory.recording as recording_module

    calls = []
    snapshot = memkit.Timeline(columns={}, meta={"reserved_bytes": {"cuda:0": 2 << 20}})

    class FakeHandle:
        def remove(self):
            calls.append("stop")

    monkeypatch.setattr(recording_module, "record_cuda_history", lambda n: calls.append(("start", n)) or FakeHandle())
    monkeypatch.setattr(recording_module, "cuda_snapshot", lambda: calls.append("snapshot") or snapshot)
    with track(cuda_history=True, max_entries=500) as tl:
        pass
    assert calls == [("start", 500), "snapshot", "stop"]
    assert tl.meta["cuda"] is snapshot


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA history fails")
def test_a_failed_start_leaves_no_hook_on_the_model():
    from memkit.memory import CudaHistoryError

    model = memkit.load_model("dit")
    inputs = memkit.make_inputs(model)
    with pytest.raises(CudaHistoryError):
        with track(model, inputs=inputs, cuda_history=True):
            pass
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    memkit.train_step(model, inputs)  # and the model still trains


def test_peak_phase():
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model, height=128, width=128)
    with torch.no_grad(), track(model, inputs=inputs) as inference:
        model(**inputs)
    assert inference.peak_phase == "forward"
    with track(model, inputs=inputs) as training:
        memkit.train_step(model, inputs)
    assert training.peak_phase == "backward"  # activations plus the first gradients, at this resolution
    with track() as empty:
        pass
    assert empty.peak_phase == "other"


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_peak_equals_profiler_in_bfloat16(preset):
    # bf16 takes other kernel paths (reduced-precision flash-attention buffers, casts in AdamW)
    model = memkit.load_model(preset, dtype=torch.bfloat16)
    inputs = memkit.make_inputs(model)
    opt = torch.optim.AdamW(model.parameters())
    memkit.train_step(model, inputs, opt)
    tl, (prof_peak, prof_end) = tracked_and_profiled(
        lambda: memkit.train_step(model, inputs, opt), model=model, optimizer=opt, inputs=inputs
    )
    assert_equals_profiler(tl, prof_peak, prof_end)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2, 72, 16), (2, 4, 300, 32), (1, 2, 800, 8)])
def test_attention_kernel_buffers_equal_the_profiler(shape, dtype, threads):
    # CPU flash attention allocates per-thread buffers inside the kernel, sized by the sequence split
    torch.set_num_threads(threads)
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

    tl, (prof_peak, prof_end) = tracked_and_profiled(step, inputs={"q": q, "k": k, "v": v})
    assert_equals_profiler(tl, prof_peak, prof_end)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["dit", "flux"])
def test_checkpointing_keeps_the_rng_state_it_saved(preset):
    # checkpoint() saves torch.get_rng_state() (5,056 bytes, built outside dispatch) per checkpointed block
    # until that block's backward: at 256 px the peak is in the backward, where those states are still alive.
    torch.set_num_threads(1)
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model, height=256, width=256)
    opt = torch.optim.AdamW(model.parameters())
    with memkit.Checkpointing().apply(model):
        memkit.train_step(model, inputs, opt)
        tl, (prof_peak, prof_end) = tracked_and_profiled(
            lambda: memkit.train_step(model, inputs, opt), model=model, optimizer=opt, inputs=inputs
        )
    assert tl.peak_phase == "backward"
    assert_equals_profiler(tl, prof_peak, prof_end)


def test_rng_state_outside_dispatch_is_tracked_and_the_function_restored():
    real = torch.get_rng_state
    state_bytes = real().untyped_storage().nbytes()
    x = torch.randn(64, requires_grad=True)

    class Block(torch.nn.Module):
        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)

    with track(inputs=[x]) as tl:
        with track() as inner:  # nested: both see it, and the outer one still does after the inner one stops
            torch.get_rng_state()
        Block()(x).sum().backward()
    assert torch.get_rng_state is real
    events = tl.to_pandas()
    states = events[(events.op == "torch.get_rng_state") & (events.action == "alloc")]
    assert len(states) >= 2 and set(states.bytes) == {state_bytes}  # the inner block's, and checkpoint's
    assert "activation" in set(states.category)  # the one checkpoint saved in the forward, alive at backward
    inner_events = inner.to_pandas()
    assert list(inner_events[inner_events.op == "torch.get_rng_state"].bytes) == [state_bytes]
    assert inner.peak_bytes - inner.baseline_bytes == state_bytes and inner.end_bytes == inner.baseline_bytes
