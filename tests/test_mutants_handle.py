"""Handle and apply_all behaviours that mutation testing (``python -m bench.mutation handle``) found unchecked:
default names and the errors at the public boundary, which name the argument and the type given."""

import pytest
import torch

from memkit.handle import Handle, apply_all


def test_a_handle_without_a_name_is_called_optimization():
    handle = Handle(lambda: None)
    assert handle.name == "optimization"
    assert repr(handle) == "Handle('optimization', active=True)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"undo": 42}, "undo must be callable, got int"),
        ({"undo": lambda: None, "after_step": 3}, "after_step must be callable or None, got int"),
        (
            {"undo": lambda: None, "owned": [torch.zeros(1)]},
            "owned must map a category to tensors, e.g. {'ema': shadows}, got list",
        ),
    ],
)
def test_bad_arguments_are_named_with_the_type_given(kwargs, message):
    undo = kwargs.pop("undo")
    with pytest.raises(TypeError) as info:
        Handle(undo, **kwargs)
    assert str(info.value) == message


class Returns:
    def __init__(self, value):
        self.value = value

    def apply(self, model):
        return self.value


def test_apply_all_names_what_is_not_an_optimization_and_what_apply_returned():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError) as info:
        apply_all(model, [object()])
    assert str(info.value) == (
        "optimizations[0] must have an .apply(model) method (e.g. memkit.Checkpointing()), got object"
    )
    with pytest.raises(TypeError) as info:
        apply_all(model, [Returns(Handle(lambda: None)), Returns(5)])
    assert str(info.value) == "optimizations[1].apply(model) must return a memkit.Handle, got int"


def test_apply_all_of_nothing_is_a_handle_named_none():
    handle = apply_all(torch.nn.Linear(2, 2), [])
    assert handle.name == "none" and handle.owned() == {}
    handle.after_step()
    handle.remove()
    assert not handle.active
