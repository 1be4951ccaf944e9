"""One training or inference step, written once and run by everyone: `compare`, `estimate`, the command line
and the widgets.

A step is forward, a loss, backward, and (with an optimizer) the update and ``zero_grad``; then whatever the
applied optimizations do once per step (an EMA update, an offload write-back), through their handle's
``after_step``. :class:`Step` says which step (mode, optimizer, how many steps a measurement runs);
``Step.bind(model, handle)`` makes the optimizer for that model and returns a :class:`StepRunner` whose
``run(inputs)`` is one step. :func:`train_step` is the same step as a plain function.

The loss is ``mean(output ** 2)`` in float32: a stand-in for the diffusion loss with the same memory shape
(activations kept for backward, one gradient per parameter) without needing targets. It is computed in the
``forward`` phase, so the float32 copy of the output that the backward keeps counts as an activation. A model that
denoises two streams at once (LTX-2: video and audio) gets a term per prediction, summed, as its trainers do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import torch

from ._forward_io import _predictions, check_inputs, model_output
from ._fused import fuse
from ._precision import MIXED_PRECISION, MixedPrecision, Scaler, autocast_dtype, check_master_weights
from .handle import Handle
from .memory.recording import phase, tag
from .optimizers import OPTIMIZER_ON, OPTIMIZERS, OptimizerName, OptimizerOn, make_optimizer

__all__ = ["MODES", "OPTIMIZERS", "Step", "StepRunner", "check_inputs", "make_optimizer", "model_output", "train_step"]

MODES = ("training", "inference")


OutputHook = Callable[[torch.Tensor], None]
GradsHook = Callable[[torch.nn.Module], None]


def _run(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    mode: str,
    optimizer: torch.optim.Optimizer | None,
    handle: Handle | None,
    on_output: OutputHook | None,
    on_grads: GradsHook | None,
    *,
    grad_accum: int = 1,
    autocast: tuple[str, torch.dtype] | None = None,
    scaler: Scaler | None = None,
) -> torch.Tensor | None:
    check_inputs(model, inputs)
    forward = torch.autocast(*autocast) if autocast is not None else contextlib.nullcontext()
    if mode == "inference":
        with torch.no_grad(), forward:
            out = model_output(model(**inputs))
            if on_output is not None:
                on_output(out)
            del out
        loss = None
    else:
        loss = None
        for _ in range(grad_accum):  # micro-batches: each backward adds into the gradients the last one left
            # autocast around the forward only (as accelerate wraps model.forward): its cast cache ends with it
            with forward:
                out, *others = _predictions(model(**inputs))
            if on_output is not None:
                on_output(out)
            with phase("forward"):  # the loss belongs to the forward: what backward keeps of it is an activation
                micro = out.float().pow(2).mean()
                for other in others:  # LTX-2's audio: its own term, as its trainer's audio loss
                    micro = micro + other.float().pow(2).mean()
                del others
                if grad_accum > 1:  # as accelerate scales it: the summed gradients are the mean over micro-batches
                    micro = micro / grad_accum
                scaled = scaler.scale(micro) if scaler is not None else micro
            del out  # hold nothing the step itself would not hold
            if scaler is not None:
                tag(scaler.state_tensors(), "optimizer_state")  # made by the first scale(), kept across steps
            scaled.backward()
            del scaled
            micro = micro.detach()
            loss = micro if loss is None else loss + micro
            del micro
        if on_grads is not None:
            on_grads(model)
        update(optimizer, None, scaler)
    if handle is not None:
        handle.after_step()
    return loss


def update(optimizer: torch.optim.Optimizer | None, handle: Handle | None, scaler: Scaler | None = None) -> None:
    """What a training step does once its gradients are made: the optimizer's step (through ``scaler``, if any),
    its ``zero_grad(set_to_none=True)``, then ``handle.after_step()``. ``memkit._steady`` runs it alone for a
    steady step whose forward and backward it derives from the first step's."""
    if optimizer is not None:
        if scaler is not None:  # unscales the gradients in place, steps unless one is not finite
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if handle is not None:
        handle.after_step()


def train_step(
    model: torch.nn.Module, inputs: Mapping[str, Any], optimizer: torch.optim.Optimizer | None = None
) -> torch.Tensor:
    """One forward, loss, backward and (optionally) optimizer step; returns the loss, detached.

    Without an optimizer, gradients accumulate across calls as in a plain loop; with one, it steps and frees
    them (``zero_grad(set_to_none=True)``), so they do not count towards the next step's peak. To run the
    optimizations' per-step work too (EMA updates), use :class:`Step`.

    Example:
        >>> model = memkit.load_model("sd3")
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> loss = memkit.train_step(model, memkit.make_inputs(model), optimizer)
    """
    return _run(model, inputs, "training", optimizer, None, None, None)


@dataclass(frozen=True, kw_only=True)
class Step:
    """Which step to run: training or inference, with which optimizer, and how many steps a measurement takes.

    ``compare``, ``estimate``, the command line and the widgets all take a ``Step`` and run it the same way;
    an optimization that lives across steps (EMA, offload write-back) hooks in through its handle's
    ``after_step`` instead of growing its own loop.

    Example:
        >>> step = memkit.Step(mode="training", optimizer="adamw", steps=2)
        >>> runner = step.bind(model)
        >>> loss = runner.run(memkit.make_inputs(model))
    """

    mode: Literal["training", "inference"] = "training"
    """``"training"``: forward, loss, backward (and the optimizer's update); ``"inference"``: forward under
    ``no_grad``."""
    optimizer: OptimizerName | None = None
    """The optimizer of a training step, one of :data:`memkit.optimizers.OPTIMIZERS` (its state size in that
    module's docstring). None: no update, gradients are only computed (and accumulate across steps, as in a loop of
    ``loss.backward()``)."""
    steps: int | None = None
    """Which steps a measurement covers. None (the default): in training, the first step and the steady step
    that every later step repeats (step 2: the optimizer state, EMA shadows and accumulated gradients the first
    step created exist before it begins), both measured, and the larger peak is the answer; in inference, one
    pass (no state lives across passes). An int N: run N steps and measure only the last (``steps=1``: the
    first step alone)."""
    foreach: bool | None = None
    """The optimizer's foreach implementation (one fused kernel per op over all tensors, with a temporary per
    op). None: torch's default for the device (foreach on CUDA, per-tensor loops on CPU)."""
    grad_accum: int = 1
    """Gradient accumulation: one step is ``grad_accum`` forward and backward passes (micro-batches, each on the
    step's inputs, its loss divided by ``grad_accum`` as accelerate does), then one optimizer update and
    ``zero_grad``. The gradients live from the first micro-batch's backward to the update, so every later
    micro-batch's forward and backward runs beside a full set of gradients: the peak can grow by up to one set of
    gradients over ``grad_accum=1`` (where gradients exist only from the backward on). It buys a batch
    ``grad_accum`` times larger at the activation memory of one micro-batch, for ``grad_accum`` times the compute."""
    mixed_precision: MixedPrecision | None = None
    """``"bf16"`` or ``"fp16"``: what accelerate and the diffusers scripts call mixed precision. The weights, their
    gradients and the optimizer state stay fp32 (the model must be built in fp32: its trainable parameters are
    checked at ``bind``); the forward runs under ``torch.autocast``, which casts each weight to a low-precision copy
    kept in its cast cache until the forward ends (the copies the backward needs live on as activations); the loss
    and the backward run outside it. ``"fp16"`` adds a ``torch.amp.GradScaler`` (loss scaling; gradients unscaled in
    place before the update). Against pure bf16 weights (``mixed_precision=None`` on a bf16 model) it costs twice the
    weights, gradients and state, plus the cast copies; against pure fp32 it saves about half the activations. On
    the CPU's autocast op list (see :mod:`memkit._precision` for where CUDA's differs). None: no autocast, every op
    in the weights' dtype."""
    fused_backward: bool = False
    """Step the optimizer inside the backward (OneTrainer's and SimpleTuner's fused back pass): each parameter is
    updated in its ``register_post_accumulate_grad_hook`` and its gradient freed at once (:mod:`memkit._fused`), so no
    full set of gradients ever lives: it saves up to one set of gradients (full fine-tuning: the weights' size) where
    the peak holds them (the update), for the same compute. It needs an optimizer, and refuses ``grad_accum > 1``
    (accumulation keeps every gradient until the last micro-batch: the very memory it frees) and
    ``mixed_precision="fp16"`` (the gradient scaler must see every gradient before any update)."""
    optimizer_on: OptimizerOn = "device"
    """Where the optimizer keeps its state and steps. ``"device"``: beside the parameters. ``"cpu"``: torchao's
    ``CPUOffloadOptimizer`` (single GPU; the ``finetune`` extra): every trainable parameter of 4,096 elements or
    more gets a pinned host copy and a host gradient buffer, its gradient is copied there in the backward (a
    post-accumulate-grad hook), the optimizer steps the host copy on the CPU and the result is copied back. The
    device keeps no optimizer state but that of the small parameters (stepped on the device, as torchao does): it
    saves the state's bytes (AdamW: twice the trained weights) on the GPU for twice the trained weights' bytes of
    host memory (copy and gradient) plus the state there, and a CPU update every step. An estimate for ``"cuda"``
    reports the host bytes in ``timeline.meta["host_bytes"]``. Refused with ``fused_backward`` (both step in the
    gradient hooks) and FSDP (torchao's class is single-GPU); every optimizer name runs there (what differs is in
    :mod:`memkit.optimizers`)."""
    offload_gradients: bool = False
    """With ``optimizer_on="cpu"``: torchao's ``offload_gradients``, each device gradient freed as soon as its copy to
    the host is made in the backward, so no full set of gradients lives on the device (the update reads the host
    copies). It refuses ``grad_accum > 1`` (torchao: the host copy is overwritten, not added to, by each backward)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)} or None, got {self.optimizer!r}")
        if self.optimizer is not None and self.mode == "inference":
            raise ValueError("optimizer is only used in training; pass optimizer=None with mode='inference'")
        if self.steps is not None and (not isinstance(self.steps, int) or isinstance(self.steps, bool)):
            raise ValueError(f"steps must be None (first and steady step) or an int >= 1, got {self.steps!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be None (first and steady step) or an int >= 1, got {self.steps!r}")
        if self.steps == 1 and self.mode == "inference":
            raise ValueError(
                "steps=1 asks for the first training step; an inference pass keeps no state across passes, so it "
                "has no first or steady step: leave steps=None with mode='inference'"
            )
        if self.foreach not in (None, True, False):
            raise ValueError(f"foreach must be True, False or None, got {self.foreach!r}")
        if not isinstance(self.grad_accum, int) or isinstance(self.grad_accum, bool) or self.grad_accum < 1:
            raise ValueError(f"grad_accum must be an int >= 1 (micro-batches per step), got {self.grad_accum!r}")
        if self.mixed_precision not in (None, *MIXED_PRECISION):
            raise ValueError(
                f"mixed_precision must be one of {[None, *MIXED_PRECISION]}, got {self.mixed_precision!r} (the pure "
                "dtype is the model's own: build it in that dtype)"
            )
        if self.fused_backward not in (True, False):
            raise ValueError(f"fused_backward must be True or False, got {self.fused_backward!r}")
        if self.fused_backward:
            if not self.training or self.optimizer is None:
                raise ValueError(
                    "fused_backward=True steps the optimizer in the backward: it needs a training step "
                    "with an optimizer (mode='training', optimizer=...)"
                )
            if self.grad_accum > 1:
                raise ValueError(
                    f"fused_backward=True updates each parameter and frees its gradient in the backward, so there is "
                    f"nothing to accumulate into: it refuses grad_accum={self.grad_accum} (accumulation would keep a "
                    "full set of gradients alive until the last micro-batch, the memory fused_backward saves)"
                )
            if self.mixed_precision == "fp16":
                raise ValueError(
                    "fused_backward=True refuses mixed_precision='fp16': the gradient scaler must see "
                    "every gradient (to skip a step with one that is not finite) before any update"
                )
        self._check_optimizer_on()
        if self.grad_accum > 1 and self.mode == "inference":
            raise ValueError(
                "grad_accum is only used in training (micro-batches of a training step); pass grad_accum=1"
            )

    def _check_optimizer_on(self) -> None:
        if self.optimizer_on not in OPTIMIZER_ON:
            raise ValueError(f"optimizer_on must be one of {list(OPTIMIZER_ON)}, got {self.optimizer_on!r}")
        if not isinstance(self.offload_gradients, bool):
            raise ValueError(f"offload_gradients must be True or False, got {self.offload_gradients!r}")
        if self.offload_gradients and self.optimizer_on != "cpu":
            raise ValueError(
                "offload_gradients=True is torchao's CPUOffloadOptimizer option: it goes with optimizer_on='cpu'"
            )
        if self.optimizer_on == "device":
            return
        if not self.training or self.optimizer is None:
            raise ValueError(
                "optimizer_on='cpu' keeps an optimizer's state in CPU memory: it needs a training step with an "
                "optimizer (mode='training', optimizer=...)"
            )
        if self.fused_backward:
            raise ValueError(
                "optimizer_on='cpu' refuses fused_backward=True: both run in the parameters' post-accumulate-grad "
                "hooks (torchao's copies the gradient to the host for a step after the backward; the fused backward "
                "steps and frees it there)"
            )
        if self.offload_gradients and self.grad_accum > 1:
            raise ValueError(
                f"offload_gradients=True refuses grad_accum={self.grad_accum}: torchao frees each device gradient "
                "after copying it to the host, and the next micro-batch's copy overwrites the host one instead of "
                "adding to it (torchao: 'not compatible with gradient accumulation')"
            )

    @property
    def training(self) -> bool:
        """True for a training step."""
        return self.mode == "training"

    @property
    def first_and_steady(self) -> bool:
        """True when a measurement covers both the first and the steady step (``steps=None`` in training)."""
        return self.steps is None and self.training

    @property
    def runs(self) -> int:
        """How many steps a measurement runs: 2 for the first and the steady step, else ``steps`` (1 in
        inference by default)."""
        if self.steps is not None:
            return self.steps
        return 2 if self.training else 1

    @property
    def measured(self) -> str:
        """Which step a measurement's figures are: ``"first and steady"``, ``"first"``, ``"steady"`` (step N
        of N >= 2) or ``"inference"`` (every pass alike)."""
        if not self.training:
            return "inference"
        if self.steps is None:
            return "first and steady"
        return "first" if self.steps == 1 else "steady"

    def bind(self, model: torch.nn.Module, handle: Handle | None = None) -> StepRunner:
        """A runner of this step for ``model`` (its optimizer built now), calling ``handle.after_step()``
        after each step.

        Example:
            >>> with memkit.Checkpointing().apply(model) as handle:
            ...     memkit.Step().bind(model, handle).run(inputs)
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if handle is not None and not isinstance(handle, Handle):
            raise TypeError(f"handle must be a memkit.Handle or None, got {type(handle).__name__}")
        if self.mixed_precision is not None:
            check_master_weights(model, self.mixed_precision)
        optimizer = None
        if self.training and self.optimizer is not None and "_memkit_quantized" in model.__dict__:
            from .optimizations.quantization import refuse_training_without_adapters

            refuse_training_without_adapters(model)
        if self.training:
            optimizer = make_optimizer(
                self.optimizer, model.parameters(), foreach=self.foreach, on=self.optimizer_on,
                offload_gradients=self.offload_gradients,
            )  # fmt: skip
        return StepRunner(self, model, optimizer, handle)

    def __str__(self) -> str:
        if not self.training:
            return f"inference (mixed {self.mixed_precision})" if self.mixed_precision else "inference"
        extra = f", mixed {self.mixed_precision}" if self.mixed_precision else ""
        extra += f", {self.grad_accum} micro-batches" if self.grad_accum > 1 else ""
        extra += ", fused backward" if self.fused_backward else ""
        extra += ", on the CPU" if self.optimizer_on == "cpu" else ""
        extra += ", gradients offloaded" if self.offload_gradients else ""
        return f"training ({self.optimizer or 'no optimizer'}{extra})"


class _GradsSeen:
    """What ``on_grads`` reads of a model (``named_parameters()`` and each one's ``.grad``) for gradients a fused
    backward used and freed: stand-ins holding the recorded gradient under each parameter's name."""

    def __init__(self, grads: Mapping[str, torch.Tensor]) -> None:
        self._grads = grads

    def named_parameters(self):
        for name, grad in self._grads.items():
            yield name, SimpleNamespace(grad=grad)


class StepRunner:
    """A :class:`Step` bound to a model, its optimizer and the applied optimizations' handle.

    Example:
        >>> runner = memkit.Step(optimizer="sgd").bind(model)
        >>> for _ in range(3):
        ...     runner.run(inputs)
    """

    def __init__(
        self,
        step: Step,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        handle: Handle | None,
    ) -> None:
        self.step, self.model, self.optimizer, self.handle = step, model, optimizer, handle
        self.autocast = self.scaler = None
        # the update runs in the backward's hooks: no step after it (self.optimizer stays, for tracking its state)
        self.grad_observers: list = []  # a fused backward's gradients, seen one by one (``_fused.fuse``)
        self.fused = fuse(optimizer, self.grad_observers) if step.fused_backward and optimizer is not None else []
        if step.mixed_precision is not None:
            device = next((p.device.type for p in model.parameters()), "cpu")
            self.autocast = (device, autocast_dtype(step.mixed_precision))
            if step.mixed_precision == "fp16" and step.training and optimizer is not None:
                self.scaler = Scaler(device)

    def run(
        self,
        inputs: Mapping[str, Any],
        *,
        on_output: OutputHook | None = None,
        on_grads: GradsHook | None = None,
    ) -> torch.Tensor | None:
        """One step on ``inputs``; returns the loss (None in inference; with ``grad_accum``, the sum of the
        micro-batches' divided losses).

        ``on_output(output)`` sees the model's output tensor before the loss (each micro-batch's, with
        ``grad_accum``), ``on_grads(model)`` the model after the (last) backward and before the update: ``compare``
        uses them to record what it compares. They are called with references only; what they keep is on them.
        With ``fused_backward`` the update runs inside the backward, so no gradient is left when it ends:
        ``on_grads(model)`` then sees each parameter's gradient at its hook, before its update, as
        ``model.named_parameters()`` would have shown it after a backward.
        """
        step = self.step
        if self.fused and on_grads is not None:
            return self._run_fused_observed(inputs, on_output, on_grads)
        return _run(
            self.model, inputs, step.mode, None if self.fused else self.optimizer, self.handle, on_output, on_grads,
            grad_accum=step.grad_accum, autocast=self.autocast, scaler=self.scaler,
        )  # fmt: skip

    def _run_fused_observed(
        self, inputs: Mapping[str, Any], on_output: OutputHook | None, on_grads: GradsHook
    ) -> torch.Tensor | None:
        """A fused step whose gradients ``on_grads`` sees: each one as its hook gets it, shown to ``on_grads`` on
        a stand-in model whose ``named_parameters()`` carry those gradients (and nothing else)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        seen: dict[str, torch.Tensor] = {}

        def observe(p: torch.Tensor) -> None:
            seen[names[id(p)]] = p.grad.detach().clone()

        self.grad_observers.append(observe)
        try:
            loss = _run(
                self.model, inputs, self.step.mode, None, self.handle, on_output, None,
                grad_accum=self.step.grad_accum, autocast=self.autocast, scaler=self.scaler,
            )  # fmt: skip
        finally:
            self.grad_observers.remove(observe)
        on_grads(_GradsSeen(seen))
        return loss

    def remove(self) -> None:
        """Take the fused backward's hooks, or the CPU optimizer's, off the model's parameters (nothing else to
        undo)."""
        for h in self.fused:
            h.remove()
        self.fused = []
        if hasattr(self.optimizer, "host_tensors"):  # torchao's CPUOffloadOptimizer (optimizer_on="cpu")
            self.optimizer.remove()

    def tracked_objects(self) -> dict[str, Any]:
        """What ``memkit.track`` needs to count this runner's memory from the start: the model, its
        optimizer and the memory the optimizations own."""
        owned = self.handle
        extra = {}
        if self.scaler is not None and self.scaler.state_tensors():  # its scale, made by the first step
            extra["optimizer_state"] = self.scaler.state_tensors()
        if hasattr(self.optimizer, "host_tensors"):  # the parameters' and gradients' copies CPU offload made
            extra.update(self.optimizer.host_tensors())
        if extra:
            owned = dict(self.handle.owned()) if self.handle is not None else {}
            for category, tensors in extra.items():
                owned[category] = [*owned.get(category, []), *tensors]
        return {"model": self.model, "optimizer": self.optimizer, "owned": owned}

    def __repr__(self) -> str:
        return f"StepRunner({self.step}, {type(self.model).__name__})"
