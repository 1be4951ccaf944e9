"""A model's blocks are found in one place, and every optimization that works per block sees the same ones."""

from __future__ import annotations

import pytest
import torch

import memkit
from memkit import parallel
from memkit.blocks import diffusers_blocks, find_blocks, is_diffusers_model, module_list_blocks
from memkit.optimizations import checkpointing, offload


@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_every_per_block_optimization_sees_the_same_blocks(preset):
    model = memkit.load_model(preset, size="tiny")
    found = find_blocks(model)
    assert found and found == diffusers_blocks(model)
    names = [n for n, _ in found]
    assert [n for n, _ in memkit.Checkpointing().select(model)] == names
    assert [n for n, _, is_blocks in offload._found(model, "block", 1) if is_blocks] == names
    assert [id(b) for b in parallel._blocks(model)] == [id(b) for _, b in found]
    # the old import path keeps working
    assert checkpointing.diffusers_blocks is diffusers_blocks and checkpointing.module_list_blocks is module_list_blocks


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.short = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
        self.long = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])


def test_a_plain_module_s_blocks_are_its_longest_list_or_the_one_named():
    model = Plain()
    assert not is_diffusers_model(model)
    assert [n for n, _ in find_blocks(model)] == ["long.0", "long.1", "long.2"]
    assert [n for n, _ in find_blocks(model, name="short")] == ["short.0"]
    assert [n for n, _ in memkit.Checkpointing(blocks="short").select(model)] == ["short.0"]
    with pytest.raises(ValueError, match="blocks must name a non-empty nn.ModuleList of the model, one of"):
        find_blocks(model, name="moon")
    with pytest.raises(ValueError, match="blocks must name"):
        find_blocks(model, name="moon", required=False)  # a name given is never ignored


def test_a_model_without_blocks():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no nn.ModuleList of blocks"):
        find_blocks(model)
    assert find_blocks(model, required=False) == []
    assert parallel._blocks(model) == []  # FSDP shards the root alone


def test_a_diffusers_model_with_a_named_list_uses_that_list():
    model = memkit.load_model("flux", size="tiny")
    named = find_blocks(model, name="single_transformer_blocks")
    assert [n for n, _ in named] == [
        f"single_transformer_blocks.{i}" for i in range(len(model.single_transformer_blocks))
    ]
