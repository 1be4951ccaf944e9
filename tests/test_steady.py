"""The steady step of a memoized estimate derived from the first step's forward and backward (memkit._steady):
used where the settings allow it, refused where the first step's forward and backward do not repeat, and byte-equal
to running both steps whole either way (the presets and settings are checked in tests/test_memo.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memkit
from memkit import _steady
from memkit.estimation import clear_cache
from tests.test_memo import SETTINGS, assert_same, both, deep

# `make test-fast` keeps these cases (tests/conftest.py); the others run in `make test` and CI
FAST_CASES = {
    "test_counted_ops_are_the_steady_step_s": {"default"},
    "test_which_settings_derive_the_steady_step": {
        "default-True",
        "nf4-lora-True",
        "first-step-False",
        "inference-False",
    },
}


@pytest.mark.parametrize(
    "setting, derived",
    [
        ("default", True),
        ("checkpointing", True),
        ("lora", True),
        ("grad-accum-2", True),  # both micro-batches' forward and backward repeat
        ("nf4-lora", True),
        ("fp8-storage-lora", True),  # each forward replaces the fp8 weights' storages (layerwise casting)
        ("fused-backward", False),  # the update runs inside the backward
        ("sgd-3-steps", False),  # steps=3 measures the last step alone
        ("first-step", False),
        ("no-optimizer", False),  # the gradients accumulate: the second backward adds into the first's
        ("inference", False),
    ],
)
def test_which_settings_derive_the_steady_step(setting, derived):
    preset = "flux" if setting == "fp8-storage-lora" else "wan"  # (the splice of Wan's fp8 probe: test_memo.py)
    tl = memkit.estimate(deep(preset), progress=False, **SETTINGS.get(setting, {}))
    assert tl.meta["memoized"], tl.meta["memo"]
    assert tl.meta["steady_derived"] is derived
    assert ("first step's" in tl.meta["memo"]) is derived


def test_fsdp_runs_the_steady_step():
    sharded = memkit.estimate(deep("wan"), progress=False, parallel=memkit.FSDP(world_size=2))
    assert sharded.meta["memoized"] and not sharded.meta["steady_derived"]


@pytest.mark.parametrize("setting", ["default", "checkpointing", "lora"])
def test_counted_ops_are_the_steady_step_s(setting, monkeypatch):
    # count_ops counts the first step's forward and backward with the steady update: the very counts of the steady
    # step run whole (memkit._steady.ENABLED = False), which tests/test_counted.py holds against every block run
    kwargs = dict(progress=False, count_ops=True, **SETTINGS.get(setting, {}))
    derived = memkit.estimate(deep("wan"), **kwargs)
    monkeypatch.setattr(_steady, "ENABLED", False)
    clear_cache()  # the same arguments again would be answered from the process's cache
    ran = memkit.estimate(deep("wan"), **kwargs)
    assert derived.meta["steady_derived"] and not ran.meta["steady_derived"]
    assert derived.op_counts.ops == ran.op_counts.ops
    assert derived.peak_bytes == ran.peak_bytes


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.lin(x))


class _Toy(nn.Module):
    """Six identical blocks; ``remembers``: the first forward makes a tensor every later step keeps (a lazily built
    table); ``drops``: the first forward frees a tensor made before the step (a buffer the model lets go); ``recasts``:
    each forward gives a frozen parameter a new storage (as diffusers' layerwise casting stores it again)."""

    def __init__(self, remembers=False, drops=False, recasts=False):
        super().__init__()
        self.proj_in, self.proj_out = nn.Linear(64, 64), nn.Linear(64, 64)
        self.blocks = nn.ModuleList(_Block() for _ in range(6))
        self.remembers, self.drops, self.recasts = remembers, drops, recasts
        self.frozen = nn.Parameter(torch.ones(4096), requires_grad=False)
        self.table = None
        self.register_buffer("scratch", torch.ones(4096) if drops else None)

    def forward(self, x):
        if self.remembers and self.table is None:
            self.table = torch.ones(8192)
        if self.drops:
            self.scratch = None
        if self.recasts:
            self.frozen.data = self.frozen.data.clone()
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


def _inputs(model):
    return {"x": torch.randn(8, 64)}


@pytest.mark.parametrize("kind", ["plain", "recasts", "remembers", "drops"])
def test_a_forward_that_does_not_repeat_runs_the_steady_step(kind):
    def build():
        return _Toy(remembers=kind == "remembers", drops=kind == "drops", recasts=kind == "recasts")

    memo, slow = both(build, inputs=_inputs)
    assert_same(memo, slow)  # the same events either way
    # the plain and recast models derive their steady step; the others' first forward does what the second does not
    assert memo.meta["steady_derived"] is (kind in ("plain", "recasts"))
    if kind == "remembers":  # the table is made in the first step only
        assert memo.meta["first_step_peak_bytes"] > memo.meta["steady_peak_bytes"] - 32768
