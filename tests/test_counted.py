"""``memkit.estimate(..., count_ops=True)``: the steady step's ops counted while the estimate runs, equal to
:func:`memkit.steptime.count_ops` counting every block in runs of its own."""

from __future__ import annotations

import weakref

import pytest
import torch
from test_steptime import deep

import memkit
from memkit import _memo
from memkit.steptime import count_ops

ADAMW = "adamw"  # foreach on CUDA: _foreach ops over every block's tensors at once, counted per tensor


@pytest.mark.parametrize(
    "optimizations, optimizer",
    [
        ([memkit.LoRA(rank=4), memkit.Checkpointing()], ADAMW),  # recompute; the adapters' foreach update
        # CI time (10-25 s each): in make test-extended
        pytest.param([], ADAMW, marks=pytest.mark.extended),
        pytest.param([memkit.LoRA(rank=4)], "adamw8bit", marks=pytest.mark.extended),  # a per-parameter update
        pytest.param([memkit.Quantize(method="nf4"), memkit.LoRA(rank=4)], ADAMW, marks=pytest.mark.extended),
        # the foreach lerp counted per tensor, under its shadow's block (in one buffer of every block's shadows)
        ([memkit.LoRA(rank=4), memkit.EMA()], ADAMW),
    ],
    ids=["lora-checkpointing-adamw", "full-adamw", "lora-adamw8bit", "nf4-lora-adamw", "lora-ema-adamw"],
)
@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_the_estimates_probe_counts_what_every_block_runs(optimizations, optimizer):
    build = deep("flux", num_layers=6, num_single_layers=7)  # two lists, each longer than the probe's 4 + 1
    tl = memkit.estimate(build, optimizations=optimizations, optimizer=optimizer, count_ops=True, progress=False)
    whole = count_ops(build, optimizations=optimizations, optimizer=optimizer, memoize=False)
    assert tl.meta["memoized"] and not whole.meta["memoized"]
    assert tl.op_counts.ops == whole.ops  # every op kind, how many times: recompute and the optimizer's included
    assert tl.op_counts.flops > 0 and tl.op_counts.meta["memo"].endswith("4 blocks per list weighted")


@pytest.mark.slow  # ~25 s: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_a_periodic_checkpointing_probe_counts_what_every_block_runs():
    # every other block checkpointed: each probe block of the repeated period counts for the blocks of its phase
    build = deep("flux", num_layers=13, num_single_layers=14)
    opts = [memkit.LoRA(rank=4), memkit.Checkpointing(pattern="every:2")]
    tl = memkit.estimate(build, optimizations=opts, count_ops=True, progress=False)
    whole = count_ops(build, optimizations=opts, memoize=False)
    assert tl.meta["memoized"] and tl.op_counts.ops == whole.ops and tl.op_counts.recompute_flops() > 0
    # count_ops' own probe adds a block, which would shift the pattern's phase: it counts every block
    assert "is counted from every block" in count_ops(build, optimizations=opts).meta["memo"]


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_an_estimate_of_every_block_counts_each_op_once():
    build = deep("flux", num_layers=2, num_single_layers=2)
    opts = [memkit.Checkpointing()]
    tl = memkit.estimate(build, optimizations=opts, memoize=False, count_ops=True, progress=False)
    assert tl.op_counts.ops == count_ops(build, optimizations=opts, memoize=False).ops
    assert tl.op_counts.recompute_flops() > 0


def test_counts_are_kept_with_the_cached_estimate_and_made_when_asked():
    memkit.estimation.clear_cache()
    plain = memkit.estimate("flux", size="tiny", progress=False)
    assert plain.op_counts is None  # not asked: not counted
    counted = memkit.estimate("flux", size="tiny", count_ops=True, progress=False)
    assert not counted.meta["cached"] and counted.op_counts is not None  # the cached one had none: run again
    again = memkit.estimate("flux", size="tiny", count_ops=True, progress=False)
    assert again.meta["cached"] and again.op_counts.ops == counted.op_counts.ops
    assert again.peak_bytes == counted.peak_bytes == plain.peak_bytes  # counting changes no byte


@pytest.mark.extended
def test_a_full_size_presets_probe_counts_what_every_block_runs():
    # the probe built from the preset's config (four blocks per list: no whole model to cut)
    sizes = dict(height=64, width=64, frames=9)
    tl = memkit.estimate("ltx-video", count_ops=True, progress=False, **sizes)
    assert tl.meta["memoized"]
    assert tl.op_counts.ops == count_ops("ltx-video", memoize=False, **sizes).ops


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_a_staged_ema_update_is_never_counted_from_the_probe(monkeypatch):
    # memkit._memo.unsupported keeps a staged EMA (fp32 shadows of bf16 parameters) from counting ops on the probe;
    # were it let through, the counter meets the copies into the staging buffer (no block's) and refuses
    real = _memo.unsupported
    monkeypatch.setattr(
        _memo,
        "unsupported",
        lambda optimizations, parallel, step=None, count_ops=False: real(optimizations, parallel, step),
    )
    build = deep("flux", num_layers=6, num_single_layers=7)
    opts = [memkit.EMA(dtype=torch.float32)]
    tl = memkit.estimate(build, optimizations=opts, count_ops=True, progress=False)
    assert not tl.meta["memoized"] and "not counted per block" in tl.meta["memo"]
    assert tl.op_counts.ops == count_ops(build, optimizations=opts, memoize=False).ops


def test_a_storage_key_names_its_block_only_while_its_tensor_lives_there():
    """The counter asks which block owns the storage an op writes, by key, long after the keys were read: a gradient
    ``zero_grad`` dropped or a weight re-cast to another storage (layerwise casting) owns nothing any more, though the
    allocator may give its address to a new storage (counted as a middle block's, an op outside the blocks would be
    counted n - 3 times: 3.6088 or 3.6110 s for one full Flux step, by where the allocator put it)."""
    from memkit._memo_tagger import OwnedNow, _storages

    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.ones(4)
    kept, dropped, moved = torch.ones(3), weight.grad, weight
    refs = {}
    for t, tag in ((kept, (0, 1)), (dropped, (0, 2)), (moved, (1, 2))):
        refs.update(dict.fromkeys(_storages(t), (tag, weakref.ref(t))))
    keys = {name: _storages(t)[0] for name, t in (("kept", kept), ("dropped", dropped), ("moved", moved))}
    owned = OwnedNow(refs)
    assert [owned.get(keys[n]) for n in ("kept", "dropped", "moved")] == [(0, 1), (0, 2), (1, 2)]
    weight.grad = dropped = None  # zero_grad(set_to_none=True)
    weight.data = torch.zeros(4)  # layerwise casting's re-cast: the same parameter, another storage
    assert owned.get(keys["kept"]) == (0, 1)
    assert owned.get(keys["dropped"]) is None and owned.get(keys["moved"]) is None
    assert owned.get(-1) is None
