import pytest

from memkit.units import best_unit, format_bytes, unit_scale


def test_units_are_binary():
    assert [unit_scale(u) for u in ("B", "KiB", "MiB", "GiB")] == [1, 1024, 1024**2, 1024**3]


def test_best_unit_and_format():
    assert best_unit(0) == "B" and best_unit(1023) == "B" and best_unit(1024) == "KiB"
    assert best_unit(5 * 2**30) == "GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536 * 2**20) == "1.50 GiB"


def test_unknown_unit_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unit must be one of \['B', 'KiB', 'MiB', 'GiB'\], got 'MB'"):
        unit_scale("MB")
