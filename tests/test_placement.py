"""The estimate's plan (planned device, host and disk notes) is read directly by the optimizations, whatever else
was imported."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import memkit
from memkit.memory import placement
from memkit.memory.placement import (
    current_plan,
    note_disk_memory,
    note_host_memory,
    noted_in_host,
    planned_device,
    planning,
)


def test_a_plan_is_current_inside_planning_only():
    assert current_plan() is None and planned_device() is None
    with planning("cuda") as plan:
        assert current_plan() is plan and planned_device() == "cuda"
        with planning("cpu") as inner:
            assert planned_device() == "cpu" and current_plan() is inner
        assert current_plan() is plan
    assert current_plan() is None
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        with planning("tpu"):
            pass


def test_host_memory_is_noted_only_in_a_plan_for_cuda():
    t = torch.empty(4)
    note_host_memory("ema", [t])  # outside an estimate: nothing
    with planning("cpu") as cpu:
        note_host_memory("ema", [t])
        assert not noted_in_host([t])
    assert cpu.host == {}
    with planning("cuda") as cuda:
        note_host_memory("ema", [t])
        assert cuda.host == {"ema": [t]}
        assert noted_in_host([t]) and noted_in_host([t[:2]])  # a view: the same storage
        assert not noted_in_host([torch.empty(4)]) and not noted_in_host([])


def test_disk_memory_is_noted_in_any_plan():
    note_disk_memory(10)
    with planning("cpu") as plan:
        note_disk_memory(3)
        note_disk_memory(4.0)
    assert plan.disk == [3, 4]


def test_the_estimation_module_s_names_are_the_ledger_s():
    for name in ("planned_device", "note_host_memory", "noted_in_host", "note_disk_memory"):
        assert getattr(memkit.estimation, name) is getattr(placement, name)


@pytest.mark.slow  # a fresh interpreter importing memkit and torch: seconds
def test_optimizations_see_the_plan_without_memkit_estimation_imported():
    # before: they looked memkit.estimation up in sys.modules, so a plan made without importing it went unseen
    code = (
        "import sys\n"
        "from memkit.memory.placement import planning\n"
        "from memkit.optimizations._common import planned_cuda\n"
        "assert 'memkit.estimation' not in sys.modules\n"
        "import torch, memkit\n"
        "with planning('cuda') as plan:\n"
        "    assert planned_cuda()\n"
        "    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)]))\n"
        "    memkit.EMA(mode='offload').build(model)\n"
        "    memkit.Offload(to='cpu').apply(model)\n"
        "assert not planned_cuda()\n"
        "assert 'memkit.estimation' not in sys.modules\n"
        "print(sorted(plan.host))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # the EMA's shadows and the offloaded weights noted in host memory, as in an estimate
    assert done.stdout.strip().splitlines()[-1] == "['ema', 'parameter']"
