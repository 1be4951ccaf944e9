"""FFSplit: same outputs and gradients as the unsplit layer, lower peak, weights untouched.

Tolerances: fp32 outputs and gradients within 1e-5 relative to the largest magnitude (the chunks change only
the order of the sums). bf16: the split's error against a float64 reference stays within 2x the unsplit
bf16 layer's own error plus one bf16 ulp of the output's scale (chunks summed in fp32).
"""

import pytest
import torch
from diffusers.models.attention import FeedForward
from hypothesis import given, settings
from hypothesis import strategies as st

import memkit
from memkit import FFSplit
from memkit.optimizations.feedforward import find_mlps

ACTIVATIONS = ["gelu", "gelu-approximate", "geglu", "geglu-approximate", "swiglu", "linear-silu"]
SPLITS = [1, 2, 3, 4, 8]


def _run(ff, x, backward=True):
    x = x.detach().clone().requires_grad_(backward)
    ff.zero_grad(set_to_none=True)
    y = ff(x)
    if not backward:
        return y.detach(), []
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), [p.grad.clone() for p in ff.parameters()] + [x.grad.clone()]


def _close(a, b, rel=1e-5):
    scale = max(a.abs().max().item(), 1e-6)
    return (a.float() - b.float()).abs().max().item() <= rel * scale


@settings(max_examples=40, deadline=None)
@given(
    act=st.sampled_from(ACTIVATIONS),
    splits=st.sampled_from(SPLITS),
    mode=st.sampled_from(["hidden", "sequence"]),
    recompute=st.sampled_from([None, False]),
    dim=st.integers(8, 24),
    inner=st.integers(8, 40),
    tokens=st.integers(1, 11),
    bias=st.booleans(),
)
def test_fp32_outputs_and_gradients_equal_the_unsplit_layer(act, splits, mode, recompute, dim, inner, tokens, bias):
    torch.manual_seed(0)
    ff = FeedForward(dim, inner_dim=inner, activation_fn=act, bias=bias)
    x = torch.randn(2, tokens, dim)
    y0, g0 = _run(ff, x)
    state = {k: v.clone() for k, v in ff.state_dict().items()}
    with FFSplit(splits=splits, mode=mode, recompute=recompute).apply(ff):
        y1, g1 = _run(ff, x)
    assert _close(y0, y1)
    for a, b in zip(g0, g1, strict=True):
        assert _close(a, b)
    for k, v in ff.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(_run(ff, x, backward=False)[0], y0)  # removed: bit for bit


@settings(max_examples=24, deadline=None)
@given(act=st.sampled_from(ACTIVATIONS), splits=st.sampled_from(SPLITS), inner=st.integers(16, 70))
def test_bf16_split_stays_within_the_unsplit_layers_error(act, splits, inner):
    torch.manual_seed(1)
    ff64 = FeedForward(32, inner_dim=inner, activation_fn=act).double()
    ff = FeedForward(32, inner_dim=inner, activation_fn=act).to(torch.bfloat16)
    ff.load_state_dict({k: v.to(torch.bfloat16) for k, v in ff64.state_dict().items()})
    ff64.load_state_dict({k: v.double() for k, v in ff.state_dict().items()})
    x = torch.randn(2, 9, 32, dtype=torch.bfloat16)
    ref, gref = _run(ff64, x.double())
    y0, g0 = _run(ff, x)
    with FFSplit(splits=splits).apply(ff):
        y1, g1 = _run(ff, x)
    assert y1.dtype == torch.bfloat16
    for r, a, b in zip([ref, *gref], [y0, *g0], [y1, *g1], strict=True):
        ulp = r.abs().max().item() * 2**-8
        err0 = (a.double() - r).abs().max().item()
        err1 = (b.double() - r).abs().max().item()
        assert err1 <= 2 * err0 + ulp, (err0, err1)


def test_the_gate_halves_are_split_consistently_and_weights_are_views():
    ff = FeedForward(8, inner_dim=12, activation_fn="geglu")
    mlp = find_mlps(ff)[0][2]
    assert mlp.gated and mlp.inner == 12 and mlp.proj.weight.shape == (24, 8)
    ptrs = [p.data_ptr() for p in ff.parameters()]
    with FFSplit(splits=5).apply(ff):
        ff(torch.randn(3, 8))
        assert [p.data_ptr() for p in ff.parameters()] == ptrs


def test_dropout_keeps_its_meaning():
    """Eval: identity, so identical outputs. Training with p=1: every intermediate element dropped in every
    chunk, leaving the out-projection's bias (added once); with p=0.5 about half the elements survive."""
    ff = FeedForward(8, inner_dim=16, activation_fn="gelu", dropout=1.0)
    x = torch.randn(4, 8)
    ff.eval()
    y0 = ff(x)
    with FFSplit(splits=4).apply(ff):
        assert _close(y0, ff(x))
        ff.train()
        y = ff(x)
    assert torch.allclose(y, ff.net[2].bias.expand_as(y))
    ff = FeedForward(8, inner_dim=4000, activation_fn="linear-silu", dropout=0.5, bias=False).train()
    ff.net[0].proj.weight.data.fill_(0.1)
    ff.net[2].weight.data.fill_(1.0)
    torch.manual_seed(0)
    x = torch.ones(1, 8)
    full = ff.net[0](x).sum()  # every element equal: the output counts the surviving elements
    with FFSplit(splits=4).apply(ff):
        ratio = (ff(x)[0, 0] / full).item()
    assert 0.8 < ratio < 1.2  # E[mask / (1 - p)] = 1 per element


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="splits must be >= 1"):
        FFSplit(splits=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        FFSplit(mode="tokens")
    with pytest.raises(ValueError, match="splits must be at most the inner dimension"):
        FFSplit(splits=17).apply(FeedForward(4, inner_dim=16))
    with pytest.raises(ValueError, match="ff-split value"):
        FFSplit.parse("four")
    assert FFSplit.parse("4:sequence") == FFSplit(splits=4, mode="sequence")
    assert str(FFSplit(splits=4)) == "ff-split:4"


def test_sequence_mode_handles_uneven_and_short_token_counts():
    ff = FeedForward(8, activation_fn="swiglu")
    for tokens in (1, 3, 10):
        x = torch.randn(2, tokens, 8)
        with FFSplit(splits=4, mode="sequence").apply(ff):
            y = ff(x)
        assert _close(ff(x), y)


def test_plain_sequential_mlps_are_found_and_split():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    model = torch.nn.ModuleDict({"mlp": mlp})
    assert [n for n, _, _ in find_mlps(model)] == ["mlp"]
    x = torch.randn(5, 8)
    y0, g0 = _run(mlp, x)
    with FFSplit(splits=3).apply(model):
        y1, g1 = _run(mlp, x)
    assert _close(y0, y1) and all(_close(a, b) for a, b in zip(g0, g1, strict=True))


@pytest.mark.parametrize("preset", list(memkit.PRESETS))
def test_every_tiny_preset_matches_its_baseline(preset):
    variants = {"hidden": memkit.Variant(optimizations=[FFSplit(splits=3)])}
    if preset in ("dit", "wan"):
        variants["sequence"] = memkit.Variant(optimizations=[FFSplit(splits=3, mode="sequence")])
    cmp = memkit.compare(preset, variants, repeats=0, progress=False)
    for name in variants:
        assert cmp.results[name].passed, (preset, name)


def _intermediate_bytes(x, inner, splits):
    # proj output and activation output of one chunk, fp32
    return 2 * x.shape[0] * x.shape[1] * -(-inner // splits) * 4


def test_inference_peak_drops_with_splits_by_the_intermediates_bytes():
    ff = FeedForward(64, mult=8, activation_fn="gelu")
    x = torch.randn(2, 256, 64)
    peaks = {}
    for splits in (1, 2, 4, 8):
        with torch.no_grad(), FFSplit(splits=splits).apply(ff), memkit.track(ff, inputs=x) as tl:
            ff(x)
        peaks[splits] = tl.peak_bytes - tl.baseline_bytes
    out = x.numel() * 4
    for splits, peak in peaks.items():
        # unsplit: proj and activation outputs; split: one chunk's of those beside the output buffer
        assert peak == _intermediate_bytes(x, 512, splits) + (out if splits > 1 else 0), (splits, peak)
    assert peaks[8] < peaks[4] < peaks[2] < peaks[1]


def test_training_peak_drops_with_recompute():
    ff = FeedForward(64, mult=8, activation_fn="geglu")
    x = torch.randn(2, 256, 64, requires_grad=True)
    peaks = {}
    for name, opts in {"none": [], "plain": [FFSplit(recompute=False)], "recompute": [FFSplit()]}.items():
        with _apply(ff, opts), memkit.track(ff) as tl:
            ff(x).sum().backward()
        ff.zero_grad(set_to_none=True)
        x.grad = None
        peaks[name] = tl.peak_bytes
    assert peaks["recompute"] < peaks["none"]
    assert peaks["recompute"] < peaks["plain"]


def _apply(model, opts):
    from memkit.handle import apply_all

    return apply_all(model, opts)


def test_fake_tensor_estimate_drops_with_splits():
    def model_fn():
        return torch.nn.Sequential(*[FeedForward(256, mult=4, activation_fn="gelu") for _ in range(2)])

    def inputs(model):
        return {"input": torch.randn(2, 1024, 256)}

    base = memkit.estimate(model_fn, inputs, mode="inference")
    split = memkit.estimate(model_fn, inputs, mode="inference", optimizations=[FFSplit(splits=4)])
    assert split.peak_bytes < base.peak_bytes
