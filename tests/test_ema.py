"""memkit.EMA: the same shadows as diffusers' EMAModel, saved and loaded, every-N, errors, compare and estimate."""

import json
import re
import warnings

import pytest
import torch
from _cpu_estimate import estimate_cpu
from diffusers.training_utils import EMAModel

import memkit
from memkit.optimizations.ema import EMAState, diffusers_check

# `make test-fast` keeps one placement (tests/conftest.py); `make test` and CI run both
FAST_CASES = {"test_estimate_for_cuda_keeps_host_shadows_off_the_gpu_peak": {"cpu_only"}}


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _nudge(model, i):
    with torch.no_grad():
        g = torch.Generator().manual_seed(i)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("mode", ["device", "cpu_only", "offload"])
@pytest.mark.parametrize("warmup", [False, True])
def test_shadows_equal_diffusers_emamodel_over_50_steps(foreach, mode, warmup):
    model = _model()
    settings = dict(decay=0.99, min_decay=0.1, update_after_step=3, use_ema_warmup=warmup, power=3 / 4)
    ref = EMAModel(model.parameters(), foreach=foreach, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ema = memkit.EMA(mode=mode, foreach=foreach, **settings).build(model)
    for i in range(50):
        _nudge(model, i)
        ref.step(model.parameters())
        ema.step(model)
        assert ema.cur_decay_value == pytest.approx(ref.cur_decay_value, abs=1e-12)
    for a, b in zip(ema.shadow_params, ref.shadow_params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert ema.state_dict().keys() >= ref.state_dict().keys()


def test_foreach_and_loop_give_the_same_shadows_also_bf16_model_fp32_ema():
    model = _model().to(torch.bfloat16)
    a = memkit.EMA(decay=0.9, schedule="constant", dtype=torch.float32, chunk_mb=1e-3).build(model)
    b = memkit.EMA(decay=0.9, schedule="constant", dtype=torch.float32, foreach=False).build(model)
    for i in range(5):
        _nudge(model, i)
        a.step(model)
        b.step(model)
    for x, y, p in zip(a.shadow_params, b.shadow_params, model.parameters(), strict=True):
        assert x.dtype == torch.float32 and torch.equal(x, y)
        torch.testing.assert_close(x, p.float(), atol=0.1, rtol=0)


def test_step_takes_the_global_step():
    model = _model()
    ema = memkit.EMA(decay=0.9999).build(model)
    ema.step(model, step=5000)
    assert ema.cur_decay_value == pytest.approx(5000 / 5009)


@pytest.mark.parametrize("n", [2, 4])
def test_every_n_stays_close_to_every_step_on_a_slowly_moving_model(n):
    # Each weight moves at a constant velocity v (|v| <= 1e-3 per step). In the steady state an EMA of a ramp
    # lags it by v * d / (1 - d) steps for decay d every step, and by v * n * d**n / (1 - d**n) for decay d**n
    # every nth step (n steps between samples), so at an update the two differ by v times the difference of
    # the lags: about (n - 1) / 2 steps of motion, at most n. Without the compensation (decay d every nth step)
    # the every-n lag is n * d / (1 - d): 57 steps of motion for d = 0.95, n = 4.
    d, steps = 0.95, 400  # d**400 ~ 1e-9: the start is forgotten
    model = _model().double()
    g = torch.Generator().manual_seed(0)
    velocity = [(torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1) * 1e-3 for p in model.parameters()]
    every = memkit.EMA(decay=d, schedule="constant", update_every=n).build(model)
    each = memkit.EMA(decay=d, schedule="constant").build(model)
    updates = 0
    for _ in range(steps):
        with torch.no_grad():
            for p, v in zip(model.parameters(), velocity, strict=True):
                p.add_(v)
        each.step(model)
        updates += every.step(model)
    assert updates == steps // n
    lag = d / (1 - d) - n * d**n / (1 - d**n)
    assert 0 < lag <= n
    for a, b, v in zip(every.shadow_params, each.shadow_params, velocity, strict=True):
        torch.testing.assert_close(a - b, v * lag, atol=1e-9, rtol=0)
        assert float((a - b).abs().max()) <= n * 1e-3


def test_constant_schedule_decays_by_exactly_decay():
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    ema = memkit.EMA(decay=0.75, schedule="constant", update_after_step=2).build(model)
    _nudge(model, 0)
    for _ in range(2):  # before update_after_step: the shadows copy the parameters
        ema.step(model)
        assert ema.cur_decay_value == 0.0
    for s, p in zip(ema.shadow_params, model.parameters(), strict=True):
        assert torch.equal(s, p)
    copied = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, s0 in zip(model.parameters(), start, strict=True):
            p.copy_(s0)
    ema.step(model)
    assert ema.cur_decay_value == 0.75
    for s, c, p in zip(ema.shadow_params, copied, model.parameters(), strict=True):
        torch.testing.assert_close(s, 0.75 * c + 0.25 * p, atol=1e-7, rtol=0)


def test_without_pinning_it_says_so_once_and_does_not_crash():
    memkit.optimizations._common._warned.clear()
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            memkit.EMA(mode="offload").build(model).step(model)
        memkit.EMA(mode="device").build(model)
    messages = [str(w.message) for w in caught if "unpinned" in str(w.message)]
    assert len(messages) == 1 and "mode='offload'" in messages[0]


def test_mixed_dtypes_update_in_bounded_chunks_in_the_ema_phase():
    # a bf16 model with an fp32 EMA: the update stages parameters through a buffer of at most chunk_mb, and
    # at most 2% of the EMA's bytes once the model is large enough (>= 64 x 65,536 elements)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 512)).to(torch.bfloat16)
    ema_bytes = sum(p.numel() * 4 for p in model.parameters())
    for chunk_mb, bound in ((32.0, 0.02 * ema_bytes), (0.05, 0.05 * 2**20)):
        ema = memkit.EMA(decay=0.9, schedule="constant", dtype=torch.float32, chunk_mb=chunk_mb).build(model)
        _nudge(model, 1)
        expected = [s.clone().lerp_(p.float(), 0.1) for s, p in zip(ema.shadow_params, model.parameters(), strict=True)]
        with memkit.track() as tl:
            ema.step(model)
        assert 0 < tl.peak_bytes <= bound, (chunk_mb, tl.peak_bytes, bound)
        assert set(tl.to_pandas()["phase"]) == {"ema"}
        for s, e in zip(ema.shadow_params, expected, strict=True):
            torch.testing.assert_close(s, e, atol=1e-6, rtol=0)


@pytest.mark.parametrize("foreach", [True, False])
def test_offload_streams_through_a_bounded_buffer_with_the_same_shadows(foreach):
    # In an estimate for "cuda", CPU parameters stand for device ones: "offload" then takes its GPU path (host
    # shadows copied through a device buffer), which runs here on real CPU tensors.
    from memkit.memory.placement import planning

    model = memkit.load_model("flux")
    ref = EMAModel(model.parameters(), decay=0.99, foreach=foreach)
    with planning("cuda") as plan:
        host = plan.host
        ema = memkit.EMA(decay=0.99, mode="offload", foreach=foreach, chunk_mb=0.01).build(model)
        assert ema._stream and host["ema"] is not None
        for i in range(5):
            _nudge(model, i)
            ref.step(model.parameters())
            with memkit.track() as tl:
                ema.step(model)
            assert 0 < tl.peak_bytes <= 2 * 0.01 * 2**20  # a parameter and a shadow buffer
    for a, b in zip(ema.shadow_params, ref.shadow_params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_copy_store_restore_and_swap_keep_no_copy(tmp_path):
    model = _model()
    ema = memkit.EMA(decay=0.5, schedule="constant").build(model)
    _nudge(model, 0)
    ema.step(model)
    before = [p.detach().clone() for p in model.parameters()]
    with ema.swapped_into(model):
        for p, s in zip(model.parameters(), ema.shadow_params, strict=True):
            assert torch.equal(p, s)
    assert ema.temp_stored_params is None
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    with pytest.raises(RuntimeError, match="store"):
        ema.restore(model)


def test_save_and_load_round_trip(tmp_path):
    model = _model()
    ema = memkit.EMA(decay=0.9, update_every=2).build(model)
    for i in range(6):
        _nudge(model, i)
        ema.step(model)
    ema.save_pretrained(tmp_path / "ema", max_shard_size=1000)
    assert len(list((tmp_path / "ema").glob("*.safetensors"))) > 1  # sharded
    back = memkit.EMA.from_pretrained(tmp_path / "ema")
    assert back.config == ema.config and back.optimization_step == 6
    for a, b in zip(back.shadow_params, ema.shadow_params, strict=True):
        assert torch.equal(a, b)
    other = memkit.EMA().build(_model(1))
    other.load_state_dict(ema.state_dict())
    for a, b in zip(other.shadow_params, ema.shadow_params, strict=True):
        assert torch.equal(a, b)


def test_loads_a_diffusers_state_dict():
    model = _model()
    ref = EMAModel(model.parameters(), decay=0.99, update_after_step=2)
    for i in range(5):
        _nudge(model, i)
        ref.step(model.parameters())
    ema = memkit.EMA().build(_model(1))
    ema.load_state_dict(ref.state_dict())
    assert ema.optimization_step == 5 and ema.config.decay == 0.99 and ema.config.update_after_step == 2
    for a, b in zip(ema.shadow_params, ref.shadow_params, strict=True):
        assert torch.equal(a, b)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="decay must be in"):
        memkit.EMA(decay=1.5)
    with pytest.raises(ValueError, match="decay must be in"):
        memkit.EMA(decay=-0.1)
    with pytest.raises(ValueError, match="update_every must be"):
        memkit.EMA(update_every=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        memkit.EMA.parse("gpu")
    with pytest.raises(ValueError, match="every=N"):
        memkit.EMA.parse("device:often")
    with pytest.raises(ValueError, match="parameters must all be on one device"):
        EMAState([torch.zeros(2), torch.zeros(2, device="meta")])
    ema = memkit.EMA().build(_model())
    with pytest.raises(ValueError, match=r"state_dict\['shadow_params'\]"):
        ema.load_state_dict({"shadow_params": [torch.zeros(3)]})
    wrong = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 8))
    with pytest.raises(ValueError, match=r"state_dict\['shadow_params'\]\[0\]"):
        ema.load_state_dict(memkit.EMA().build(wrong).state_dict())


def test_str_and_parse_round_trip():
    for value in ["device", "offload", "cpu_only", "cpu_only:every=4"]:
        assert str(memkit.EMA.parse(value)) == f"ema:{value}"


def test_in_compare_the_shadows_match_diffusers():
    decay = 0.9

    check = diffusers_check(lambda: memkit.load_model("flux"), decay=decay)

    variant = memkit.Variant(optimizations=[memkit.EMA(decay=decay)], check=check)
    cmp = memkit.compare(
        "flux", {"ema": variant}, step=memkit.Step(optimizer="adamw", steps=2), repeats=1, progress=False
    )
    row = cmp.table().loc["ema"]
    assert row["pass"] and row["max |Δema|"] <= 1e-6 and row["Δema / Δparam"] <= 1e-6
    params = sum(p.numel() * 4 for p in memkit.load_model("flux").parameters())
    assert cmp.results["ema"].timeline.peak_by_category()["ema"] == params


def test_estimate_counts_fp32_shadows_as_ema_bytes_and_the_update_as_its_phase():
    tl = estimate_cpu("flux", size="tiny", optimizer="adamw", steps=2, optimizations=[memkit.EMA(mode="device")])
    assert tl.peak_by_category()["ema"] == tl.meta["parameters"] * 4
    plain = estimate_cpu("flux", size="tiny", optimizer="adamw", steps=2)
    assert plain.peak_by_category()["ema"] == 0


def test_the_update_allocates_nothing_and_runs_in_the_ema_phase():
    model = memkit.load_model("flux")
    handle = memkit.EMA(decay=0.9).apply(model)
    with memkit.track(owned=handle) as tl:
        handle.after_step()
    assert tl.peak_bytes == tl.peak_by_category()["ema"]  # no temporary


@pytest.mark.parametrize("mode", ["offload", "cpu_only"])
def test_estimate_for_cuda_keeps_host_shadows_off_the_gpu_peak(mode):
    kw = dict(size="tiny", dtype=torch.bfloat16, optimizer="adamw", device="cuda", progress=False)
    on_device = estimate_cpu("flux", optimizations=[memkit.EMA(mode="device")], **kw)
    off = estimate_cpu("flux", optimizations=[memkit.EMA(mode=mode)], **kw)
    model = memkit.load_model("flux", dtype=torch.bfloat16)
    shadows = [p.numel() * 2 for p in model.parameters()]  # bf16 shadows of bf16 parameters
    on_gpu = sum(-(-n // 512) * 512 for n in shadows)  # the caching allocator's 512-byte blocks
    assert on_device.peak_by_category()["ema"] == on_gpu and on_device.meta["host_bytes"] == {}
    assert off.peak_by_category()["ema"] == 0 and off.meta["host_bytes"] == {"ema": sum(shadows)}
    assert on_device.peak_bytes - off.peak_bytes == on_gpu
    if mode == "offload":  # the update streams through device buffers, inside the ema phase
        ema_phase = off.to_pandas().query("phase == 'ema' and action == 'alloc'")
        assert 0 < ema_phase["bytes"].max() <= 32 * 2**20
    on_cpu = estimate_cpu("flux", optimizations=[memkit.EMA(mode=mode)], **{**kw, "device": "cpu"})
    assert on_cpu.peak_by_category()["ema"] == sum(shadows) and on_cpu.meta["host_bytes"] == {}


@pytest.mark.slow
def test_cli_flux_offload_says_how_much_leaves_the_gpu(capsys):
    import re

    from memkit.cli import main

    # the first step alone: the EMA's shadows exist from the build on, the same in every step (half the time of two);
    # small size: full Flux's estimate ran every block under an EMA then (70 s for the same table; it is memoized now)
    argv = [
        "estimate",
        "flux",
        "--size",
        "small",
        "--optimizer",
        "adamw",
        "--ema",
        "offload",
        "--device",
        "cuda",
        "--steps",
        "1",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "flux (small)" in text and "bfloat16" in text and "device cuda" in text and "ema:offload" in text
    params = int(re.search(r"parameters .*\(([\d,]+)\)", text).group(1).replace(",", ""))
    assert params > 30e6
    host = text.split("in CPU memory, off the GPU peak (GiB)")[1]
    assert re.search(r"^\s+ema\s+([\d.]+)$", host, re.M).group(1) == f"{params * 2 / 2**30:.3f}"  # bf16 copy
    peak = text.split("in CPU memory")[0]
    assert not re.search(r"^\s+ema\s", peak, re.M)  # nothing of the EMA in the GPU peak


def test_cli_json_reports_host_bytes(capsys):
    import json

    from memkit.cli import main

    assert main(["estimate", "flux", "--size", "tiny", "--ema", "cpu_only", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["host_bytes"] == {"ema": result["parameters"] * 2}
    assert result["peak_by_category"]["ema"] == 0


def test_save_pretrained_is_a_folder_diffusers_loads_and_back(tmp_path):
    from diffusers import SD3Transformer2DModel  # tiny SD3 has a persistent buffer (pos_embed) to carry

    model = memkit.load_model("sd3")
    ema = memkit.EMA(decay=0.9, min_decay=0.5).build(model)
    for i in range(3):
        _nudge(model, i)
        ema.step(model)
    ema.save_pretrained(tmp_path / "ema", max_shard_size=20_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = EMAModel.from_pretrained(tmp_path / "ema", model_cls=SD3Transformer2DModel)
        weights = SD3Transformer2DModel.from_pretrained(tmp_path / "ema")
    assert (ref.optimization_step, ref.decay, ref.min_decay) == (3, 0.9, 0.5)
    for a, b in zip(ref.shadow_params, ema.shadow_params, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(weights.pos_embed.pos_embed, model.pos_embed.pos_embed)
    # and a folder diffusers wrote: its weights file also holds buffers, so the model gives the order
    EMAModel(model.parameters(), model_cls=SD3Transformer2DModel, model_config=model.config).save_pretrained(
        tmp_path / "diffusers"
    )
    with pytest.raises(ValueError, match="pass model="):
        memkit.EMA.from_pretrained(tmp_path / "diffusers")
    back = memkit.EMA.from_pretrained(tmp_path / "diffusers", model=model)
    for a, p in zip(back.shadow_params, model.parameters(), strict=True):
        assert torch.equal(a, p)
    with pytest.raises(ValueError, match="another model"):
        memkit.EMA.from_pretrained(tmp_path / "diffusers", model=_model())


def test_the_compare_check_fails_when_the_shadows_differ_from_diffusers():
    # memkit's constant schedule averages from the first update on; diffusers' first update copies the weights
    check = diffusers_check(lambda: memkit.load_model("flux"), decay=0.9)
    variant = memkit.Variant(optimizations=[memkit.EMA(decay=0.9, schedule="constant")], check=check)
    cmp = memkit.compare("flux", {"ema": variant}, step=memkit.Step(optimizer="adamw"), repeats=0, progress=False)
    row = cmp.table().loc["ema"]
    # shadows = w0 + 0.1 (w1 - w0) against diffusers' w1: 0.9 of the largest move, whatever the learning rate
    assert not row["pass"] and row["Δema / Δparam"] == pytest.approx(0.9, abs=1e-3)


def test_shadows_are_views_of_one_buffer_counted_as_ema_to_the_byte():
    # one contiguous buffer per dtype (the update walks one allocation): the tracker and owned() still count
    # exactly the parameters' bytes as ema, each view holds its own parameter's values, none aliases another
    model = memkit.load_model("flux")
    handle = memkit.EMA(decay=0.9).apply(model)
    shadows, params = handle.ema.shadow_params, list(model.parameters())
    assert len({s.untyped_storage()._cdata for s in shadows}) == 1
    assert all(torch.equal(s, p) and s.shape == p.shape for s, p in zip(shadows, params, strict=True))
    params_bytes = sum(p.numel() * p.element_size() for p in params)
    with memkit.track(owned=handle) as tl:
        pass
    assert tl.baseline_by_category["ema"] == params_bytes
    spans = sorted((s.data_ptr(), s.data_ptr() + s.nbytes) for s in shadows if s.numel())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # disjoint
    handle.remove()
    assert all(torch.equal(s, p) for s, p in zip(shadows, model.parameters(), strict=True))  # the model untouched


def test_the_thread_choice_tries_both_ways_keeps_the_faster_and_tries_again(monkeypatch):
    from memkit.optimizations._ema_update import ThreadChoice

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    choice, r = ThreadChoice(), ThreadChoice.retry

    def update(seconds: dict[bool, float]) -> bool:
        way = choice.one_thread()
        choice.record(way, seconds[way] * 1000, 1000)  # seconds per byte are compared, not seconds
        return way

    ways = [update({False: 2.0, True: 1.0}) for _ in range(4 + r)]  # one thread faster
    assert ways[:4] == [False, False, True, True]  # each way tried twice
    assert set(ways[4 : 3 + r]) == {True} and ways[3 + r] is False  # the faster, then the other again at the retry
    ways = [update({False: 0.5, True: 1.0}) for _ in range(2 * r)]  # torch's threads faster from now on
    assert set(ways[: r - 1]) == {True} and ways[r - 1] is False  # known only when tried again: then kept
    assert set(ways[r : 2 * r - 1]) == {False} and ways[2 * r - 1] is True
    assert update({False: 10.0, True: 1.0}) is False  # one slow try (noise) does not turn it
    assert [update({False: 10.0, True: 1.0}) for _ in range(4)][-1] is True  # a window of slow ones does
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not ThreadChoice().one_thread()  # one thread already: nothing to choose


@pytest.mark.parametrize("one", [True, False])
def test_small_cpu_shadows_follow_the_thread_choice_and_large_ones_use_torch_s_threads(monkeypatch, one):
    # ONE_THREAD_BYTES (memkit/optimizations/_ema_update.py): the small ones on one thread where that was faster; the
    # thread count is torch's again afterwards; the same values either way
    from memkit.optimizations import _ema_update

    big = _ema_update.ONE_THREAD_BYTES // 4  # fp32 elements of a tensor at the threshold
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for n in (big - 1, big, 7)])
    ema, reference = memkit.EMA(decay=0.5).build(model), memkit.EMA(decay=0.5).build(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    reference.step(model, step=1)
    seen, real = [], torch._foreach_lerp_

    def spy(shadows, params, weight):
        seen.append(sorted(s.numel() for s in shadows))
        return real(shadows, params, weight)

    choice = _ema_update.ThreadChoice()
    choice.tries = {True: [1.0 if one else 2.0] * 2, False: [2.0 if one else 1.0] * 2}
    monkeypatch.setattr(_ema_update, "THREADS", choice)
    monkeypatch.setattr(torch, "_foreach_lerp_", spy)
    threads = max(torch.get_num_threads(), 2)  # as on a machine with threads to spare
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    ema.step(model, step=1)
    assert seen == [[7, big - 1], [big]]
    assert calls == ([1, threads] if one else [])  # one thread for the small ones, torch's count back after
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, reference.shadow_params, strict=True))


def test_each_setting_s_bounds_are_allowed_and_what_lies_outside_is_refused_with_the_whole_message():
    for allowed in (dict(decay=0.0), dict(decay=1.0), dict(min_decay=0.0), dict(min_decay=1.0), dict(update_every=1),
                    dict(update_after_step=0), dict(chunk_mb=0.5), dict(dtype=torch.bfloat16)):  # fmt: skip
        memkit.EMA(**allowed)
    refused = {
        "decay": (1.5, "decay must be in [0, 1], got 1.5"),
        "update_every": (2.5, "update_every must be an int >= 1, got 2.5"),
        "schedule": ("cosine", "schedule must be one of ['diffusers', 'constant'], got 'cosine'"),
        "min_decay": (1.5, "min_decay must be in [0, 1], got 1.5"),
        "update_after_step": (1.5, "update_after_step must be an int >= 0, got 1.5"),
        "foreach": ("yes", "foreach must be True or False, got 'yes'"),
        "dtype": (torch.int8, "dtype must be a floating torch.dtype or None, got torch.int8"),
        "chunk_mb": (0, "chunk_mb must be > 0, got 0"),
    }
    for name, (value, message) in refused.items():
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            memkit.EMA(**{name: value})
    with pytest.raises(ValueError, match="update_every must be an int >= 1, got True"):
        memkit.EMA(update_every=True)  # a bool is an int to Python, not a count of steps
    with pytest.raises(TypeError, match="^model must be a torch.nn.Module, got list$"):
        memkit.EMA().apply([torch.zeros(2)])


def test_parse_takes_every_n_only():
    assert memkit.EMA.parse("offload:every=3") == memkit.EMA(mode="offload", update_every=3)
    for value in ("device:often=4", "device:every=x", "device:every=", "device:every"):
        with pytest.raises(ValueError, match=re.escape(f"got {value!r}")):
            memkit.EMA.parse(value)


def test_apply_s_handle_is_named_as_the_tables_name_it_and_owns_the_shadows():
    model = _model()
    with memkit.EMA(mode="cpu_only", update_every=2).apply(model) as handle:
        assert handle.name == "ema:cpu_only:every=2" == str(memkit.EMA(mode="cpu_only", update_every=2))
        owned = handle.owned()["ema"]
        assert len(owned) == 4 and all(a is b for a, b in zip(owned, handle.ema.shadow_params, strict=True))


def test_from_pretrained_reads_memkit_s_and_a_bare_folder_and_says_what_is_wrong(tmp_path):
    model = _model()
    ema = memkit.EMA(decay=0.9).build(model)
    ema.save_pretrained(tmp_path / "ema")
    back = memkit.EMA.from_pretrained(tmp_path / "ema")
    assert back.names == [n for n, _ in model.named_parameters()]
    config = json.loads((tmp_path / "ema" / "config.json").read_text())
    del config["optimization_step"]  # a folder that never stepped
    config["dtype"] = "float16"  # a model config's own dtype entry: not the EMA's setting
    (tmp_path / "ema" / "config.json").write_text(json.dumps(config))
    back = memkit.EMA.from_pretrained(tmp_path / "ema")
    assert back.optimization_step == 0 and back.config.dtype is None
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    empty = str(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(f'path {empty!r} holds no .safetensors file')}$"):
        memkit.EMA.from_pretrained(empty)
    del config["_memkit_parameter_names"]
    (tmp_path / "ema" / "config.json").write_text(json.dumps(config))
    folder = str(tmp_path / "ema")
    unordered = (f"path {folder!r} does not record the parameters' order (not written by memkit): pass model=, the "
                 "model whose parameters the shadows follow")  # fmt: skip
    with pytest.raises(ValueError, match=f"^{re.escape(unordered)}$"):
        memkit.EMA.from_pretrained(folder)
    wide = torch.nn.ModuleDict({f"x{i}": torch.nn.Linear(2, 2) for i in range(4)})  # 8 parameters the folder lacks
    names = [n for n, _ in wide.named_parameters()]
    missing = f"path {folder!r} holds no weights for {names[:5]} (8 missing): another model"
    with pytest.raises(ValueError, match=f"^{re.escape(missing)}$"):
        memkit.EMA.from_pretrained(folder, model=wide)


def test_state_dict_holds_diffusers_keys_and_memkit_s_schedule_which_a_load_takes():
    ema = memkit.EMA(decay=0.8, schedule="constant", update_every=3).build(_model())
    state = ema.state_dict()
    diffusers_keys = set(EMAModel(_model().parameters()).state_dict())
    assert set(state) == diffusers_keys | {"schedule", "update_every"}
    assert (state["schedule"], state["update_every"]) == ("constant", 3)
    other = memkit.EMA().build(_model(1))
    other.load_state_dict(state)
    assert (other.config.schedule, other.config.update_every, other.config.decay) == ("constant", 3, 0.8)


def test_save_pretrained_writes_diffusers_file_names_metadata_and_indented_json_and_may_write_twice(tmp_path):
    from safetensors import safe_open

    model = _model()
    ema = memkit.EMA(mode="cpu_only", foreach=False, chunk_mb=3.0).build(model)
    ema.save_pretrained(tmp_path / "one")
    ema.save_pretrained(tmp_path / "one")  # into a folder that exists: overwritten, as diffusers does
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]
    with safe_open(tmp_path / "one" / "diffusion_pytorch_model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers' and diffusers' loaders look for
    text = (tmp_path / "one" / "config.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2)  # diffusers writes its configs indented by 2
    back = memkit.EMA.from_pretrained(tmp_path / "one")
    assert (back.config.mode, back.config.foreach, back.config.chunk_mb) == ("cpu_only", False, 3.0)
    ema.save_pretrained(tmp_path / "shards", max_shard_size=1000)  # 16*32*4 bytes: the first weight alone is 2048
    files = sorted(p.name for p in (tmp_path / "shards").iterdir())
    shards = [n for n in files if n.endswith(".safetensors")]
    assert len(shards) > 1 and all(
        re.fullmatch(r"diffusion_pytorch_model-\d{5}-of-\d{5}\.safetensors", n) for n in shards
    )
    index = (tmp_path / "shards" / "diffusion_pytorch_model.safetensors.index.json").read_text()
    assert index == json.dumps(json.loads(index), indent=2)
    assert set(json.loads(index)["weight_map"].values()) == set(shards)


def test_save_pretrained_of_bare_tensors_names_them_by_position(tmp_path):
    from safetensors.torch import load_file

    model = _model()
    ema = EMAState(list(model.parameters()), decay=0.9)
    assert ema.config == memkit.EMA(decay=0.9)
    ema.save_pretrained(tmp_path / "ema")
    saved = load_file(tmp_path / "ema" / "diffusion_pytorch_model.safetensors")
    assert sorted(saved) == [f"shadow_params.{i}" for i in range(4)]
    for i, p in enumerate(model.parameters()):
        assert torch.equal(saved[f"shadow_params.{i}"], p)
    back = memkit.EMA.from_pretrained(tmp_path / "ema")
    assert back.names == [f"shadow_params.{i}" for i in range(4)]


def test_a_diffusers_model_s_config_is_written_as_diffusers_writes_it(tmp_path):
    from pathlib import Path

    import diffusers
    import numpy as np
    from diffusers import ModelMixin
    from diffusers.configuration_utils import ConfigMixin, register_to_config

    class Tiny(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, scale=(1.0,), where=".", depth=2):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    model = Tiny(scale=np.array([1.5, 2.0]), where=Path("some/folder"))  # depth left at its default
    assert "_use_default_values" in model.config  # diffusers' own key, which its config.json leaves out
    memkit.EMA().build(model).save_pretrained(tmp_path / "ema")
    config = json.loads((tmp_path / "ema" / "config.json").read_text())
    assert config["scale"] == [1.5, 2.0] and config["where"] == "some/folder"  # numpy as a list, others as str
    assert config["_class_name"] == "Tiny" and config["depth"] == 2
    assert config["_diffusers_version"] == diffusers.__version__
    assert not [k for k in config if k.startswith("_") and k not in ("_class_name", "_diffusers_version",
                                                                      "_memkit_parameter_names")]  # fmt: skip


def test_settings_given_beside_a_config_replace_its_values():
    params = list(_model().parameters())
    ema = EMAState(params, config=memkit.EMA(mode="cpu_only", decay=0.5), update_every=2)
    assert ema.config == memkit.EMA(mode="cpu_only", decay=0.5, update_every=2)
    assert EMAState(params, config=memkit.EMA(decay=0.5)).config == memkit.EMA(decay=0.5)
    assert EMAState(params).config == memkit.EMA()


def test_the_warmup_schedule_is_diffusers_with_any_inv_gamma_and_power():
    params = list(_model().parameters())
    settings = dict(decay=0.9999, min_decay=0.0, use_ema_warmup=True, inv_gamma=2.0, power=0.5, update_after_step=3)
    ref = EMAModel(params, **settings)
    ema = EMAState(params, **settings)
    for step in (1, 3, 4, 5, 10, 100, 10_000):
        assert ema.get_decay(step) == pytest.approx(ref.get_decay(step), abs=1e-12), step


def test_a_parameter_list_of_another_length_is_refused_with_the_counts():
    ema = memkit.EMA().build(_model())
    with pytest.raises(ValueError, match="^parameters has 3 tensors, the EMA was built for 4$"):
        ema.step(list(_model().parameters())[:3])


def test_one_staged_parameter_and_the_smallest_chunk_stage_one_element_at_a_time():
    # an fp32 EMA of a bf16 layer: each update stages the parameters through an fp32 buffer of chunk_mb; at 1 byte
    # the buffer holds the one element the floor allows (4 bytes), and a layer without bias is one staged pair
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False).to(torch.bfloat16)
    ema = memkit.EMA(decay=0.9, schedule="constant", dtype=torch.float32, chunk_mb=2**-20).build(model)
    _nudge(model, 1)
    expected = ema.shadow_params[0] + 0.1 * (model.weight.float() - ema.shadow_params[0])
    with memkit.track() as tl:
        ema.step(model)
    assert tl.peak_bytes == 4
    torch.testing.assert_close(ema.shadow_params[0], expected, atol=1e-7, rtol=0)


def test_the_staging_buffer_holds_chunk_mb_or_a_64th_of_what_the_shadows_stand_for_at_least_2_16_elements():
    # an fp32 EMA of a bf16 layer of 64 x 64 = 2**12 elements, staged through one fp32 buffer; what the update
    # allocates is that buffer alone (the shadows are on the compute device: no shadow buffer)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    peaks = []
    for chunk_mb, stands_for in ((0.5, None), (0.5, [2**16]), (0.125, [2**16]), (2.0, [2**12])):
        ema = memkit.EMA(decay=0.9, schedule="constant", dtype=torch.float32, chunk_mb=chunk_mb).build(model)
        ema.stands_for = stands_for  # as a memoized estimate's probe sets it
        _nudge(model, 1)
        expected = ema.shadow_params[0] + 0.1 * (model.weight.float() - ema.shadow_params[0])
        with memkit.track() as tl:
            ema.step(model)
        peaks.append(tl.peak_bytes)
        torch.testing.assert_close(ema.shadow_params[0], expected, atol=1e-7, rtol=0)
    # a 64th of 2**12 is under the floor: 2**16 fp32 elements; standing for 2**16 such layers, a 64th of 2**28 is
    # 2**22, over chunk_mb's 0.5 MiB (2**17 elements) and 0.125 MiB (2**15: under the floor, chunk_mb still caps it)
    # and standing for 2**12, a 64th of 2**24 (2**18 elements) lies between the floor and chunk_mb's 2 MiB
    assert peaks == [2**16 * 4, 2**19, 2**17, 2**20]


def test_a_bf16_ema_stages_chunk_mb_of_bf16_elements():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)  # fp32 parameters, bf16 shadows: staged in bf16
    ema = memkit.EMA(decay=0.9, schedule="constant", dtype=torch.bfloat16, chunk_mb=8 / 2**20).build(model)
    _nudge(model, 1)
    with memkit.track() as tl:
        ema.step(model)
    assert tl.peak_bytes == 8  # 8 bytes: four bf16 elements


def test_lerp_staged_called_alone_sizes_its_buffer_from_the_pairs():
    from memkit.optimizations.ema import _lerp_staged  # importable from ema.py, as before the module split

    shadow, param = torch.zeros(10), torch.arange(10, dtype=torch.bfloat16)
    with memkit.track() as tl:
        _lerp_staged([(shadow, param)], 0.5, torch.device("cpu"), memkit.EMA(chunk_mb=0.125), False, False)
    assert torch.equal(shadow, torch.arange(10.0) / 2)
    assert tl.peak_bytes == 2**15 * 4  # chunk_mb's 0.125 MiB, under the floor of 2**16 elements


@pytest.mark.parametrize("foreach", [True, False])
def test_frozen_integer_and_strided_parameters_follow_diffusers(foreach):
    # diffusers' EMAModel copies what does not train (frozen, integer) and averages the rest; a transposed (non-
    # contiguous) parameter and a second dtype among the staged ones take the update's one-tensor path
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.frozen = torch.nn.Parameter(torch.randn(3, 2), requires_grad=False)
    model.steps = torch.nn.Parameter(torch.arange(4), requires_grad=False)
    model.strided = torch.nn.Parameter(torch.randn(4, 3).t().to(torch.bfloat16))  # staged, not contiguous
    model.fp16 = torch.nn.Parameter(torch.randn(5).half())
    model.plain = torch.nn.Parameter(torch.randn(6))
    assert not model.strided.is_contiguous()
    ref = EMAModel(model.parameters(), decay=0.9, foreach=foreach)
    ema = memkit.EMA(decay=0.9, foreach=foreach, dtype=torch.float32).build(model)
    for _ in range(4):
        with torch.no_grad():
            for p in (model.frozen, model.strided, model.fp16, model.plain):
                p.add_(torch.randn(p.shape).to(p.dtype) * 0.1)
            model.steps.add_(1)
        ref.step(model.parameters())
        ema.step(model)
    assert torch.equal(ema.shadow_params[0], model.frozen) and torch.equal(ema.shadow_params[1], model.steps)
    for a, b in zip(ema.shadow_params, ref.shadow_params, strict=True):  # diffusers averages in the parameter's dtype
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-6 if b.dtype == torch.float32 else 1e-2, rtol=0)


def test_offloaded_shadows_of_two_dtypes_follow_diffusers():
    # an estimate for "cuda" streams every shadow through device buffers (mode offload); the buffers take the first
    # shadow's dtype, and a shadow of another dtype is updated on its own
    from memkit.memory.placement import planning

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    ref = EMAModel(model.parameters(), decay=0.9)
    with planning("cuda"):
        ema = memkit.EMA(decay=0.9, mode="offload").build(model)
        for i in range(3):
            _nudge(model, i)
            ref.step(model.parameters())
            with memkit.track() as tl:
                ema.step(model)
    assert tl.peak_bytes == 2 * 2**16 * 4  # a parameter and a shadow buffer of the 2**16 fp32 elements' floor
    assert [s.dtype for s in ema.shadow_params] == [torch.float32] * 2 + [torch.bfloat16] * 2
    for a, b in zip(ema.shadow_params, ref.shadow_params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
