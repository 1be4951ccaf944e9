import pytest
import torch

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


def test_apply_all_removes_in_reverse_order():
    model = torch.nn.Linear(2, 2)
    order = []
    h = apply_all(model, [Flag("a"), Flag("b")])
    assert model.a and model.b
    h._undo = (lambda undo: lambda: (order.append("all"), undo()))(h._undo)
    h.remove()
    assert not hasattr(model, "a") and not hasattr(model, "b") and order == ["all"]


def test_apply_all_leaves_nothing_half_applied_on_failure():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="b failed"):
        apply_all(model, [Flag("a"), Flag("b", fail=True)])
    assert not hasattr(model, "a")


def test_apply_all_rejects_non_optimizations_by_position():
    with pytest.raises(TypeError, match=r"optimizations\[1\] must have an \.apply"):
        apply_all(torch.nn.Linear(2, 2), [Flag("a"), "checkpointing"])
