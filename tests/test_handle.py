import pytest
import torch

import memkit
from memkit.handle import Handle, apply_all


class Flag:
    """A toy optimization that sets an attribute and can be told to fail."""

    def __init__(self, name, fail=False):
        self.name, self.fail = name, fail

    def apply(self, model):
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        setattr(model, self.name, True)
        return Handle(lambda: delattr(model, self.name), name=self.name)


def test_handle_is_a_context_manager_and_idempotent():
    calls = []
    with Handle(lambda: calls.append(1)) as h:
        assert h.active
    assert calls == [1] and not h.active
    h.remove()
    assert calls == [1]


class Logged:
    """Appends to a shared log when applied, removed and stepped."""

    def __init__(self, name, log, owned=None):
        self.name, self.log, self.owned = name, log, owned

    def apply(self, model):
        self.log.append(("apply", self.name))
        return Handle(
            lambda: self.log.append(("remove", self.name)),
            name=self.name,
            owned=self.owned,
            after_step=lambda: self.log.append(("step", self.name)),
        )


def test_apply_all_removes_in_reverse_order_and_steps_in_order():
    log = []
    h = apply_all(torch.nn.Linear(2, 2), [Logged("a", log), Logged("b", log), Logged("c", log)])
    assert h.name == "a + b + c"
    h.after_step()
    h.remove()
    h.remove()  # idempotent
    assert log == [
        ("apply", "a"),
        ("apply", "b"),
        ("apply", "c"),
        ("step", "a"),
        ("step", "b"),
        ("step", "c"),
        ("remove", "c"),
        ("remove", "b"),
        ("remove", "a"),
    ]


def test_a_failure_undoes_the_applied_ones_in_reverse_order():
    log = []
    with pytest.raises(RuntimeError, match="x failed"):
        apply_all(torch.nn.Linear(2, 2), [Logged("a", log), Logged("b", log), Flag("x", fail=True)])
    assert log == [("apply", "a"), ("apply", "b"), ("remove", "b"), ("remove", "a")]


def test_owned_memory_is_merged_by_category_and_gone_after_remove():
    a, b, c = torch.zeros(3), torch.zeros(5), torch.zeros(7)
    log = []
    h = apply_all(
        torch.nn.Linear(2, 2),
        [Logged("x", log, owned={"ema": [a]}), Logged("y", log, owned=lambda: {"ema": [b], "temporary": [c]})],
    )
    owned = h.owned()
    assert set(owned) == {"ema", "temporary"}
    assert [t is a for t in owned["ema"]] == [True, False] and owned["ema"][1] is b and owned["temporary"][0] is c
    h.remove()
    assert h.owned() == {}
    h.after_step()  # a removed handle does no per-step work
    assert ("step", "x") not in log


def test_track_counts_what_a_handle_owns_from_before_the_window():
    shadow = torch.zeros(100)
    with Handle(lambda: None, owned={"ema": [shadow]}) as h, memkit.track(owned=h) as tl:
        pass
    assert tl.baseline_by_category["ema"] == 400 and tl.baseline_bytes == 400
    with memkit.track(owned={"optimizer_state": shadow}) as tl:
        pass
    assert tl.baseline_by_category["optimizer_state"] == 400


def test_handle_arguments_are_checked():
    with pytest.raises(TypeError, match="undo must be callable"):
        Handle(None)
    with pytest.raises(ValueError, match="category must be one of"):
        Handle(lambda: None, owned={"weights": []})
    with pytest.raises(TypeError, match="owned must map a category"):
        Handle(lambda: None, owned=[torch.zeros(1)])
    with pytest.raises(TypeError, match="after_step must be callable"):
        Handle(lambda: None, after_step=1)
    with pytest.raises(TypeError, match="owned must be a memkit.Handle or a mapping"):
        with memkit.track(owned=[torch.zeros(1)]):
            pass


def test_apply_must_return_a_handle():
    class Bad:
        def apply(self, model):
            return None

    with pytest.raises(TypeError, match=r"optimizations\[0\].apply\(model\) must return a memkit.Handle"):
        apply_all(torch.nn.Linear(2, 2), [Bad()])


def test_apply_all_leaves_nothing_half_applied_on_failure():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="b failed"):
        apply_all(model, [Flag("a"), Flag("b", fail=True)])
    assert not hasattr(model, "a")


def test_apply_all_rejects_non_optimizations_by_position():
    with pytest.raises(TypeError, match=r"optimizations\[1\] must have an \.apply"):
        apply_all(torch.nn.Linear(2, 2), [Flag("a"), "checkpointing"])
