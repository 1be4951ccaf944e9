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


def test_parse_bytes():
    from memkit.units import parse_bytes

    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("512 MiB") == 2**29 and parse_bytes("3") == 3
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes(" 7B ") == 7
    for bad in ("", "GiB", "-1GiB", "1 TB", "nan"):
        with pytest.raises(ValueError, match="a size must be"):
            parse_bytes(bad)
    with pytest.raises(TypeError, match="a size must be a string"):
        parse_bytes(40)


def test_format_seconds_keeps_three_significant_digits_in_the_unit_that_fits():
    from memkit.units import format_seconds

    assert format_seconds(3.6061) == "3.61 s" and format_seconds(1.0) == "1 s" and format_seconds(1234.5) == "1234 s"
    assert format_seconds(0.01234) == "12.3 ms" and format_seconds(0.001) == "1 ms"
    assert format_seconds(2.5e-6) == "2.5 µs" and format_seconds(0.000999) == "999 µs"
