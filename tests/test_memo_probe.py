"""The probe of block memoization (``memkit/_memo.py``) without running an estimate: which lists are blocks, which
settings are memoized, how a list is cut and which full blocks the probe's stand for, a preset's probe config and the
full model's parameter count. Fast enough for every mutant (``python -m bench.mutation memo``); the estimates that
check the splice byte for byte are in ``tests/test_memo.py``. Expected values are worked out from the docstrings'
rules (first block and a period kept, then the last ones), not taken from a run."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

# diffusers imports its model classes lazily, seconds each: paid once here, at import (mutation testing forks each
# mutant's test run from a process that imported this file)
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel  # noqa: F401
from torch import nn

import memkit
from memkit import _memo
from memkit.presets import PRESETS


class Block(nn.Module):
    def __init__(self, width: int = 4, bias: bool = True):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=bias)


def stack(n: int, **kw) -> nn.ModuleList:
    return nn.ModuleList([Block(**kw) for _ in range(n)])


# ---- which lists are blocks -------------------------------------------------------------------------------------


def test_block_lists_are_outermost_first_and_none_inside_another():
    outer = nn.ModuleList([nn.Sequential(stack(6)) for _ in range(5)])  # each block holds a list of blocks itself
    model = nn.Module()
    model.add_module("a", outer)
    model.add_module("b", stack(7))
    assert [(name, len(blocks)) for name, blocks in _memo.block_lists(model)] == [("a", 5), ("b", 7)]


def test_the_first_and_last_block_may_differ_but_not_a_middle_one():
    lists = stack(6)
    lists[0], lists[-1] = Block(bias=False), nn.Linear(4, 2)  # SD3's last block: another shape
    assert len(_memo.block_lists(nn.Sequential(lists))) == 1
    for change in (
        lambda b: b.lin.weight.requires_grad_(False),  # a frozen block
        lambda b: b.lin.to(torch.float64),  # another dtype
        lambda b: b.register_buffer("scale", torch.ones(2)),  # a buffer more
    ):
        lists = stack(6)
        change(lists[3])
        assert _memo.block_lists(nn.Sequential(lists)) == []
    lists = stack(6)
    lists[2] = type("Other", (Block,), {})()  # another class with the same tensors
    assert _memo.block_lists(nn.Sequential(lists)) == []
    with_buffers = stack(6)
    for b in with_buffers:
        b.register_buffer("scale", torch.ones(2))
    assert len(_memo.block_lists(nn.Sequential(with_buffers))) == 1


# ---- which settings are memoized ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimizations, kwargs, said",
    [
        ([], {}, None),
        ([memkit.FFSplit(splits=2), memkit.LoRA(rank=4)], {}, None),
        ([memkit.Quantize()], {}, None),
        ([memkit.EMA()], dict(count_ops=True), None),
        ([memkit.EMA(mode="offload")], {}, None),
        ([memkit.EMA(mode="offload")], dict(count_ops=True), "is not memoized when ops are counted"),
        ([memkit.EMA(dtype=torch.float32)], dict(count_ops=True), "(dtype=torch.float32) is not memoized when ops"),
        ([memkit.Checkpointing(pattern="every:2")], {}, None),
        ([memkit.Checkpointing(pattern="every:2")], dict(periodic=False), "is counted from every block"),
        ([memkit.Checkpointing()], dict(periodic=False), None),  # "all": a period of one block
        ([memkit.Checkpointing(provider="offload")], {}, "keeps checkpoint inputs off the device"),
        ([memkit.Checkpointing(pattern="first:2")], {}, "in no repeating period"),
        ([memkit.FFSplit(splits=2), memkit.Offload()], {}, "Offload is not memoized (its state is not a sum"),
        # a memoized optimization before another does not end the check
        ([memkit.Quantize(), memkit.Offload()], {}, "Offload is not memoized"),
        ([memkit.EMA(), memkit.Offload()], {}, "Offload is not memoized"),
        ([memkit.Checkpointing(), memkit.Offload()], {}, "Offload is not memoized"),
    ],
)
def test_unsupported_says_why_a_setting_runs_every_block(optimizations, kwargs, said):
    why = _memo.unsupported(optimizations, None, **kwargs)
    assert why is None if said is None else said in why


def test_a_step_with_mixed_precision_or_a_host_optimizer_runs_every_block():
    assert _memo.unsupported([], None, memkit.Step()) is None
    mixed = _memo.unsupported([], None, memkit.Step(mixed_precision="bf16"))
    assert "mixed_precision='bf16' frees its cast cache" in mixed
    host = _memo.unsupported([], None, memkit.Step(mode="training", optimizer="adamw", optimizer_on="cpu"))
    assert "optimizer_on='cpu' steps one optimizer per parameter" in host
    assert _memo.unsupported([], None, SimpleNamespace()) is None  # a step that says neither: the defaults


# ---- how a list is cut, and what each probe block stands for ----------------------------------------------------


def test_the_probe_keeps_the_first_blocks_a_period_and_the_last():
    assert [_memo.head(p) for p in (1, 2, 3)] == [2, 5, 7] and _memo.head() == 2
    assert _memo.probe_length(20, 3) == 7 + 3 + 1  # 20 - 11 is a whole number of periods
    assert _memo.probe_length(21, 3) == 12  # one block more keeps 21's phase
    assert (_memo.probe_length(19, 2), _memo.probe_length(38, 2), _memo.probe_length(57, 1)) == (9, 8, 4)
    assert _memo.probe_length(5) == _memo.PROBE == 4
    assert _memo.kept(7, 4) == [0, 1, 5, 6]
    assert _memo.kept(13, 9, 2) == [0, 1, 2, 3, 4, 9, 10, 11, 12]
    assert [_memo.own(J, 7, 4) for J in range(7)] == [0, 1, None, None, None, 2, 3]
    assert [_memo.own(J, 13, 9, 2) for J in range(13)] == [0, 1, 2, 3, 4, None, None, None, None, 5, 6, 7, 8]
    # the third block stands for itself and the three left out; with a period of 2 the two after the head do
    assert [_memo.stands_for(b, 7, 4) for b in range(4)] == [1, 1, 4, 1]
    assert [_memo.stands_for(b, 13, 9, 2) for b in range(9)] == [1, 1, 1, 1, 1, 3, 3, 1, 1]
    assert all(type(_memo.stands_for(b, 13, 9, 2)) is int for b in range(9))  # a count of blocks


def test_cut_keeps_the_probe_blocks_in_place():
    model = nn.Module()
    model.blocks = stack(7)
    model.short = stack(5)  # one block more than the probe: its middle block left out
    originals = list(model.blocks)
    lists = _memo.cut(model)
    assert [(name, n) for name, n, _ in lists] == [("blocks", 7), ("short", 5)]
    assert list(model.blocks) == [originals[i] for i in (0, 1, 5, 6)]
    assert lists[0][2] is model.blocks and len(model.short) == 4


def test_cut_with_a_period_leaves_lists_no_longer_than_their_probe():
    model = nn.Module()
    model.blocks = stack(13)
    model.short = stack(8)  # probe_length(8, 2) is 8: nothing to cut
    originals = list(model.blocks)
    lists = _memo.cut(model, period=2)
    assert [(name, n) for name, n, _ in lists] == [("blocks", 13)]
    assert list(model.blocks) == [originals[i] for i in _memo.kept(13, 9, 2)] and len(model.short) == 8


def test_a_probe_built_so_is_checked_not_cut():
    model = nn.Module()
    model.blocks = stack(4)
    model.other = stack(6)
    lists = _memo.cut(model, {"blocks": 19})
    assert lists == [("blocks", 19, model.blocks)] and len(model.other) == 6
    with pytest.raises(_memo.Unsupported, match="the probe's 'blocks' is not a list of 9 blocks"):
        _memo.cut(model, {"blocks": 19}, period=2)
    model.blocks[2] = Block(bias=False)
    with pytest.raises(_memo.Unsupported, match="is not a list of 4 blocks"):
        _memo.cut(model, {"blocks": 19})
    with pytest.raises(_memo.Unsupported, match="'other' is not a list of 4 blocks"):
        _memo.cut(model, {"other": 6})


def test_a_model_cut_whole_cuts_only_its_named_lists():
    chroma = type("ChromaTransformer2DModel", (nn.Module,), {})()
    chroma.approximator = stack(5)  # not blocks to splice
    chroma.transformer_blocks = stack(6)
    lists = _memo.cut(chroma)
    assert [name for name, _, _ in lists] == ["transformer_blocks"]
    assert len(chroma.approximator) == 5 and len(chroma.transformer_blocks) == 4
    assert _memo.cut_whole("ChromaTransformer2DModel") and not _memo.cut_whole("FluxTransformer2DModel")
    assert "Qwen-Image's last block" in _memo.refused("QwenImageTransformer2DModel")
    assert _memo.refused("FluxTransformer2DModel") is None


# ---- a preset's probe ---------------------------------------------------------------------------------------------


def with_tiny(preset: str, **config):
    spec = PRESETS[preset]
    return dataclasses.replace(spec, configs={**spec.configs, "tiny": {**spec.configs["tiny"], **config}})


def test_a_presets_probe_is_built_with_the_probe_blocks_of_each_list():
    flux = with_tiny("flux", num_layers=13, num_single_layers=5)
    build, lengths = _memo.probe_builder(flux, "tiny", torch.float32, 0)
    assert lengths == {"transformer_blocks": 13, "single_transformer_blocks": 5}
    with torch.device("meta"):
        probe = build()
    assert (len(probe.transformer_blocks), len(probe.single_transformer_blocks)) == (4, 4)
    build, lengths = _memo.probe_builder(flux, "tiny", torch.float32, 0, period=2)
    assert lengths == {"transformer_blocks": 13}  # 5 single blocks: no longer than a probe for a period of 2
    with torch.device("meta"):
        assert len(build().transformer_blocks) == 9  # the first, two periods, a period, the last and one more


def test_a_presets_probe_takes_a_missing_length_from_the_class_default():
    spec = PRESETS["wan"]
    config = {k: v for k, v in spec.configs["tiny"].items() if k != "num_layers"}
    wan = dataclasses.replace(spec, configs={**spec.configs, "tiny": config})
    _, lengths = _memo.probe_builder(wan, "tiny", torch.float32, 0)
    assert lengths == {"blocks": 40}  # WanTransformer3DModel's num_layers default
    assert _memo.probe_builder(with_tiny("wan", num_layers=4), "tiny", torch.float32, 0) is None  # nothing to cut
    assert _memo.probe_builder(PRESETS["unet"], "tiny", torch.float32, 0) is None  # no known lists


# ---- the full model's parameters ----------------------------------------------------------------------------------


def test_parameters_add_the_middle_blocks_left_out():
    blocks = stack(4)  # a probe of a list of 10: 6 middle blocks left out, 20 weights each
    blocks[1].lin.bias.requires_grad_(False)
    lists = [("blocks", 10, blocks)]
    assert _memo.parameters(lists, 100) == 100 + 6 * 20
    assert _memo.parameters(lists, 100, trainable=True) == 100 + 6 * 16
    assert _memo.parameters(lists, 100, nbytes=True) == 100 + 6 * 20 * 4
    assert _memo.parameters(lists, 100, trainable=True, nbytes=True) == 100 + 6 * 16 * 4


def test_a_4bit_parameter_weighs_what_its_quant_state_shape_holds():
    packed = nn.Parameter(torch.zeros(8, 1, dtype=torch.uint8), requires_grad=False)  # 16 4-bit weights, 2 a byte
    packed.quant_state = SimpleNamespace(shape=torch.Size([4, 4]))
    assert _memo.weights(packed) == 16 and _memo.weights(nn.Parameter(torch.zeros(3, 5))) == 15
    blocks = nn.ModuleList([nn.Module() for _ in range(4)])
    blocks[1].register_parameter("w", packed)
    assert _memo.parameters([("b", 6, blocks)], 0) == 2 * 16
    assert _memo.parameters([("b", 6, blocks)], 0, nbytes=True) == 2 * 8  # bytes: the packed storage


def test_a_class_without_a_length_key_leaves_that_list_whole(monkeypatch):
    keys = {"blocks": "num_layers", "extra": "no_such_key"}  # a key the class does not take: no length known
    monkeypatch.setitem(_memo._LAYER_KEYS, "WanTransformer3DModel", keys)
    _, lengths = _memo.probe_builder(with_tiny("wan", num_layers=6), "tiny", torch.float32, 0)
    assert lengths == {"blocks": 6}


def marks(layers: tuple[int, ...], n: int, period: int = 1):
    """SD3.5 Medium's tiny preset with ``n`` blocks, ``layers`` of them with a second attention: the probe's marked
    blocks, or None when its probe cannot be built."""
    spec = with_tiny("sd3.5-medium", num_layers=n, dual_attention_layers=layers)
    built = _memo.probe_builder(spec, "tiny", torch.float32, 0, period)
    if built is None:
        return None
    with torch.device("meta"):
        return built[0]().config.dual_attention_layers


def test_a_probe_marks_the_blocks_that_stand_for_marked_layers():
    # kept full blocks: 0, 1, 4, 5 of 6
    assert marks((0,), 6) == (0,)
    assert marks((1, 2, 3, 4), 6) == (1, 2)  # every middle block marked: the probe's middle ones too
    assert marks(tuple(range(6)), 6) == (0, 1, 2, 3)
    assert marks((0, 1), 6) is None  # some middle blocks marked, others not: no block stands for all
    assert marks((4,), 6) is None
    # with a period of 2, 13 blocks: a probe of 9, full blocks 0-4 and 9-12
    assert marks((0, 12), 13, period=2) == (0, 8)
