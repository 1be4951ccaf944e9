"""FFSplit: same outputs and gradients as the unsplit layer, lower peak, weights untouched.

Tolerances: fp32 outputs and gradients within 1e-5 relative to the largest magnitude (the chunks change only
the order of the sums). bf16 and fp16: the split's error against a float64 reference stays within 2x the
unsplit layer's own error plus one ulp (the dtype's eps) of the output's scale (chunks summed in fp32). Whole tiny
presets: see the two preset tests' docstrings.
"""

import pytest
import torch
from _cpu_estimate import estimate_cpu
from diffusers.models.attention import FeedForward
from hypothesis import given, settings
from hypothesis import strategies as st

import memkit
from memkit import FFSplit
from memkit.optimizations.feedforward import find_mlps

# `make test-fast` keeps one activation (tests/conftest.py); every one runs in `make test` and CI
FAST_CASES = {"test_pr_10623_table_reproduced_beaten_and_approaching_the_floor": {"gelu"}}

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


def _close(a, b, rel=1e-5, floor=1e-6):
    scale = max(a.abs().max().item(), floor)
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


@settings(max_examples=30, deadline=None)
@given(
    act=st.sampled_from(ACTIVATIONS),
    splits=st.sampled_from(SPLITS),
    inner=st.integers(16, 70),
    mode=st.sampled_from(["hidden", "sequence"]),
    recompute=st.sampled_from([None, False]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_low_precision_split_stays_within_the_unsplit_layers_error(act, splits, inner, mode, recompute, dtype):
    torch.manual_seed(1)
    ff64 = FeedForward(32, inner_dim=inner, activation_fn=act).double()
    ff = FeedForward(32, inner_dim=inner, activation_fn=act).to(dtype)
    ff.load_state_dict({k: v.to(dtype) for k, v in ff64.state_dict().items()})
    ff64.load_state_dict({k: v.double() for k, v in ff.state_dict().items()})
    x = torch.randn(2, 9, 32, dtype=dtype)
    ref, gref = _run(ff64, x.double())
    y0, g0 = _run(ff, x)
    with FFSplit(splits=splits, mode=mode, recompute=recompute).apply(ff):
        y1, g1 = _run(ff, x)
    assert y1.dtype == dtype
    eps = torch.finfo(dtype).eps
    for r, a, b in zip([ref, *gref], [y0, *g0], [y1, *g1], strict=True):
        ulp = r.abs().max().item() * eps
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


def _flux_single_block_run(block, hs, ehs, temb):
    x, e = hs.clone().requires_grad_(), ehs.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    a, c = block(x, e, temb)
    w = torch.linspace(-1, 1, c.shape[-1])
    ((a.float() * 1.3).sum() + (c.float() * w).sum()).backward()
    return [a.detach(), c.detach(), x.grad, e.grad] + [p.grad.clone() for p in block.parameters()]


@settings(max_examples=20, deadline=None)
@given(
    splits=st.sampled_from(SPLITS),
    mode=st.sampled_from(["hidden", "sequence"]),
    recompute=st.sampled_from([None, False]),
    tokens=st.integers(1, 9),
)
def test_flux_single_block_mlp_branch_is_split_like_the_unsplit_block(splits, mode, recompute, tokens):
    """The MLP branch of a Flux single block feeds ``proj_out`` through a concatenation: split, it feeds
    ``proj_out``'s MLP columns chunk by chunk (no concatenation) with the same outputs and gradients."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(2)
    block = FluxSingleTransformerBlock(32, 2, 16)
    assert [(n, m.out_start, m.inner) for n, _, m in find_mlps(block)] == [("", 32, 128)]
    args = torch.randn(2, tokens, 32), torch.randn(2, 3, 32), torch.randn(2, 32)
    r0 = _flux_single_block_run(block, *args)
    with FFSplit(splits=splits, mode=mode, recompute=recompute).apply(block):
        assert "forward" in vars(block)
        r1 = _flux_single_block_run(block, *args)
    assert "forward" not in vars(block)
    for a, b in zip(r0, r1, strict=True):
        assert _close(a, b)


def test_a_flux_single_block_of_another_diffusers_version_is_left_unsplit_with_a_warning(monkeypatch):
    """The split rewrites the block's forward; a diffusers whose block computes otherwise (before 0.33 it took
    the concatenated tokens and returned one tensor) must not be run through the rewrite."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    from memkit.optimizations import feedforward as ff

    block = FluxSingleTransformerBlock(32, 2, 16)
    ff._flux_single_forward_known.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(ff, "_FLUX_SINGLE_LINES", ff._FLUX_SINGLE_LINES + ("hidden_states = self.older_api(x)",))
            with pytest.warns(UserWarning, match="FluxSingleTransformerBlock.forward is not the one memkit rewrites"):
                assert find_mlps(block) == []
    finally:
        ff._flux_single_forward_known.cache_clear()
    assert [n for n, _, _ in find_mlps(block)] == [""]  # the installed version is known


def _preset_run(model, inputs, seed=0):
    from memkit.step import model_output

    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    y = model_output(model(**inputs))
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return [y.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _split_layers(model):
    """The layers a split must reach, counted by type (not by FFSplit's own finder)."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    return sum(isinstance(m, (FeedForward, FluxSingleTransformerBlock)) for m in model.modules())


# the presets whose feed-forward layers are not diffusers' FeedForward: FFSplit refuses them, saying so
NO_FEEDFORWARD = {
    "sana": "GLUMBConv",
    # Flux2FeedForward (linear_in, a parameterless SwiGLU, linear_out) is not diffusers' FeedForward, and the single
    # blocks fuse their MLP into the attention's projections (to_qkv_mlp_proj, to_out)
    "flux2-dev": "Flux2FeedForward",
    "auraflow": "AuraFlowFeedForward",  # silu(linear_1(x)) * linear_2(x) -> out_projection: two input projections
    "lumina2": "LuminaFeedForward",  # silu(linear_1(x)) * linear_3(x) -> linear_2, the same
}
# the presets whose blocks' feed-forwards FFSplit leaves whole, with a warning, splitting other MLPs: Z-Image's
# SwiGLU (w1, w3 into w2); its timestep MLP (Linear, SiLU, Linear) is split
UNSPLIT_BLOCKS = {"z-image": "ZImageTransformerBlock"}


@pytest.mark.parametrize("preset", sorted(NO_FEEDFORWARD))
def test_a_model_without_feedforward_layers_is_refused_not_left_unsplit(preset):
    model = memkit.load_model(preset)
    before = {n: m.forward for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=f"ff-split found no feed-forward layer to split in {type(model).__name__}"):
        memkit.FFSplit(splits=2).apply(model)
    assert all(m.forward == before[n] for n, m in model.named_modules())


@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p in memkit.PRESETS if p not in NO_FEEDFORWARD and p not in UNSPLIT_BLOCKS])
def test_every_tiny_preset_outputs_and_gradients_equal_unsplit_fp32(preset):
    """fp32, every split count, both modes, training step: output and every gradient within 1e-5 of its largest
    magnitude, or of 1e-2 x the model's largest gradient for a gradient below that (the attention key biases'
    gradients are zero in exact arithmetic and hold only rounding noise), and every feed-forward layer of the
    preset replaced while applied."""
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    ref = _preset_run(model, inputs)
    expected = _split_layers(model)
    assert expected >= 2
    floor = 1e-2 * max(g.abs().max().item() for g in ref[1:])
    for mode in ("hidden", "sequence"):
        for splits in SPLITS:
            with FFSplit(splits=splits, mode=mode).apply(model):
                assert sum("forward" in vars(m) for m in model.modules()) == expected
                got = _preset_run(model, inputs)
            assert len(got) == len(ref)
            for a, b in zip(ref, got, strict=True):
                assert _close(a, b, floor=floor), (preset, mode, splits)


# slow: every preset (HunyuanVideo 1.5's tiny model alone takes ~30 s); CI runs the core presets' cases, one per
# feed-forward code path, and `make test-extended` the others (tests/conftest.py)
@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p in memkit.PRESETS if p not in NO_FEEDFORWARD and p not in UNSPLIT_BLOCKS])
def test_every_tiny_preset_in_bf16_stays_within_the_unsplit_models_error(preset):
    """bf16, uneven splits (3) and 8: against an fp32 model holding the same (bf16) weights, the split's error
    in the output and every gradient stays within 3x the unsplit bf16 model's error plus two bf16 ulps of the
    tensor's scale. Looser than one layer's bound: through a deep bf16 model a change in the order of the sums
    alone (splits=1 computes the same products) moves some gradients by up to ~2.2x the unsplit model's error
    (UNet, measured)."""
    model = memkit.load_model(preset, dtype=torch.bfloat16)
    ref_model = memkit.load_model(preset)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    inputs = memkit.make_inputs(model)
    ref = _preset_run(
        ref_model, {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    )
    base = _preset_run(model, inputs)
    for mode, splits in (("hidden", 3), ("hidden", 8), ("sequence", 3)):
        with FFSplit(splits=splits, mode=mode).apply(model):
            got = _preset_run(model, inputs)
        for r, a, b in zip(ref, base, got, strict=True):
            ulp = r.abs().max().item() * 2**-8
            err0 = (a.double() - r.double()).abs().max().item()
            err1 = (b.double() - r.double()).abs().max().item()
            assert err1 <= 3 * err0 + 2 * ulp, (preset, mode, splits, err0, err1)


# Chunk-sized tensors alive at once while a chunk's activation runs, read off each activation's code: the
# projection and its activation (gelu, tanh gelu, silu); h, sigmoid(1.702 h) and their product (the sigmoid
# approximation); the hidden and gate halves, act(gate) and the product (gated).
ALIVE = {"gelu": 2, "gelu-approximate": 2, "linear-silu": 2, "geglu-approximate": 3, "geglu": 4, "swiglu": 4}


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_inference_peak_is_the_output_plus_one_chunks_intermediates(act):
    """Real tensors, one layer, no_grad, inner 200 (uneven for 3 and 8): above the weights and the input, the
    split peak is the output buffer plus ALIVE[act] tensors of the largest chunk's size; splits=1 is the
    unsplit layer's peak."""
    ff = FeedForward(32, inner_dim=200, activation_fn=act)
    x = torch.randn(2, 128, 32)

    def peak(opts):
        with torch.no_grad(), _apply(ff, opts), memkit.track(ff, inputs=x) as tl:
            ff(x)
        return tl.peak_bytes - tl.baseline_bytes

    unsplit = peak([])
    assert unsplit == ALIVE[act] * 256 * 200 * 4  # the whole intermediate, no output buffer beside it
    assert peak([FFSplit(splits=1)]) == unsplit
    for splits in (2, 3, 4, 8):
        chunk = 256 * -(-200 // splits) * 4
        assert peak([FFSplit(splits=splits)]) == x.numel() * 4 + ALIVE[act] * chunk, splits


PR_10623 = {"gelu": (5.01, 4.26), "geglu": (8.26, 6.01), "swiglu": (8.26, 6.01), "geglu-approximate": (6.01, 4.51)}


@pytest.mark.parametrize("act", list(PR_10623))
def test_pr_10623_table_reproduced_beaten_and_approaching_the_floor(act):
    """The PR's benchmark (5 FeedForwards, dim 4096, mult 4, batch 2, sequence 8192, fp32, no_grad), estimated
    on fake CUDA tensors: unsplit within 3% of the PR's GPU peak, splits=4 below the PR's split peak, and as
    splits grow the peak is weights + model input + the layer's input + its output + ALIVE[act] chunks."""
    normal, split = PR_10623[act]
    gated = act in ("geglu", "swiglu")

    def est(splits):
        return estimate_cpu(
            lambda: torch.nn.Sequential(*[FeedForward(4096, mult=4, activation_fn=act) for _ in range(5)]),
            lambda model: {"input": torch.randn(2, 8192, 4096)},
            mode="inference",
            device="cuda",
            optimizations=[FFSplit(splits=splits)] if splits > 1 else [],
            progress=False,
        ).peak_bytes

    rows = (2 if gated else 1) * 16384
    weights = 5 * (4096 * rows + rows + 16384 * 4096 + 4096) * 4
    tokens = 2 * 8192
    floor = weights + 3 * tokens * 4096 * 4
    assert abs(est(1) / 2**30 / normal - 1) <= 0.03
    assert est(4) / 2**30 < split
    for splits in (16, 64):
        chunks = ALIVE[act] * tokens * (16384 // splits) * 4
        assert abs(est(splits) - floor - chunks) <= 64 * 1024, splits  # CUDA allocator rounding


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

    base = estimate_cpu(model_fn, inputs, mode="inference")
    split = estimate_cpu(model_fn, inputs, mode="inference", optimizations=[FFSplit(splits=4)])
    assert split.peak_bytes < base.peak_bytes


def _addmm_inplace_flop(self_shape, a_shape, b_shape, *args, **kwargs):
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


IN_PLACE_MATMULS = {torch.ops.aten.addmm_: _addmm_inplace_flop}  # FlopCounterMode counts addmm, not addmm_


def test_recompute_costs_exactly_one_more_input_projection():
    """Matmul FLOPs of a training step: a plain split does the unsplit layer's work; recompute adds one forward of
    the input projection: 1/6 more for a gelu layer, 2/9 for a gated one (the docstring's +17% / +22%)."""
    from torch.utils.flop_counter import FlopCounterMode

    for act, extra in (("gelu", 1 / 6), ("geglu", 2 / 9)):
        ff = FeedForward(16, inner_dim=64, activation_fn=act)
        x = torch.randn(2, 10, 16, requires_grad=True)
        flops = {}
        for name, opts in {"unsplit": [], "plain": [FFSplit(recompute=False)], "recompute": [FFSplit()]}.items():
            with _apply(ff, opts), FlopCounterMode(display=False, custom_mapping=IN_PLACE_MATMULS) as counter:
                ff(x).sum().backward()
            flops[name] = counter.get_total_flops()
        proj = 2 * 20 * 16 * ff.net[0].proj.out_features
        assert flops["plain"] == flops["unsplit"]
        assert flops["recompute"] == flops["unsplit"] + proj
        assert proj / flops["unsplit"] == pytest.approx(extra)


def test_dropout_masks_of_the_forward_are_the_ones_the_backward_uses():
    """With dropout active the output is linear in the out-projection, so sum(g * y) equals
    sum(w2 * dL/dw2) + sum(b2 * dL/db2) only if the backward saw the forward's masks (a recompute would draw
    new ones)."""
    torch.manual_seed(0)
    ff = FeedForward(8, inner_dim=64, activation_fn="gelu", dropout=0.5).train()
    x = torch.randn(3, 5, 8)
    g = torch.randn(3, 5, 8)
    for splits in (1, 4):
        ff.zero_grad(set_to_none=True)
        with FFSplit(splits=splits).apply(ff):
            loss = (ff(x) * g).sum()
            loss.backward()
        out = ff.net[2]
        euler = (out.weight * out.weight.grad).sum() + (out.bias * out.bias.grad).sum()
        assert torch.allclose(loss, euler, rtol=1e-5, atol=1e-5), splits


def test_cli_flag_and_report_variant():
    """``memkit estimate --ff-split 4`` applies the split (a lower peak for tiny Flux at 512 px in inference,
    where the feed-forward intermediates set the peak); ``memkit report`` compares ``ff-split:4``."""
    import contextlib
    import io
    import json

    from memkit.cli import main
    from memkit.cli._common import report_variants

    def estimate(*flags):
        buf = io.StringIO()
        args = ["estimate", "flux", "--size", "tiny", "--inference", "--dtype", "fp32", "--height", "512"]
        with contextlib.redirect_stdout(buf):
            assert main([*args, "--width", "512", "--json", *flags]) == 0
        return json.loads(buf.getvalue())

    base, split = estimate(), estimate("--ff-split", "4")
    assert split["optimizations"] == ["ff-split:4"]
    assert split["peak_bytes"] < base["peak_bytes"]
    assert [str(o) for o in report_variants()["ff-split:4"]] == ["ff-split:4"]


def _tiles_seen(linear: torch.nn.Linear) -> tuple[list[torch.Tensor], torch.utils.hooks.RemovableHandle]:
    """The inputs ``linear`` is called with (its first tile is the split's first chunk)."""
    seen: list[torch.Tensor] = []
    return seen, linear.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))


@pytest.mark.parametrize("splits", [2, 3, 7, 9])
def test_sequence_mode_tiles_the_tokens_not_the_batch_or_the_channels(splits):
    """Batch 3, 7 tokens, 5 channels (every axis a different length): each tile is every sample's and every
    channel's slice of consecutive tokens, the tiles cover the tokens once in order, and outputs and gradients
    equal the unsplit layer's. A split of the batch would give the same outputs: only the tiles show it."""
    torch.manual_seed(3)
    batch, tokens, dim = 3, 7, 5
    ff = FeedForward(dim, inner_dim=12, activation_fn="gelu")
    x = torch.randn(batch, tokens, dim)
    y0, g0 = _run(ff, x)
    seen, hook = _tiles_seen(ff.net[0].proj)
    with FFSplit(splits=splits, mode="sequence").apply(ff):
        y1, g1 = _run(ff, x)
    hook.remove()
    assert len(seen) == min(splits, tokens) > 1
    assert all(t.shape[0] == batch and t.shape[2] == dim and t.shape[1] >= 1 for t in seen)
    assert torch.equal(torch.cat(seen, dim=1), x)
    assert _close(y0, y1) and all(_close(a, b) for a, b in zip(g0, g1, strict=True))


@pytest.mark.parametrize("splits", [2, 4])
def test_sequence_mode_tiles_a_flux_single_blocks_tokens_with_batch_two(splits):
    """The Flux single block's MLP branch in sequence mode: batch 2, 3 text + 6 image tokens, 32 channels. Each
    tile's activation input (rows flattened) is both samples' rows of consecutive tokens, all channels, and the
    tiles cover the 9 tokens once in order; outputs and gradients equal the unsplit block's."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(4)
    block = FluxSingleTransformerBlock(32, 2, 16)
    args = torch.randn(2, 6, 32), torch.randn(2, 3, 32), torch.randn(2, 32)
    whole, hook = _tiles_seen(block.act_mlp)
    r0 = _flux_single_block_run(block, *args)
    hook.remove()
    (whole,) = whole  # (batch, tokens, inner), unsplit
    seen, hook = _tiles_seen(block.act_mlp)
    with FFSplit(splits=splits, mode="sequence").apply(block):
        r1 = _flux_single_block_run(block, *args)
    hook.remove()
    assert len(seen) == splits
    start = 0
    for tile in seen:
        rows, inner = tile.shape
        assert inner == whole.shape[2] and rows % 2 == 0
        expected = whole[:, start : start + rows // 2].reshape(-1, inner)
        assert tile.shape == expected.shape and _close(expected, tile)
        start += rows // 2
    assert start == whole.shape[1] == 9
    for a, b in zip(r0, r1, strict=True):
        assert _close(a, b)


@pytest.mark.parametrize(
    ("preset", "block"), [("hunyuanvideo", "HunyuanVideoSingleTransformerBlock")] + sorted(UNSPLIT_BLOCKS.items())
)
def test_blocks_whose_mlp_it_cannot_split_are_named_in_a_warning(preset, block):
    model = memkit.load_model(preset)
    singles = sum(type(m).__name__ == block for m in model.modules())
    assert singles >= 1
    match = f"leaves the MLP of {singles} {block} blocks whole"
    with pytest.warns(UserWarning, match=match):
        handle = memkit.FFSplit(splits=2).apply(model)
    handle.remove()


def test_bad_arguments_are_refused_naming_the_argument_and_the_allowed_values():
    """Each message in full (a search for part of it would pass a message with text around it)."""
    for splits, kind in ((True, "bool"), (2.0, "float"), ("4", "str")):
        with pytest.raises(TypeError, match=rf"^splits must be an int >= 1, got {kind}$"):
            FFSplit(splits=splits)
    with pytest.raises(ValueError, match=r"^splits must be >= 1, got 0$"):
        FFSplit(splits=0)
    with pytest.raises(ValueError, match=r"^mode must be one of \['hidden', 'sequence'\], got 'tokens'$"):
        FFSplit(mode="tokens")
    with pytest.raises(ValueError, match=r"^recompute must be None, True or False, got 'yes'$"):
        FFSplit(recompute="yes")
    assert FFSplit(splits=1, recompute=True).splits == 1
    with pytest.raises(
        ValueError, match=r"^ff-split value must be SPLITS or SPLITS:MODE \(e\.g\. '4', '4:sequence'\), "
    ):
        FFSplit.parse("four")
    with pytest.raises(ValueError, match=r"^ff-split value must be SPLITS or SPLITS:MODE .*, got 'x:sequence'$"):
        FFSplit.parse("x:sequence")
    with pytest.raises(ValueError, match=r"^mode must be one of"):
        FFSplit.parse("4:tokens")
    assert FFSplit.parse("4") == FFSplit(splits=4, mode="hidden")
    assert FFSplit.parse("8:sequence") == FFSplit(splits=8, mode="sequence")
    assert str(FFSplit(splits=8, mode="sequence")) == "ff-split:8:sequence"
    assert str(FFSplit(splits=2)) == "ff-split:2"


def test_splits_at_most_the_inner_dimension_in_hidden_mode_only():
    """``splits`` equal to the inner dimension runs (one unit per chunk); one more is refused, naming the layer (the
    model's class for the model itself); sequence mode tiles tokens, so any count runs."""
    ff = FeedForward(4, inner_dim=16)
    x = torch.randn(2, 3, 4)
    y0, g0 = _run(ff, x)
    for opts in (FFSplit(splits=16), FFSplit(splits=17, mode="sequence")):
        with opts.apply(ff) as handle:
            y1, g1 = _run(ff, x)
        assert handle.name == str(opts)
        assert _close(y0, y1) and all(_close(a, b) for a, b in zip(g0, g1, strict=True))
    message = r"^splits must be at most the inner dimension of every feed-forward layer, got splits=17 > 16 \({}\)$"
    with pytest.raises(ValueError, match=message.format("FeedForward")):
        FFSplit(splits=17).apply(ff)
    with pytest.raises(ValueError, match=message.format("mlp")):
        FFSplit(splits=17).apply(torch.nn.ModuleDict({"mlp": ff}))
    assert "forward" not in vars(ff)


def test_a_model_without_a_feedforward_layer_is_refused_in_full():
    with pytest.raises(ValueError) as info:
        FFSplit().apply(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert str(info.value) == (
        "ff-split found no feed-forward layer to split in Sequential: it splits diffusers' FeedForward (Linear, "
        "activation, Linear) and Flux's single-block MLP; this model's feed-forward, if any, is another kind (Sana's "
        "GLUMBConv is convolutions)"
    )


def _seq(*modules):
    return torch.nn.Sequential(*modules)


def test_only_the_layer_shapes_it_can_split_are_found_with_their_parts():
    """Plain MLPs: Linear, activation, [Dropout], Linear, the second reading the first's outputs. diffusers
    FeedForward: one activation projection, one Linear, Dropouts only. Each found layer's parts are the model's own
    modules (the split reads their weights)."""
    from torch import nn

    drop = nn.Dropout(0.1)
    plain = _seq(nn.Linear(8, 32), nn.SiLU(), drop, nn.Linear(32, 8))
    ((_, _, mlp),) = find_mlps(plain)
    assert (mlp.proj, mlp.act, mlp.dropout, mlp.out, mlp.final_dropout) == (plain[0], plain[1], drop, plain[3], None)
    assert mlp.gated is False and mlp.inner == 32 and mlp.out_start == 0
    not_mlps = [
        _seq(nn.Linear(8, 32), nn.GELU()),  # no out-projection
        _seq(nn.Linear(8, 32), nn.GELU(), nn.Dropout(), nn.Linear(32, 8), nn.Dropout()),  # five
        _seq(nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 8)),  # no activation
        _seq(nn.Identity(), nn.GELU(), nn.Linear(8, 8)),  # no input projection
        _seq(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 8)),  # a Linear where Dropout goes
        _seq(nn.Linear(8, 32), nn.GELU(), nn.Dropout(), nn.GELU()),  # no out-projection
        _seq(nn.Linear(8, 32), nn.GELU(), nn.Linear(16, 8)),  # the out-projection reads another width
    ]
    for module in not_mlps:
        assert find_mlps(module) == [], module
    ff = FeedForward(8, inner_dim=16, activation_fn="geglu", dropout=0.1, final_dropout=True)
    ((_, _, mlp),) = find_mlps(ff)
    assert (mlp.proj, mlp.dropout, mlp.out, mlp.final_dropout) == (ff.net[0].proj, ff.net[1], ff.net[2], ff.net[3])
    assert mlp.gated and mlp.inner == 16
    for act in ACTIVATIONS:
        ((_, _, mlp),) = find_mlps(FeedForward(8, inner_dim=16, activation_fn=act))
        assert mlp.gated == (act in ("geglu", "swiglu")) and mlp.inner == 16, act  # geglu-approximate: sigmoid GELU
    ff.net.append(nn.Identity())  # a module neither Dropout nor the out-projection
    assert find_mlps(ff) == []
    ff = FeedForward(8, inner_dim=16)
    ff.net.insert(1, nn.Linear(16, 16))  # two Linears after the activation
    assert find_mlps(ff) == []
    ff = FeedForward(8, inner_dim=16)
    ff.net = nn.ModuleList([ff.net[0], ff.net[2]])  # no Dropout at all: found, with none
    ((_, _, mlp),) = find_mlps(ff)
    assert (mlp.proj, mlp.out, mlp.dropout, mlp.final_dropout) == (ff.net[0].proj, ff.net[1], None, None)


def test_flux_single_blocks_of_another_shape_or_class_are_not_split():
    """Only Flux's own single block whose ``proj_out`` reads ``[attention (dim), mlp (inner)]`` and whose activation
    is a known one: a subclass may compute otherwise."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    class Sub(FluxSingleTransformerBlock):
        pass

    block = FluxSingleTransformerBlock(32, 2, 16)
    ((_, _, mlp),) = find_mlps(block)
    assert (mlp.proj, mlp.act, mlp.out, mlp.dropout, mlp.final_dropout) == (
        block.proj_mlp,
        block.act_mlp,
        block.proj_out,
        None,
        None,
    )
    assert mlp.gated is False and mlp.out_start == 32 and mlp.inner == 128
    assert find_mlps(Sub(32, 2, 16)) == []
    block = FluxSingleTransformerBlock(32, 2, 16)
    block.act_mlp = torch.nn.Identity()
    assert find_mlps(block) == []
    block = FluxSingleTransformerBlock(32, 2, 16)
    block.proj_mlp = torch.nn.Linear(16, 128)  # proj_out's first 32 columns would not be the attention's
    assert find_mlps(block) == []


def test_the_final_dropout_acts_once_on_the_summed_output():
    """p=1 in training: the final dropout zeroes the whole output (the unsplit layer's too); without it the split
    would leave the out-projection's bias. A plain MLP's dropout with p=1 leaves exactly that bias."""
    ff = FeedForward(8, inner_dim=16, activation_fn="gelu", dropout=1.0, final_dropout=True).train()
    x = torch.randn(3, 8)
    assert torch.equal(ff(x), torch.zeros(3, 8))
    for splits in (1, 4):
        with FFSplit(splits=splits).apply(ff):
            assert torch.equal(ff(x), torch.zeros(3, 8))
    mlp = _seq(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(1.0), torch.nn.Linear(16, 8)).train()
    with FFSplit(splits=4).apply(mlp):
        assert torch.equal(mlp(x), mlp[3].bias.expand(3, 8))


def test_sequence_mode_passes_the_callers_extra_arguments_to_the_layer():
    """Each tile runs the layer's own forward with the call's other arguments (diffusers' FeedForward warns about
    a ``scale`` it is given, split or not)."""
    ff = FeedForward(8, inner_dim=16)
    x = torch.randn(2, 6, 8)
    with FFSplit(splits=3, mode="sequence").apply(ff):
        with pytest.warns(FutureWarning, match="scale"):
            ff(x, scale=1.0)
        with pytest.warns(FutureWarning, match="scale"):
            ff(x, 1.0)


def test_remove_puts_back_a_forward_the_instance_had_before():
    ff = FeedForward(8, inner_dim=16)
    own = ff.forward  # a bound method stored on the instance, as another wrapper would leave it
    ff.forward = own
    with FFSplit(splits=2).apply(ff):
        assert vars(ff)["forward"] is not own
    assert vars(ff)["forward"] is own
    plain = FeedForward(8, inner_dim=16)
    with FFSplit(splits=2).apply(plain):
        pass
    assert "forward" not in vars(plain)


def test_flux_single_block_with_rotary_embedding_equals_the_unsplit_block():
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(5)
    block = FluxSingleTransformerBlock(32, 2, 16)
    hs, ehs, temb = torch.randn(2, 4, 32), torch.randn(2, 3, 32), torch.randn(2, 32)
    rotary = torch.randn(7, 16), torch.randn(7, 16)
    with torch.no_grad():
        ref = block(hs, ehs, temb, image_rotary_emb=rotary)
        plain = block(hs, ehs, temb)
        assert not _close(ref[1], plain[1])  # the embedding matters
        for mode in ("hidden", "sequence"):
            with FFSplit(splits=2, mode=mode).apply(block):
                got = block(hs, ehs, temb, image_rotary_emb=rotary)
            assert all(_close(a, b) for a, b in zip(ref, got, strict=True)), mode


def test_flux_single_block_clips_fp16_outputs_as_the_unsplit_block_and_fp32_not_at_all():
    """fp16: outputs past fp16's largest finite value are clipped to it, as diffusers' block does (no inf). fp32
    outputs are never clipped. (A large gate makes them large: large out-projection weights would overflow a
    chunk's fp16 partial sum, which the split rounds once per chunk, before the unsplit layer's whole sum does.)"""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(32, 2, 16).half()
    block.norm.linear.weight.data[64:] *= 2e5  # the gate's rows: outputs past fp16's largest value, both signs
    block.norm.linear.bias.data[64:] *= 2e5
    hs, ehs, temb = torch.randn(2, 4, 32).half(), torch.randn(2, 3, 32).half(), torch.randn(2, 32).half()
    with torch.no_grad():
        _, ref = block(hs, ehs, temb)
        with FFSplit(splits=2).apply(block):
            _, got = block(hs, ehs, temb)
    assert (ref == 65504).any() and (ref == -65504).any()
    assert torch.equal(ref == 65504, got == 65504) and torch.equal(ref == -65504, got == -65504)
    assert got.isfinite().all()
    block = FluxSingleTransformerBlock(32, 2, 16)
    hs = torch.randn(2, 4, 32) * 1e6
    with torch.no_grad():
        _, ref = block(hs, ehs.float(), temb.float())
        with FFSplit(splits=2).apply(block):
            _, got = block(hs, ehs.float(), temb.float())
    assert ref.abs().max() > 65504 and _close(ref, got)


def test_weights_stored_quantized_are_refused_naming_the_layer():
    """fp8 or int8 storage, bitsandbytes' ``quant_state``, a tensor subclass (torchao): the split slices the weight
    itself. Only Linear layers' weights count: a Flux block's fp8 norm weight is not a quantized projection."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    class Packed(torch.Tensor):
        pass

    def refused(change, where="mlp.net.0.proj"):
        ff = FeedForward(8, inner_dim=16)
        model = torch.nn.ModuleDict({"mlp": ff})
        change(ff.net[0].proj)
        with pytest.raises(ValueError, match=rf"^ff-split cannot split {where}: its weight is stored quantized \("):
            FFSplit(splits=2).apply(model)
        return ff

    def cast(dtype):
        return lambda layer: setattr(layer, "weight", torch.nn.Parameter(layer.weight.to(dtype), requires_grad=False))

    refused(cast(torch.float8_e4m3fn))
    refused(cast(torch.int8))
    refused(lambda layer: setattr(layer.weight, "quant_state", object()))
    refused(lambda layer: setattr(layer, "weight", torch.nn.Parameter(layer.weight.detach().as_subclass(Packed))))
    ff = FeedForward(8, inner_dim=16)
    cast(torch.float8_e4m3fn)(ff.net[2])
    with pytest.raises(ValueError) as info:
        FFSplit(splits=2).apply(ff)
    assert str(info.value) == (
        "ff-split cannot split net.2: its weight is stored quantized (Tensor, torch.float8_e4m3fn) and the split "
        "slices the weight itself; ff-split and memkit.Quantize do not compose, leave one of them out"
    )
    block = FluxSingleTransformerBlock(32, 2, 16)
    norm = block.attn.norm_q
    norm.weight = torch.nn.Parameter(norm.weight.to(torch.float8_e4m3fn), requires_grad=False)
    FFSplit(splits=2).apply(block).remove()


def test_blocks_it_cannot_split_are_counted_and_named_in_full():
    """A block class it has no rewrite for (matched by class name) is counted per class in one warning each,
    with the reason, and the number of layers it does split."""
    ZImage = type("ZImageTransformerBlock", (torch.nn.Module,), {})
    model = torch.nn.ModuleDict({"a": ZImage(), "b": ZImage(), "ff": FeedForward(8, inner_dim=16)})
    with pytest.warns(UserWarning) as record:
        FFSplit(splits=2).apply(model).remove()
    assert [str(w.message) for w in record] == [
        "ff-split leaves the MLP of 2 ZImageTransformerBlock blocks whole (a SwiGLU feed-forward, w1 and w3 into w2: "
        "a forward it has no rewrite for); it splits the other 1 feed-forward layers"
    ]


@pytest.mark.parametrize("act", ["gelu", "geglu"])
def test_float64_outputs_and_gradients_equal_the_unsplit_layer_to_double_precision(act):
    """fp64 is computed and accumulated in fp64 (only fp16 and bf16 chunks are summed in fp32): within 1e-12."""
    torch.manual_seed(6)
    ff = FeedForward(16, inner_dim=48, activation_fn=act).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y0, g0 = _run(ff, x)
    for recompute in (None, False):
        with FFSplit(splits=4, recompute=recompute).apply(ff):
            y1, g1 = _run(ff, x)
        assert y1.dtype == torch.float64
        for a, b in zip([y0, *g0], [y1, *g1], strict=True):
            assert _close(a, b, rel=1e-12), recompute


@pytest.mark.parametrize("act", ["gelu", "geglu"])
@pytest.mark.parametrize("frozen", ["input", "proj.weight", "proj.bias", "out.weight"])
def test_the_recomputed_backward_makes_no_gradient_buffer_for_a_frozen_tensor(act, frozen):
    """A training step's peak (the recomputing backward holds every gradient buffer to its end) is lower by exactly
    the bytes of the one tensor that needs no gradient: the input (a model's first layer), or a frozen weight."""
    torch.manual_seed(7)

    def peak(frozen):
        ff = FeedForward(32, inner_dim=200, activation_fn=act)
        x = torch.randn(2, 128, 32, requires_grad=frozen != "input")
        tensors = {"input": x, "proj.weight": ff.net[0].proj.weight, "proj.bias": ff.net[0].proj.bias}
        tensors["out.weight"] = ff.net[2].weight
        if frozen != "input" and frozen is not None:
            tensors[frozen].requires_grad_(False)
        with FFSplit(splits=4).apply(ff), memkit.track(ff) as tl:
            ff(x).sum().backward()
        return tl.peak_bytes, tensors[frozen or "input"].nbytes

    trained, _ = peak(None)
    lower, nbytes = peak(frozen)
    assert trained - lower == nbytes


@pytest.mark.parametrize("act", ["gelu", "geglu"])
def test_sequence_mode_peak_is_the_output_one_tile_output_and_one_tiles_intermediates(act):
    """no_grad, 256 tokens: splits=s holds the whole output, the first tile's output (kept until the end) and
    ALIVE[act] intermediates of one tile (256 / s rows). One tile (splits=1, or a single token) runs the layer
    whole: the unsplit peak, with no output buffer beside it."""
    ff = FeedForward(32, inner_dim=200, activation_fn=act)

    def peak(opts, x):
        with torch.no_grad(), _apply(ff, opts), memkit.track(ff, inputs=x) as tl:
            ff(x)
        return tl.peak_bytes - tl.baseline_bytes

    x = torch.randn(2, 128, 32)
    unsplit = peak([], x)
    assert peak([FFSplit(splits=1, mode="sequence")], x) == unsplit == ALIVE[act] * 256 * 200 * 4
    for splits in (2, 4):
        rows = 256 // splits
        expected = x.nbytes + rows * 32 * 4 + ALIVE[act] * rows * 200 * 4
        assert peak([FFSplit(splits=splits, mode="sequence")], x) == expected, splits
    one = torch.randn(2, 1, 32)
    assert peak([FFSplit(splits=4, mode="sequence")], one) == peak([], one)

    def allocations(opts, x):
        with torch.no_grad(), _apply(ff, opts), memkit.track(ff, inputs=x) as tl:
            ff(x)
        return list(tl.signed_bytes)

    small = torch.randn(2, 16, 32)  # one tile: the layer's own allocations, in order, and no output copy
    assert allocations([FFSplit(splits=1, mode="sequence")], small) == allocations([], small)


@pytest.mark.parametrize("mode", ["hidden", "sequence"])
def test_a_single_token_without_batch_or_token_axis_equals_the_unsplit_layer(mode):
    """A 1-D input (one token's channels): sequence mode has no token axis to tile and runs the layer whole."""
    torch.manual_seed(8)
    ff = FeedForward(8, inner_dim=16, activation_fn="geglu")
    x = torch.randn(8)
    y0, g0 = _run(ff, x)
    with FFSplit(splits=4, mode=mode).apply(ff):
        y1, g1 = _run(ff, x)
    assert y1.shape == (8,)
    assert _close(y0, y1) and all(_close(a, b) for a, b in zip(g0, g1, strict=True))


@pytest.mark.parametrize("act", ["gelu", "geglu"])
@pytest.mark.parametrize("recompute", [None, False])
def test_bf16_sums_of_many_chunks_are_accumulated_in_fp32(act, recompute):
    """256 chunks of one inner unit each: the output and the input gradient are sums of 256 chunk products, which
    bf16 accumulation would round 256 times (~5 ulps off, measured); summed in fp32 they stay within the
    low-precision bound of the test above (2x the unsplit layer's error plus one ulp). The plain split's backward
    (recompute=False) is autograd's, which sums the chunks' input gradients in bf16 (~4x the bound at 256
    chunks, measured): only its output is held to the bound."""
    torch.manual_seed(1)
    ff64 = FeedForward(32, inner_dim=256, activation_fn=act).double()
    ff = FeedForward(32, inner_dim=256, activation_fn=act).to(torch.bfloat16)
    ff.load_state_dict({k: v.to(torch.bfloat16) for k, v in ff64.state_dict().items()})
    ff64.load_state_dict({k: v.double() for k, v in ff.state_dict().items()})
    x = torch.randn(2, 9, 32, dtype=torch.bfloat16)
    ref, gref = _run(ff64, x.double())
    y0, g0 = _run(ff, x)
    with FFSplit(splits=256, recompute=recompute).apply(ff):
        y1, g1 = _run(ff, x)
    checked = len(gref) + 1 if recompute is None else 1
    for r, a, b in list(zip([ref, *gref], [y0, *g0], [y1, *g1], strict=True))[:checked]:
        ulp = r.abs().max().item() * torch.finfo(torch.bfloat16).eps
        err0 = (a.double() - r).abs().max().item()
        err1 = (b.double() - r).abs().max().item()
        assert err1 <= 2 * err0 + ulp, (err0, err1)


@pytest.mark.parametrize("recompute", [None, False])
def test_the_split_runs_where_the_model_is(recompute):
    """A model on the meta device (as an estimate builds it) trains through the split: the output and every gradient
    on that device, none made on the CPU by default."""
    ff = FeedForward(8, inner_dim=16, activation_fn="geglu").to("meta")
    x = torch.randn(2, 3, 8, device="meta", requires_grad=True)
    with FFSplit(splits=4, recompute=recompute).apply(ff):
        y = ff(x)
        y.sum().backward()
    assert y.device.type == "meta" and y.shape == (2, 3, 8)
    for t in [x, *ff.parameters()]:
        assert t.grad.device.type == "meta" and t.grad.shape == t.shape


def test_sequence_mode_tiles_a_2d_input_along_its_tokens():
    """(tokens, channels) without a batch axis: the tokens are the first axis, tiled as with a batch."""
    torch.manual_seed(9)
    ff = FeedForward(5, inner_dim=12, activation_fn="gelu")
    x = torch.randn(7, 5)
    y0, g0 = _run(ff, x)
    seen, hook = _tiles_seen(ff.net[0].proj)
    with FFSplit(splits=3, mode="sequence").apply(ff):
        y1, g1 = _run(ff, x)
    hook.remove()
    assert [t.shape for t in seen] == [(3, 5), (2, 5), (2, 5)]
    assert torch.equal(torch.cat(seen), x)
    assert _close(y0, y1) and all(_close(a, b) for a, b in zip(g0, g1, strict=True))


@pytest.mark.parametrize(("recompute", "runs"), [(False, 1), (None, 2), (True, 2)])
def test_flux_single_block_activation_runs_once_per_chunk_and_again_in_the_recomputing_backward(recompute, runs):
    """A training step through a split Flux single block (inner 128, splits 4, 16 rows): the MLP activation runs on
    each 32-column chunk in the forward, and once more per chunk in the backward only where it recomputes."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(2)
    block = FluxSingleTransformerBlock(32, 2, 16)
    args = torch.randn(2, 5, 32), torch.randn(2, 3, 32), torch.randn(2, 32)
    calls, hook = _tiles_seen(block.act_mlp)
    with FFSplit(splits=4, recompute=recompute).apply(block):
        _flux_single_block_run(block, *args)
    hook.remove()
    assert [tuple(t.shape) for t in calls] == [(16, 32)] * 4 * runs


def test_flux_single_block_passes_the_attention_kwargs_on():
    """``joint_attention_kwargs`` reach the attention (here a mask hiding the last three tokens), split or not."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(2)
    block = FluxSingleTransformerBlock(32, 2, 16)
    args = torch.randn(2, 5, 32), torch.randn(2, 3, 32), torch.randn(2, 32)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    mask[..., 5:] = False
    with torch.no_grad():
        ref = block(*args, joint_attention_kwargs={"attention_mask": mask})
        assert not _close(ref[1], block(*args)[1])  # the mask matters
        with FFSplit(splits=2).apply(block):
            got = block(*args, joint_attention_kwargs={"attention_mask": mask})
    assert all(_close(a, b) for a, b in zip(ref, got, strict=True))
