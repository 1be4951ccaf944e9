"""How the tracker knows FSDP2's own storages: the unsharded parameters it all-gathers and its communication
buffers.

``fully_shard`` (FSDP2) keeps each parameter as a DTensor shard (the tracker counts its local tensor as
``parameter``, its gradient shard as ``gradient``, the optimizer's state on it as ``optimizer_state``). Around
each use it all-gathers the full parameters into storages it resizes from 0 bytes and back
(``unsharded_parameter``), and it communicates through flat buffers: the all-gather output, the reduce-scatter
input and output (``collective``; the reduce-scatter output's storage becomes the gradient shards, so it is
retagged ``gradient`` when FSDP hands it to the parameter).

With CPU offload (``CPUOffloadPolicy``) FSDP keeps the shards in host memory and copies each to the device before
its all-gather (``FSDPParam.all_gather_inputs``: ``.to(device)``). On a CPU mesh that copy is a no-op, so when a
tracker holds the shard as host state (an estimate for ``"cuda"``, see ``memkit.memory.host_state``) the wrapper
below makes the copy a GPU would make, a clone (``collective``: the all-gather's input); the copy of the gradient
shard back to the host is made by ``memkit.FSDP``'s own hook (``memkit/parallel.py``).

Nothing here changes what FSDP computes (a clone has the same values): while a tracker is active, four methods
are wrapped, and restored when the last tracker stops. They are internals of torch 2.11-2.14, found through
``memkit._torch_compat.fsdp_internals``: ``FSDPParam.all_gather_inputs`` (a property); FSDP2's ``allocate`` of
communication buffers
(what it returns is tagged ``collective``); ``FSDPParamGroup.wait_for_unshard``, the one place both the
all-gather path and the world-size-1 copy end with every parameter of a group unsharded (tagged
``unsharded_parameter``); and DTensor's ``ShardingPropagator._propagate_tensor_meta_non_cached``, which runs an
op on fake tensors to learn its output's shape the first time it meets a signature: the tracker ignores those
ops (they allocate nothing; under an estimate's fake mode they would look like real allocations).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

from .. import _torch_compat as _compat
from .recording import tag
from .tracker import _shapes_only, in_host_state

_saved: list[tuple[type, str, Callable]] = []


_unsharded_tensors = _compat.fsdp_unsharded_tensors


def _wrap_allocate(allocate: Callable) -> Callable:
    @functools.wraps(allocate)
    def allocate_tagged(self, *args, **kwargs):
        out = allocate(self, *args, **kwargs)
        tag(out, "collective")
        return out

    return allocate_tagged


def _wrap_wait_for_unshard(wait: Callable) -> Callable:
    @functools.wraps(wait)
    def wait_tagged(self, *args, **kwargs):
        out = wait(self, *args, **kwargs)
        tag(_unsharded_tensors(self), "unsharded_parameter")
        return out

    return wait_tagged


def _wrap_all_gather_inputs(inputs: property) -> property:
    get = inputs.fget

    @functools.wraps(get)
    def copied_to_device(self):
        host = self._sharded_param_data
        if not (
            self.offload_to_cpu
            and host.device == self.device  # a GPU's .to(device) copies; here it would return the shard itself
            and self.sharded_state.name == "SHARDED"
            and not hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")
            and in_host_state(host)
        ):
            return get(self)
        device_copy = host.clone()
        tag(device_copy, "collective")
        self._sharded_param_data = device_copy
        try:
            out = get(self)  # the copy itself, or (mixed precision) its cast, made on the device
        finally:
            self._sharded_param_data = host
        tag(out, "collective")
        return out

    return property(copied_to_device)


def _wrap_shape_propagation(propagate: Callable) -> Callable:
    @functools.wraps(propagate)
    def propagate_unseen(self, *args, **kwargs):
        _shapes_only[0] += 1
        try:
            return propagate(self, *args, **kwargs)
        finally:
            _shapes_only[0] -= 1

    return propagate_unseen


def instrument(on: bool) -> None:
    """Wrap (``on=True``) or restore FSDP2's buffer allocation and unshard; the tracker calls this when its
    first tracker starts and its last one stops. Idempotent."""
    if not on:
        while _saved:
            cls, name, original = _saved.pop()
            setattr(cls, name, original)
        return
    if _saved:
        return
    try:
        found = _compat.fsdp_internals()
    except ImportError as e:  # another torch: tracking still works, FSDP's storages keep phase-based categories
        warnings.warn(f"memkit: FSDP2's buffers cannot be categorized with this torch ({e})", stacklevel=2)
        return
    targets = [
        (found.group, "wait_for_unshard", _wrap_wait_for_unshard),
        (found.propagator, "_propagate_tensor_meta_non_cached", _wrap_shape_propagation),
        (found.param, "all_gather_inputs", _wrap_all_gather_inputs),
    ]
    targets += [(cls, "allocate", _wrap_allocate) for cls in found.allocators]
    for cls, name, wrap in targets:
        original = vars(cls).get(name)
        if original is None:
            continue
        _saved.append((cls, name, original))
        setattr(cls, name, wrap(original))
