"""memkit.EMA: the same shadows as diffusers' EMAModel, saved and loaded, every-N, errors, compare and estimate."""

import warnings

import pytest
import torch
from diffusers.training_utils import EMAModel

import memkit
from memkit.optimizations.ema import EMAState, diffusers_check


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


def test_every_n_stays_close_to_every_step_on_a_slowly_moving_model():
    model = _model()
    every = memkit.EMA(decay=0.95, schedule="constant", update_every=4).build(model)
    each = memkit.EMA(decay=0.95, schedule="constant").build(model)
    drift = 1e-3
    for i in range(200):
        _nudge(model, i)  # moves each weight ~0.01 per step at random
        with torch.no_grad():
            for p in model.parameters():
                p.add_(drift)
        each.step(model)
        every.step(model)
    worst = max(float((a - b).abs().max()) for a, b in zip(every.shadow_params, each.shadow_params, strict=True))
    # the every-4 average lags by ~1.5 steps of drift, plus noise of a few per-step moves
    assert worst < 10 * 0.01


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
    assert row["pass"] and row["max |Δema|"] <= 1e-6
    params = sum(p.numel() * 4 for p in memkit.load_model("flux").parameters())
    assert cmp.results["ema"].timeline.peak_by_category()["ema"] == params


def test_estimate_counts_fp32_shadows_as_ema_bytes_and_the_update_as_its_phase():
    tl = memkit.estimate("flux", size="tiny", optimizer="adamw", steps=2, optimizations=[memkit.EMA(mode="device")])
    assert tl.peak_by_category()["ema"] == tl.meta["parameters"] * 4
    plain = memkit.estimate("flux", size="tiny", optimizer="adamw", steps=2)
    assert plain.peak_by_category()["ema"] == 0


def test_the_update_allocates_nothing_and_runs_in_the_ema_phase():
    model = memkit.load_model("flux")
    handle = memkit.EMA(decay=0.9).apply(model)
    with memkit.track(owned=handle) as tl:
        handle.after_step()
    assert tl.peak_bytes == tl.peak_by_category()["ema"]  # no temporary
