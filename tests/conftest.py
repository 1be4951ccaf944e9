import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Tests run with the machine's thread count restored after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# Slow tests in modules other work is reshaping (the estimate, the CLI, the budget planner): marked here, by name, to
# leave those files alone; the rest carry @pytest.mark.slow themselves. Each takes 15-60 s on a 2-core machine.
SLOW_ELSEWHERE = (
    "tests/test_estimate.py::test_estimate_equals_real_tracked_peak_for_every_small_preset",
    "tests/test_estimate.py::test_estimate_equals_real_tracked_peak_for_every_tiny_preset",
    "tests/test_cli.py::test_estimate_fsdp_is_the_library_s_parallel_estimate",
    "tests/test_cli.py::test_checkpointing_auto_fits_a_budget",
    "tests/test_checkpoint_plan.py::test_the_chosen_pattern_fits_and_its_real_peak_is_the_prediction",
    "tests/test_checkpoint_plan.py::test_checkpointing_with_a_budget_plans_for_the_estimate_it_is_given_to",
    "tests/test_checkpoint_plan.py::test_apply_with_a_budget_plans_on_a_fake_copy_of_the_model_and_remove_restores_it",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW_ELSEWHERE:
            item.add_marker(pytest.mark.slow)
