"""Split feed-forward: run a feed-forward layer's inner dimension (or its tokens) in sequential chunks.

A feed-forward layer ``out(act(proj(x)))`` widens every token 4x-8x; in inference that intermediate (and the
activation's own output beside it) sets the peak of many transformer layers. ``"hidden"`` mode computes the
inner dimension in ``splits`` chunks, each ``proj -> activation -> out-proj`` on a slice of the weights, summed
into one output buffer (like tensor parallelism on one device; diffusers PR #10623, never merged), so only
one chunk's intermediate exists at a time. ``"sequence"`` mode tiles the tokens instead (like diffusers'
``enable_forward_chunking``, for every model and uneven lengths).

Costs: in inference, a few more, smaller matmuls (close to free where matmuls dominate). In training a plain
split saves little (every chunk's intermediate is kept for the backward); the recompute path (on by default
when autograd records) keeps only the input and recomputes each chunk's input projection and activation in the
backward: one extra ``proj`` matmul per layer, about +17% of the layer's training FLOPs for ``gelu``-style
layers and +22% for gated ones (``geglu``, ``swiglu``). It does nothing where attention or the weights set the
peak. Weights are never copied: chunks are views of the existing parameters, ``state_dict`` is unchanged and
``remove()`` puts each module's own ``forward`` back. In bf16/fp16 each chunk's out-projection is rounded once
and the chunks are summed in fp32 (no mixed-precision matmul exists on CPU), so a layer's error stays within
about twice the unsplit layer's.

Layers found: every diffusers ``FeedForward`` (Wan's ``ffn`` is one), plain ``nn.Sequential(Linear, activation,
[Dropout], Linear)``, and the MLP branch of Flux's single blocks, where ``proj_out`` reads
``cat([attention, act(proj_mlp(x))])``: split, the block runs ``proj_out``'s attention columns first and then
its MLP columns chunk by chunk, so neither the 4x intermediate nor the 5x concatenation exists whole.

Dropout keeps its meaning: the dropout after the activation acts elementwise, so applying it to each chunk
draws each element's mask with the same probability (different random numbers than the unsplit layer, the same
distribution; identical in eval). The final dropout acts once on the summed output. With dropout active
(training, ``p > 0``) the recompute path is not taken (its masks would have to be replayed): chunks then keep
their intermediates for the backward.

Example:
    >>> with memkit.FFSplit(splits=4).apply(model):
    ...     model(**inputs)                      # the FF intermediate peak drops ~4x
    >>> memkit.estimate("flux", optimizations=[memkit.FFSplit(splits=8)], mode="inference")
"""

from __future__ import annotations

import collections
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..handle import Handle
from ._ff_chunks import _MLP, _run_hidden, _sequence_split

_MODES = ("hidden", "sequence")

# Blocks whose MLP ff-split does not rewrite (its forward is not one it knows): the split leaves them whole, and
# says so. HunyuanVideo's single-stream blocks run proj_mlp beside attention, but not as Flux's single block does.
_UNSPLIT_BLOCKS = {
    "HunyuanVideoSingleTransformerBlock": "proj_mlp -> proj_out, fused with attention",
    # Flux's single block, but its own class (modulation from the approximator): its forward is not checked as Flux's
    "ChromaSingleTransformerBlock": "proj_mlp -> proj_out, fused with attention",
    # Z-Image's own SwiGLU (silu(w1(x)) * w3(x) -> w2): two input projections; its timestep MLP is split
    "ZImageTransformerBlock": "a SwiGLU feed-forward, w1 and w3 into w2",
}


def _approximate_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _diffusers_mlp(module: nn.Module) -> _MLP | None:
    """The `_MLP` of a diffusers ``FeedForward`` (all six activations), else None."""
    from diffusers.models import activations as A
    from diffusers.models.attention import FeedForward

    if not isinstance(module, FeedForward):
        return None
    net = list(module.net)
    first, rest = net[0], net[1:]
    if isinstance(first, A.GELU):
        act, gated = first.gelu, False
    elif isinstance(first, A.GEGLU):
        act, gated = first.gelu, True
    elif isinstance(first, A.SwiGLU):
        act, gated = first.activation, True
    elif isinstance(first, A.ApproximateGELU):
        act, gated = _approximate_gelu, False
    elif isinstance(first, A.LinearActivation):
        act, gated = first.activation, False
    else:
        return None
    linears = [i for i, m in enumerate(rest) if isinstance(m, nn.Linear)]
    if len(linears) != 1 or not all(isinstance(m, nn.Dropout) for i, m in enumerate(rest) if i != linears[0]):
        return None
    i = linears[0]
    before, after = rest[:i], rest[i + 1 :]
    return _MLP(first.proj, act, gated, rest[i], before[0] if before else None, after[0] if after else None)


_ACTIVATIONS = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish)


def _sequential_mlp(module: nn.Module) -> _MLP | None:
    """The `_MLP` of a plain ``nn.Sequential(Linear, activation, [Dropout], Linear)``, else None."""
    if not isinstance(module, nn.Sequential):
        return None
    m = list(module)
    if len(m) not in (3, 4) or not isinstance(m[0], nn.Linear) or not isinstance(m[1], _ACTIVATIONS):
        return None
    if len(m) == 4 and not isinstance(m[2], nn.Dropout):
        return None
    if not isinstance(m[-1], nn.Linear) or m[-1].in_features != m[0].out_features:
        return None
    return _MLP(m[0], m[1], False, m[-1], m[2] if len(m) == 4 else None, None)


def _flux_single_mlp(module: nn.Module) -> _MLP | None:
    """The MLP branch of a Flux single block: ``proj_out(cat[attn, act_mlp(proj_mlp(x))])``'s MLP columns."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    if type(module) is not FluxSingleTransformerBlock:  # a subclass may compute something else
        return None
    if not _flux_single_forward_known():
        return None
    proj, out = module.proj_mlp, module.proj_out
    dim = out.in_features - proj.out_features
    if dim != proj.in_features or not isinstance(module.act_mlp, _ACTIVATIONS):
        return None
    return _MLP(proj, module.act_mlp, False, out, None, None, out_start=dim)


_FLUX_SINGLE_ARGS = (
    "self",
    "hidden_states",
    "encoder_hidden_states",
    "temb",
    "image_rotary_emb",
    "joint_attention_kwargs",
)
_FLUX_SINGLE_LINES = (
    "torch.cat([encoder_hidden_states, hidden_states], dim=1)",
    "self.act_mlp(self.proj_mlp(norm_hidden_states))",
    "torch.cat([attn_output, mlp_hidden_states], dim=2)",
    "gate * self.proj_out(hidden_states)",
)


@functools.cache
def _flux_single_forward_known() -> bool:
    """Whether the installed diffusers' ``FluxSingleTransformerBlock.forward`` is the one
    :func:`_flux_single_forward` rewrites (diffusers 0.33 and later: text and image tokens concatenated inside the
    block, a pair returned). Another version's block is left unsplit, with a warning, rather than run wrongly."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    forward = FluxSingleTransformerBlock.forward
    try:
        source = " ".join(inspect.getsource(forward).split())
        known = tuple(inspect.signature(forward).parameters) == _FLUX_SINGLE_ARGS and all(
            line in source for line in _FLUX_SINGLE_LINES
        )
    except (OSError, TypeError):  # no source (a frozen install): unknown
        known = False
    if not known:
        warnings.warn(
            "FFSplit: this diffusers version's FluxSingleTransformerBlock.forward is not the one memkit rewrites "
            "(diffusers >= 0.33), so Flux single blocks' MLP branch is left unsplit",
            stacklevel=4,
        )
    return known


def find_mlps(model: nn.Module) -> list[tuple[str, nn.Module, _MLP]]:
    """Every feed-forward layer FFSplit splits: (qualified name, module, its parts).

    Example:
        >>> [name for name, _, _ in find_mlps(model)]   # ['transformer_blocks.0.ff', ...]
    """
    found = []
    for name, module in model.named_modules():
        mlp = _diffusers_mlp(module) or _sequential_mlp(module) or _flux_single_mlp(module)
        if mlp is not None:
            found.append((name, module, mlp))
    return found


def _split_forward(mlp: _MLP, module: nn.Module, splits: int, mode: str, recompute: bool | None) -> Callable:
    """The replacement ``forward`` of a ``FeedForward`` or plain MLP."""
    original = type(module).forward

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if mode == "sequence":
            return _sequence_split(lambda t: original(module, t, *args, **kwargs), (hidden_states,), splits)
        out = _run_hidden(mlp, hidden_states, splits, recompute)
        if mlp.final_dropout is not None:
            out = mlp.final_dropout(out)
        return out

    return forward


def _flux_single_forward(mlp: _MLP, block: nn.Module, splits: int, mode: str, recompute: bool | None) -> Callable:
    """``FluxSingleTransformerBlock.forward`` (diffusers 0.42) without the ``[attn, mlp]`` concatenation:
    ``proj_out``'s attention columns first, then its MLP columns over the split (or tiled) MLP branch."""

    def forward(
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        residual = hidden_states
        norm_hidden_states, gate = block.norm(hidden_states, emb=temb)
        attn_output = block.attn(
            hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
        )
        init = F.linear(attn_output, block.proj_out.weight[:, : mlp.out_start])  # the bias comes with the MLP
        del attn_output
        if mode == "sequence":
            out = _sequence_split(lambda t, i: _run_hidden(mlp, t, 1, False, i), (norm_hidden_states, init), splits)
        else:
            out = _run_hidden(mlp, norm_hidden_states, splits, recompute, init)
        del init
        hidden_states = residual + gate.unsqueeze(1) * out
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]

    return forward


@dataclass(frozen=True, kw_only=True)
class FFSplit:
    """Run every feed-forward layer in ``splits`` sequential chunks so its 4x-8x intermediate never exists whole.

    Finds every diffusers ``FeedForward`` (``gelu``, ``gelu-approximate``, ``geglu``, ``geglu-approximate``,
    ``swiglu``, ``linear-silu``), plain ``nn.Sequential(Linear, activation, [Dropout], Linear)`` MLPs and Flux
    single blocks' ``proj_mlp``/``proj_out`` branch, and replaces their ``forward`` (an instance attribute,
    removed again by ``remove()``). Saves roughly
    ``(1 - 1/splits)`` of the intermediate's memory in inference, and in training with ``recompute``; costs a
    few smaller matmuls, plus one recomputed input projection per layer in training (+17% of the layer's FLOPs,
    +22% gated). In bf16/fp16 chunks are summed in fp32.

    Example:
        >>> handle = memkit.FFSplit(splits=4).apply(model)
        >>> model(**inputs)          # lower peak, same outputs
        >>> handle.remove()
    """

    splits: int = 4
    """Number of chunks (>= 1; at most the inner dimension in ``"hidden"`` mode). 1 runs the layer as one chunk
    through the same code path."""
    mode: Literal["hidden", "sequence"] = "hidden"
    """``"hidden"``: chunk the inner dimension and sum (weights as views, bias added once). ``"sequence"``: tile
    the tokens and run the original layer on each tile (cuts the intermediate the same way in inference; in
    training each tile's intermediate is kept)."""
    recompute: bool | None = None
    """Training (``"hidden"`` mode): recompute each chunk's projection and activation in the backward instead of
    keeping them. ``None``: whenever autograd records; ``False``: a plain split (inference savings only)."""

    def __post_init__(self) -> None:
        if isinstance(self.splits, bool) or not isinstance(self.splits, int):
            raise TypeError(f"splits must be an int >= 1, got {type(self.splits).__name__}")
        if self.splits < 1:
            raise ValueError(f"splits must be >= 1, got {self.splits}")
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {list(_MODES)}, got {self.mode!r}")
        if self.recompute not in (None, True, False):
            raise ValueError(f"recompute must be None, True or False, got {self.recompute!r}")

    def apply(self, model: nn.Module) -> Handle:
        """Split every feed-forward layer of ``model``; returns the handle that restores them."""
        from .lora import refuse_adapters_in_feedforward

        refuse_adapters_in_feedforward(model)
        found = find_mlps(model)
        if not found:  # nothing to split: say so rather than return a handle that changed nothing
            raise ValueError(
                f"ff-split found no feed-forward layer to split in {type(model).__name__}: it splits diffusers' "
                "FeedForward (Linear, activation, Linear) and Flux's single-block MLP; this model's feed-forward, "
                "if any, is another kind (Sana's GLUMBConv is convolutions)"
            )
        _refuse_quantized(found)
        if self.mode == "hidden":
            for name, _, mlp in found:
                if self.splits > mlp.inner:
                    raise ValueError(
                        f"splits must be at most the inner dimension of every feed-forward layer, got "
                        f"splits={self.splits} > {mlp.inner} ({name or type(model).__name__})"
                    )
        unsplit = collections.Counter(type(m).__name__ for m in model.modules() if type(m).__name__ in _UNSPLIT_BLOCKS)
        for name, n in unsplit.items():
            warnings.warn(
                f"ff-split leaves the MLP of {n} {name} blocks whole ({_UNSPLIT_BLOCKS[name]}: a forward it has no "
                f"rewrite for); it splits the other {len(found)} feed-forward layers",
                stacklevel=2,
            )
        missing = object()
        saved = []
        for _, module, mlp in found:
            saved.append((module, module.__dict__.get("forward", missing)))
            build = _flux_single_forward if mlp.out_start else _split_forward
            module.forward = build(mlp, module, self.splits, self.mode, self.recompute)

        def undo() -> None:
            for module, previous in saved:
                if previous is missing:
                    del module.forward
                else:
                    module.forward = previous

        return Handle(undo, name=str(self))

    @classmethod
    def parse(cls, value: str) -> FFSplit:
        """The config a command-line or widget value names: ``"4"``, or ``"4:sequence"``.

        Example:
            >>> memkit.FFSplit.parse("8:sequence")
            FFSplit(splits=8, mode='sequence', recompute=None)
        """
        count, _, mode = value.partition(":")
        try:
            splits = int(count)
        except ValueError:
            raise ValueError(
                f"ff-split value must be SPLITS or SPLITS:MODE (e.g. '4', '4:sequence'), got {value!r}"
            ) from None
        return cls(splits=splits, mode=mode or "hidden")

    def __str__(self) -> str:
        suffix = "" if self.mode == "hidden" else f":{self.mode}"
        return f"ff-split:{self.splits}{suffix}"


def _refuse_quantized(found) -> None:
    """A ValueError for a feed-forward whose weights are stored quantized (bitsandbytes' packed codes, fp8 storage, a
    torchao tensor): the split slices the weight itself, so it does not compose with memkit.Quantize."""
    from torch._subclasses.fake_tensor import FakeTensor

    for name, module, _ in found:
        for sub, layer in module.named_modules():
            w = getattr(layer, "weight", None)
            if not isinstance(layer, nn.Linear) or w is None:
                continue
            plain = type(w.data) in (torch.Tensor, FakeTensor)
            if hasattr(w, "quant_state") or not plain or not w.dtype.is_floating_point or w.dtype.itemsize < 2:
                where = ".".join(p for p in (name, sub) if p)
                raise ValueError(
                    f"ff-split cannot split {where}: its weight is stored quantized ({type(w.data).__name__}, "
                    f"{w.dtype}) and the split slices the weight itself; ff-split and memkit.Quantize do not compose, "
                    "leave one of them out"
                )
