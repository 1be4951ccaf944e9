"""A model's repeated blocks: the one answer to "which modules are the transformer blocks".

A diffusion transformer is a prologue (embedders), N blocks of a few kinds repeated, and an epilogue (norm,
projection). Checkpointing chooses among the blocks, offload groups them, FSDP gives each its own
``fully_shard``, the budget solver counts them: all of them ask :func:`find_blocks`, so a model's blocks are the
same everywhere.

- A diffusers model that supports gradient checkpointing: the modules its forward hands to
  ``_gradient_checkpointing_func`` (:func:`diffusers_blocks`), in module order.
- Any other module (or a diffusers model when a list is named): the elements of one ``nn.ModuleList``, the one
  named or the longest (:func:`module_list_blocks`).

Example:
    >>> from memkit.blocks import find_blocks
    >>> [name for name, _ in find_blocks(memkit.load_model("flux"))]
    ['transformer_blocks.0', 'single_transformer_blocks.0']
"""

from __future__ import annotations

import re

import torch

__all__ = ["diffusers_blocks", "find_blocks", "module_list_blocks"]

# The lists whose elements diffusers' forwards hand to ``_gradient_checkpointing_func``: transformer blocks
# (``transformer_blocks``, ``single_transformer_blocks``, ``blocks``) and UNet's ``resnets`` (its attention
# blocks are ``transformer_blocks`` inside a Transformer2DModel). Up/downsamplers are never checkpointed.
_BLOCK_LISTS = re.compile(r"(^|_)blocks$|^resnets$")
# Models whose checkpointed lists are named otherwise: exactly the lists their forward hands to the function. Z-Image
# checkpoints its refiners (image, caption, SigLIP) and joint layers; Lumina2 its joint layers only (its refiners
# run outside the checkpointing).
_LISTS_OF: dict[str, tuple[str, ...]] = {
    "ZImageTransformer2DModel": ("noise_refiner", "context_refiner", "siglip_refiner", "layers"),
    "Lumina2Transformer2DModel": ("layers",),
}


def is_diffusers_model(model: torch.nn.Module) -> bool:
    """True for a diffusers model whose forward checkpoints its blocks through ``_gradient_checkpointing_func``.

    Example:
        >>> is_diffusers_model(memkit.load_model("flux")), is_diffusers_model(torch.nn.Linear(2, 2))
        (True, False)
    """
    return bool(getattr(model, "_supports_gradient_checkpointing", False))


def find_blocks(
    model: torch.nn.Module, *, name: str | None = None, required: bool = True
) -> list[tuple[str, torch.nn.Module]]:
    """The blocks of ``model`` as (qualified name, module), in module order.

    Args:
        model: a diffusers model, or any ``nn.Module`` with an ``nn.ModuleList`` of blocks.
        name: the qualified name of the ``nn.ModuleList`` whose elements are the blocks (any model); None: a
            diffusers model's own blocks, else the longest list.
        required: raise a ValueError when the model has no blocks (True), or return ``[]`` (False: FSDP then
            shards the root alone).

    Example:
        >>> find_blocks(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 3)))
        [('0.0', Linear(...)), ('0.1', Linear(...)), ('0.2', Linear(...))]
    """
    if name is None and is_diffusers_model(model):
        return diffusers_blocks(model)
    try:
        return module_list_blocks(model, name)
    except ValueError:
        if required or name is not None:
            raise
        return []


def diffusers_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules a diffusers model hands to its checkpointing function, in module order: the elements of the
    block lists (``*blocks``, ``resnets``; Z-Image's and Lumina2's by name) of modules that have a
    ``gradient_checkpointing`` flag, except containers whose own submodules checkpoint (UNet's down/up blocks).
    UNet's mid-block runs its first resnet outside diffusers' checkpointing: it is numbered, but checkpointing it
    changes nothing.

    Example:
        >>> [name for name, _ in diffusers_blocks(memkit.load_model("flux"))]
        ['transformer_blocks.0', 'single_transformer_blocks.0']
    """
    out = []
    for name, module in model.named_modules():
        if not hasattr(module, "gradient_checkpointing"):
            continue
        names = _LISTS_OF.get(type(module).__name__)
        for child_name, child in module.named_children():
            listed = child_name in names if names is not None else bool(_BLOCK_LISTS.search(child_name))
            if not isinstance(child, torch.nn.ModuleList) or not listed:
                continue
            for i, block in enumerate(child):
                if any(hasattr(m, "gradient_checkpointing") for m in block.modules()):
                    continue  # a container: its own submodules are the blocks
                out.append((".".join(p for p in (name, child_name, str(i)) if p), block))
    return out


def module_list_blocks(model: torch.nn.Module, blocks: str | None = None) -> list[tuple[str, torch.nn.Module]]:
    """The blocks of a plain ``nn.Module``: its ``nn.ModuleList`` named ``blocks``, or its longest one.

    Example:
        >>> module_list_blocks(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 3)))
    """
    lists = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)}
    if blocks is not None:
        if blocks not in lists:
            raise ValueError(
                f"blocks must name a non-empty nn.ModuleList of the model, one of {sorted(lists)}, got {blocks!r}"
            )
        name = blocks
    else:
        if not lists:
            raise ValueError(
                f"model ({type(model).__name__}) has no nn.ModuleList of blocks to checkpoint and is not "
                "a diffusers model that supports gradient checkpointing"
            )
        name = max(lists, key=lambda n: len(lists[n]))  # the first of the longest
    return [(f"{name}.{i}", b) for i, b in enumerate(lists[name])]
