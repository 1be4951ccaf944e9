"""Each memory category's definition (``memkit.memory.events.CATEGORIES``) as a test that can fail, and how the
categories relate to torch's own ``MemTracker``.

Expected values come from the objects themselves (``untyped_storage().nbytes()`` of parameters, gradients,
``optimizer.state``, tensors saved for backward), never from a previous run's output.
"""

import numpy as np
import pytest
import torch
from torch import nn

import memkit
from memkit.memory import phase, tag, track
from memkit.memory.events import ALLOC, CATEGORIES, PHASES

# `make test-fast` keeps these cases (tests/conftest.py); the others run in `make test` and CI
FAST_CASES = {
    "test_optimizer_state_is_exactly_what_survives_in_optimizer_state": {"adamw-steady-step"},
    "test_categories_against_torch_memtracker": {"flux", "dit"},
}


def nbytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (non-tensors ignored)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return nbytes(v for s in opt.state.values() for v in s.values())


def events(tl, *, phase_name: str | None = None, action: int | None = None, start: int = 0, stop: int | None = None):
    """Event rows as dicts (storage rows only: kernel-internal buffers, storage -1, are left out)."""
    c = {name: tl.column(name)[start:stop].tolist() for name in ("action", "bytes", "category", "phase", "storage")}
    rows = []
    for i, (a, b, cat, ph, st) in enumerate(zip(*c.values(), strict=True)):
        if st == -1 or (action is not None and a != action) or (phase_name is not None and PHASES[ph] != phase_name):
            continue
        rows.append({"index": start + i, "action": a, "bytes": b, "category": CATEGORIES[cat], "storage": st})
    return rows


def alloc_event_of(tl, t: torch.Tensor) -> dict:
    """The allocation event of the live storage behind ``t`` (storage keys can be reused after a free: the
    last allocation with the key is the live one)."""
    key = t.untyped_storage()._cdata
    rows = [r for r in events(tl, action=ALLOC) if r["storage"] == key]
    assert rows, "the storage was not allocated inside the window"
    return rows[-1]


class Net(nn.Module):
    """Linear → GELU → Linear, with a scratch tensor that dies inside the forward and one kept past it."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(32, 64), nn.Linear(64, 16)
        self.register_buffer("scale", torch.ones(16))
        self.kept = None

    def forward(self, x):
        h = self.lin1(x)
        scratch = torch.ones(1000)  # dies inside the forward
        del scratch
        self.kept = torch.empty_like(h)  # nobody needs it in backward, but it is alive when backward starts
        return self.lin2(nn.functional.gelu(h)) * self.scale


def tiny_adamw_model(preset: str = "dit", *, foreach: bool = False, steps_before: int = 1):
    model = memkit.load_model(preset)
    inputs = memkit.make_inputs(model)
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    for _ in range(steps_before):
        memkit.train_step(model, inputs, opt)
    return model, inputs, opt


# ---- optimizer_state and the optimizer's scratch -----------------------------------------------------------------
@pytest.mark.parametrize("steps_before", [0, 1], ids=["first-step", "steady-step"])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, foreach=False),
        lambda ps: torch.optim.AdamW(ps, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["adamw", "adamw-foreach", "sgd-momentum"],
)
def test_optimizer_state_is_exactly_what_survives_in_optimizer_state(make_opt, steps_before):
    model = memkit.load_model("dit")
    inputs = memkit.make_inputs(model)
    opt = make_opt(model.parameters())
    for _ in range(steps_before):
        memkit.train_step(model, inputs, opt)
    before = state_bytes(opt)
    with track(model, optimizer=opt, inputs=inputs) as tl:
        memkit.train_step(model, inputs, opt)
    after = state_bytes(opt)
    assert after > 0 and tl.baseline_by_category["optimizer_state"] == before
    assert tl.bytes_by_category_at(len(tl) - 1)["optimizer_state"] == after
    # Only what survives in optimizer.state: the series never rises above it, so no scratch is ever in it.
    assert tl.live_by_category()["optimizer_state"].max() == after
    born = events(tl, action=ALLOC)
    assert sum(r["bytes"] for r in born if r["category"] == "optimizer_state") == after - before


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
def test_adamw_scratch_is_temporary_in_the_optimizer_phase_and_dies_there(foreach):
    model, inputs, opt = tiny_adamw_model(foreach=foreach)
    with track(model, optimizer=opt, inputs=inputs) as tl:
        memkit.train_step(model, inputs, opt)
    in_step = events(tl, phase_name="optimizer")
    born = [r for r in in_step if r["action"] == ALLOC]
    assert born and {r["category"] for r in born} == {"temporary"}
    died = {r["storage"] for r in in_step if r["action"] != ALLOC}
    assert {r["storage"] for r in born} <= died  # the update's scratch dies inside optimizer.step()
    # "What the scratch costs" is the peak of temporary during the optimizer phase. Per-tensor AdamW holds
    # sqrt(v) and sqrt(v)/c at once for the largest parameter; foreach holds sqrt(v) of every parameter.
    temp_in_step = tl.live_by_category()["temporary"][tl.column("phase") == PHASES.index("optimizer")]
    sizes = [p.untyped_storage().nbytes() for p in model.parameters()]
    assert temp_in_step.max() >= (sum(sizes) if foreach else 2 * max(sizes))


# ---- gradient: its final role, from its allocation ---------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_gradient_is_gradient_from_its_allocation_and_so_is_its_accumulation():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 32)
    params = list(net.parameters())
    with track(net, inputs={"x": x}) as tl:
        net(x).pow(2).mean().backward()  # first backward: no accumulation
        first = {id(p): p.grad.untyped_storage()._cdata for p in params}
        for p in params:
            assert alloc_event_of(tl, p.grad)["category"] == "gradient"
        assert tl.bytes_by_category_at(len(tl) - 1)["gradient"] == nbytes(p.grad for p in params)

        mark = len(tl)
        net(x).pow(2).mean().backward()  # accumulates in place: param.grad keeps its storage
        assert {id(p): p.grad.untyped_storage()._cdata for p in params} == first
        second = events(tl, phase_name="backward", start=mark)
        # the incoming gradients are added and die before any role is known: they stay temporary
        assert {r["category"] for r in second if r["action"] == ALLOC} == {"temporary"}
        assert tl.bytes_by_category_at(len(tl) - 1)["gradient"] == nbytes(p.grad for p in params)

        mark = len(tl)
        net(x).pow(2).mean().backward(create_graph=True)  # accumulates out of place: a new param.grad storage
        for p in params:
            assert p.grad.untyped_storage()._cdata != first[id(p)]
            event = alloc_event_of(tl, p.grad)
            assert event["index"] >= mark and event["category"] == "gradient"
        for key in first.values():  # the old param.grad storages die as gradients (the first event with the
            # key after the mark is their free; the allocator may hand the address to a new storage later)
            freed = next(r for r in events(tl, start=mark) if r["storage"] == key)
            assert freed["action"] != ALLOC and freed["category"] == "gradient"
        end = tl.bytes_by_category_at(len(tl) - 1)
    assert end["gradient"] == nbytes(p.grad for p in params)
    for p in params:
        p.grad = None  # break the create_graph cycle


def test_the_gradient_stack_never_jumps_when_the_role_becomes_known():
    # A retag rewrites the allocation event, so the gradient series rises only at allocation events.
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 32)
    with track(net, inputs={"x": x}) as tl:
        net(x).pow(2).mean().backward()
    grad = tl.live_by_category()["gradient"]
    rises = (grad[1:] > grad[:-1]).nonzero()[0] + 1
    assert len(rises) == len(list(net.parameters()))
    assert all(tl.column("action")[i] == ALLOC for i in rises)


# ---- activation and temporary ------------------------------------------------------------------------------------
def test_forward_allocations_alive_at_backward_start_are_activation_the_rest_temporary():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 32)
    before = {t.untyped_storage()._cdata for t in [x, *net.parameters(), *net.buffers()]}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in before:
            saved[s._cdata] = s.nbytes()
        return t

    with track(net, inputs={"x": x}) as tl:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = net(x)
            with phase("forward"):  # as memkit's step computes its loss
                loss = out.pow(2).mean()
        forward_end = len(tl)
        loss.backward()
    # alive when backward starts: what autograd saved, the loss, and what the module kept
    for t in (loss, net.kept):
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    fwd = events(tl, phase_name="forward", action=ALLOC, stop=forward_end)
    assert sum(r["bytes"] for r in fwd if r["category"] == "activation") == sum(saved.values())
    assert {r["storage"] for r in fwd if r["category"] == "activation"} == set(saved)
    # freed before backward: the scratch (1000 floats), lin2's output (a product with a buffer saves only the
    # buffer) and out.pow(2) (mean() saves nothing), the last two the size of out
    temporary = sum(r["bytes"] for r in fwd if r["category"] == "temporary")
    assert temporary == 4 * 1000 + 2 * out.untyped_storage().nbytes()
    assert {r["category"] for r in fwd} == {"activation", "temporary"}


def test_an_allocation_outside_the_forward_phase_is_not_an_activation():
    # The same loss computed outside any module and outside phase("forward") is temporary, even though
    # backward keeps it: activation is decided by the phase the storage was born in.
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 32)
    with track(net, inputs={"x": x}) as tl:
        y = net(x)
        mark = len(tl)
        kept_for_backward = y.exp()  # outside the forward phase; exp saves its result
        kept_for_backward.sum().backward()
    born = events(tl, action=ALLOC, start=mark)
    assert born[0]["storage"] == kept_for_backward.untyped_storage()._cdata and born[0]["category"] == "temporary"


def test_recompute_under_checkpointing_is_activation():
    model = memkit.load_model("flux")
    inputs = memkit.make_inputs(model)
    spans: list[list[int]] = []  # [start, end) event indices of each recompute, seen by our own hooks
    depth = 0
    tl = None

    def pre(module, args):
        nonlocal depth
        if torch._C._current_graph_task_id() != -1:
            if depth == 0:
                spans.append([len(tl), -1])
            depth += 1

    def post(module, args, output):
        nonlocal depth
        if torch._C._current_graph_task_id() != -1:
            depth -= 1
            if depth == 0:
                spans[-1][1] = len(tl)

    hooks = [m.register_forward_pre_hook(pre) for m in model.modules()]
    hooks += [m.register_forward_hook(post, always_call=True) for m in model.modules()]
    try:
        with memkit.Checkpointing(pattern="all").apply(model):
            with track(model, inputs=inputs) as tl:
                memkit.train_step(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    assert spans and all(end > start for start, end in spans)
    backward = events(tl, phase_name="backward", action=ALLOC)
    inside = [r for r in backward if any(s <= r["index"] < e for s, e in spans)]
    outside = [r for r in backward if not any(s <= r["index"] < e for s, e in spans)]
    assert inside and {r["category"] for r in inside} == {"activation"}
    assert "activation" not in {r["category"] for r in outside}


# ---- registered objects: parameter, buffer, input, ema -----------------------------------------------------------
def test_modules_seen_by_forward_hooks_register_their_parameters_and_buffers():
    net, x = Net(), torch.randn(4, 32)
    with torch.no_grad(), track() as tl:  # nothing passed: the forward hooks find the modules
        net(x)
    base = tl.baseline_by_category
    assert base["parameter"] == nbytes(net.parameters())
    assert base["buffer"] == nbytes(net.buffers())
    assert base["input"] == 0  # an input not passed to track() is not seen


def test_a_pre_window_storage_retagged_inside_moves_its_bytes_between_baseline_categories():
    a, b = torch.zeros(100), torch.zeros(7)
    with track(inputs={"a": a, "b": b}) as tl:
        assert tl.baseline_by_category["input"] == nbytes([a, b])
        tag(a, "ema")
    base = tl.baseline_by_category
    assert base["input"] == nbytes([b])  # the old category loses exactly a's bytes...
    assert base["ema"] == nbytes([a])  # ...the new one gains them...
    assert tl.baseline_bytes == nbytes([a, b])  # ...and the total is unchanged
    assert tl.peak_by_category() == base


def test_tag_names_ema_from_the_allocation_and_for_untracked_storages():
    before_window = torch.zeros(50)  # not passed to track(): tagging it adds it to the baseline
    with track() as tl:
        with phase("ema"):
            shadow = torch.zeros(64)
        torch.ones(10)  # other events between the allocation and the tag
        tag([shadow, before_window], "ema")
    assert alloc_event_of(tl, shadow)["category"] == "ema"
    assert tl.baseline_by_category["ema"] == nbytes([before_window])
    assert tl.bytes_by_category_at(len(tl) - 1)["ema"] == nbytes([shadow, before_window])
    tag(shadow, "ema")  # no tracker active: a no-op


# ---- against torch's MemTracker ----------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["flux", "sd3", "unet", "dit"])
def test_categories_against_torch_memtracker(preset):
    mem_tracker = pytest.importorskip(
        "torch.distributed._tools.mem_tracker", reason="torch.distributed's MemTracker is not in this torch build"
    )
    model, inputs, opt = tiny_adamw_model(preset)
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    cpu = torch.device("cpu")

    def step(mark):  # memkit.train_step, with a look at each boundary
        out = memkit.step.model_output(model(**inputs))
        with phase("forward"):
            loss = out.float().pow(2).mean()
        del out
        mark("backward start")
        loss.backward()
        mark("backward end")
        opt.step()
        mark("optimizer end")
        opt.zero_grad(set_to_none=True)

    at: dict[str, int] = {}
    grads: list[int] = []

    def mark(name):
        at[name] = len(tl) - 1
        grads.append(nbytes(p.grad for p in model.parameters()))

    with track(model, optimizer=opt, inputs=inputs) as tl:
        step(mark)
    theirs: dict[str, dict] = {}
    mt = mem_tracker.MemTracker()
    mt.track_external(model, opt, *tensors)
    with mt:
        step(lambda name: theirs.__setitem__(name, mt.get_tracker_snapshot()[cpu]))
    R = mem_tracker._MemRefType

    def ours(name: str) -> dict[str, int]:
        return tl.bytes_by_category_at(at[name])

    # registered objects agree to the byte: parameters, buffers, and the inputs (MemTracker's "Other")
    for name in at:
        assert ours(name)["parameter"] == theirs[name][R.PARAM] == nbytes(model.parameters())
        assert ours(name)["buffer"] == theirs[name].get(R.BUFFER, 0) == nbytes(model.buffers())
        assert ours(name)["input"] == theirs[name][R.OTH] == nbytes(tensors)
    # activation: everything the forward (and the loss) left alive when backward starts
    # (memkit also counts the Python numbers autograd saved, ``x / 2.0``'s divisor: storage keys below -1, made
    # before dispatch, which MemTracker cannot see)
    saved_numbers = tl.column("storage")[: at["backward start"] + 1] < -1
    saved_bytes = int(tl.signed_bytes[: at["backward start"] + 1][saved_numbers].sum())
    assert ours("backward start")["activation"] - saved_bytes == theirs["backward start"][R.ACT] > 0
    # gradient: at the end of backward, exactly the gradients in both
    assert grads[0] == 0 and grads[1] > 0
    assert ours("backward end")["gradient"] == theirs["backward end"][R.GRAD] == grads[1]
    # optimizer state: after the step, exactly what survives in optimizer.state in both
    assert ours("optimizer end")["optimizer_state"] == theirs["optimizer end"][R.OPT] == state_bytes(opt)
    # Inside the step MemTracker's Optstate also holds the update's scratch, which memkit calls temporary:
    # at the peak (in the update, at these sizes) their Optstate is our optimizer_state + temporary, counting
    # the storages both see (memkit also adds kernel-internal buffers, storage -1, which MemTracker cannot see).
    storage_rows = tl.column("storage") >= 0
    signed = np.where(storage_rows, tl.signed_bytes, 0)
    live = tl.baseline_bytes + np.cumsum(signed)
    peak = int(np.argmax(live))
    assert PHASES[tl.column("phase")[peak]] == "optimizer"
    mt_peak = mt.get_tracker_snapshot("peak")[cpu]
    assert live[peak] == mt_peak["Total"]
    cat = tl.column("category")[: peak + 1]
    at_peak = {
        c: tl.baseline_by_category[c] + int(signed[: peak + 1][cat == i].sum()) for i, c in enumerate(CATEGORIES)
    }
    assert at_peak["optimizer_state"] + at_peak["temporary"] == mt_peak[R.OPT]
    assert at_peak["optimizer_state"] == state_bytes(opt) < mt_peak[R.OPT]
    assert at_peak["gradient"] == mt_peak[R.GRAD]
