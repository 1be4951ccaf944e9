"""The chunked arithmetic of `memkit.FFSplit` (``feedforward.py`` finds the layers and swaps their forwards):
a feed-forward layer as `_MLP`, its inner dimension computed in chunks summed into one output (`_run_hidden`,
with the recomputing backward `_RecomputedSplit`), or its tokens in tiles (`_sequence_split`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _MLP:
    """One feed-forward layer seen as ``out(dropout(act(proj(x))))``; gated: ``h * act(g)`` of ``proj``'s halves."""

    proj: nn.Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    gated: bool
    out: nn.Linear
    dropout: nn.Module | None
    final_dropout: nn.Module | None
    out_start: int = 0
    """First input column of ``out`` the intermediate feeds (Flux single blocks: ``proj_out`` reads the attention
    output in columns ``[0, dim)`` and the MLP's in ``[dim, dim + inner)``)."""

    @property
    def inner(self) -> int:
        return self.proj.out_features // (2 if self.gated else 1)

    def params(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """``proj`` weight and bias, the out-projection's columns (a view) and bias."""
        w2 = self.out.weight
        if self.out_start or w2.shape[1] != self.inner:
            w2 = w2[:, self.out_start : self.out_start + self.inner]
        return self.proj.weight, self.proj.bias, w2, self.out.bias


def _dropout_active(mlp: _MLP) -> bool:
    d = mlp.dropout
    return d is not None and d.training and d.p > 0


def _bounds(n: int, splits: int) -> list[tuple[int, int]]:
    """``splits`` contiguous ranges covering ``range(n)``, sizes differing by at most one."""
    q, r = divmod(n, splits)
    out, start = [], 0
    for i in range(splits):
        end = start + q + (i < r)
        out.append((start, end))
        start = end
    return out


def _pre(mlp: _MLP, x: torch.Tensor, s: int, e: int, w1: torch.Tensor, b1: torch.Tensor | None) -> torch.Tensor:
    """The chunk's activation input(s): ``proj`` rows ``s:e`` (and the gate's rows, gated)."""
    if not mlp.gated:
        return F.linear(x, w1[s:e], None if b1 is None else b1[s:e])
    n = mlp.inner
    a = F.linear(x, w1[s:e], None if b1 is None else b1[s:e])
    g = F.linear(x, w1[n + s : n + e], None if b1 is None else b1[n + s : n + e])
    return a, g  # type: ignore[return-value]


def _act(mlp: _MLP, pre) -> torch.Tensor:
    if mlp.gated:
        a, g = pre
        return a * mlp.act(g)
    return mlp.act(pre)


def _hidden_split(
    mlp: _MLP,
    x2: torch.Tensor,
    splits: int,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    init: torch.Tensor | None = None,
) -> torch.Tensor:
    """``init + out(act(proj(x)))`` summed over inner chunks; ``x2`` and ``init`` are 2-D; autograd records."""
    low = x2.dtype in _LOW_PRECISION
    out = None
    for s, e in _bounds(mlp.inner, splits):
        h = _act(mlp, _pre(mlp, x2, s, e, w1, b1))
        if mlp.dropout is not None:
            h = mlp.dropout(h)
        if low:  # round each chunk once (the first with the bias, as unsplit), sum in fp32
            y = F.linear(h, w2[:, s:e], b2 if out is None else None).float()
            out = y if out is None else out + y if torch.is_grad_enabled() else out.add_(y)
        elif out is None:
            out = F.linear(h, w2[:, s:e], b2)
        elif torch.is_grad_enabled() and (h.requires_grad or out.requires_grad):
            out = torch.addmm(out, h, w2[:, s:e].t())
        else:
            out.addmm_(h, w2[:, s:e].t())
        del h
    if low:
        if init is not None:
            out = out + init.float() if torch.is_grad_enabled() else out.add_(init)
        return out.to(x2.dtype)
    if init is not None:
        out = out + init if torch.is_grad_enabled() and (out.requires_grad or init.requires_grad) else out.add_(init)
    return out


class _RecomputedSplit(torch.autograd.Function):
    """Hidden-mode split that saves only ``x`` and the weights; backward recomputes each chunk's ``proj`` and
    activation, writes weight gradients into their slices and accumulates the input gradient."""

    @staticmethod
    def forward(ctx, x2, init, w1, b1, w2, b2, mlp, splits):
        ctx.mlp, ctx.splits = mlp, splits
        ctx.save_for_backward(x2, w1, b1, w2)
        ctx.has_b1 = b1 is not None
        with torch.no_grad():
            return _hidden_split(mlp, x2, splits, w1, b1, w2, b2, init)

    @staticmethod
    def backward(ctx, grad_out):
        x2, w1, b1, w2 = ctx.saved_tensors
        mlp, splits = ctx.mlp, ctx.splits
        b1 = b1 if ctx.has_b1 else None
        need_x, need_init, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:6]
        low = grad_out.dtype in _LOW_PRECISION
        acc = torch.float32 if low else grad_out.dtype
        gx = torch.zeros(x2.shape, dtype=acc, device=x2.device) if need_x else None
        gw1 = torch.empty_like(w1) if need_w1 else None
        gb1 = torch.empty_like(b1) if need_b1 and b1 is not None else None
        gw2 = torch.empty_like(w2) if need_w2 else None
        n = mlp.inner
        for s, e in _bounds(n, splits):
            with torch.enable_grad():
                pre = _pre(mlp, x2.detach(), s, e, w1.detach(), None if b1 is None else b1.detach())
                parts = pre if mlp.gated else (pre,)
                parts = tuple(p.detach().requires_grad_() for p in parts)
                h = _act(mlp, parts if mlp.gated else parts[0])
            if gw2 is not None:
                gw2[:, s:e] = grad_out.t().mm(h.detach())
            grad_h = grad_out.mm(w2[:, s:e])
            grads = torch.autograd.grad(h, parts, grad_h)
            del h, grad_h
            rows = [(s, e)] if not mlp.gated else [(s, e), (n + s, n + e)]
            for (r0, r1), g in zip(rows, grads, strict=True):
                if gw1 is not None:
                    gw1[r0:r1] = g.t().mm(x2)
                if gb1 is not None:
                    gb1[r0:r1] = g.sum(0)
                if gx is not None:
                    if low:
                        gx.add_(g.mm(w1[r0:r1]).float())
                    else:
                        gx.addmm_(g, w1[r0:r1])
        gb2 = grad_out.sum(0) if need_b2 else None
        if gx is not None:
            gx = gx.to(x2.dtype)
        return gx, grad_out if need_init else None, gw1, gb1, gw2, gb2, None, None


def _run_hidden(
    mlp: _MLP, x: torch.Tensor, splits: int, recompute: bool | None, init: torch.Tensor | None = None
) -> torch.Tensor:
    """The hidden-mode split of ``mlp`` on ``x`` (any leading shape), plus ``init`` (the output's shape) if given."""
    x2 = x.reshape(-1, x.shape[-1])
    init2 = None if init is None else init.reshape(-1, init.shape[-1])
    params = mlp.params()  # views: slicing is recorded, so gradients reach the parameters
    grad = torch.is_grad_enabled() and (
        x.requires_grad
        or (init is not None and init.requires_grad)
        or any(p is not None and p.requires_grad for p in params)
    )
    if grad and recompute is not False and not _dropout_active(mlp):
        out = _RecomputedSplit.apply(x2, init2, *params, mlp, splits)
    else:
        out = _hidden_split(mlp, x2, splits, *params, init=init2)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _sequence_split(fn: Callable, xs: tuple[torch.Tensor, ...], splits: int) -> torch.Tensor:
    """``fn`` on ``splits`` tiles of the token axis (the second to last of ``xs[0]``; every tensor of ``xs`` is
    tiled alike; uneven tiles allowed), concatenated."""
    x = xs[0]
    if x.ndim < 2:  # one token without a token axis (its only axis is the channels'): nothing to tile
        return fn(*xs)
    axis = x.ndim - 2
    tiles = [t for t in zip(*(torch.tensor_split(a, splits, dim=axis) for a in xs), strict=True) if t[0].shape[axis]]
    if len(tiles) <= 1:
        return fn(*xs)
    first = fn(*tiles[0])
    shape = list(first.shape)
    shape[axis] = x.shape[axis]
    out = first.new_empty(shape)
    start = 0
    for i, t in enumerate(tiles):
        y = first if i == 0 else fn(*t)
        out.narrow(axis, start, t[0].shape[axis]).copy_(y)
        start += t[0].shape[axis]
        del y
    return out
