"""memkit.gpus: the catalog of GPUs, what a step can reserve on each, and the verdict on an estimate's peak."""

import pytest

import memkit
from memkit import gpus

MiB, GiB = 1 << 20, 1 << 30
CONTEXT_SPREAD = 426 * MiB - 287_047_680


def test_the_catalog_has_the_cards_users_train_on():
    wanted = {"t4", "l4", "a10g", "3090", "4090", "5090", "l40s", "a100-40gb", "a100-80gb", "h100", "h200", "b200"}
    assert wanted | {"mi300x"} == set(gpus.CATALOG)
    for gpu in gpus.CATALOG.values():
        low, high = gpu.total_bytes
        assert 0 < low <= high and gpu.source and gpu.name
        ulow, uhigh = gpu.usable_bytes()  # the context and workspace taken; the spread widens by the context
        assert ulow < low and uhigh < high and uhigh - ulow == high - low + CONTEXT_SPREAD


def test_usable_is_the_total_minus_the_context_minus_torchs_cublas_workspace():
    # pytorch/pytorch#86509: 287,047,680 B of context with lazy loading; unsloth-zoo#1053: 426 MiB under nvidia-smi
    assert gpus.CONTEXT_BYTES == (287_047_680, 426 * MiB)
    # aten/src/ATen/cuda/CublasHandlePool.cpp: sm90 ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8
    h100, a100 = gpus.find("h100"), gpus.find("a100-40gb")
    assert h100.workspace_bytes == 33_554_432 and a100.workspace_bytes == 8_519_680
    # the H100's printed totals: 81,082-81,090 MiB
    assert h100.usable_bytes() == (81_082 * MiB - 426 * MiB - 33_554_432, 81_090 * MiB - 287_047_680 - 33_554_432)
    assert gpus.find("mi300x").workspace_bytes == 108 * MiB  # hipBLASLt's 76 MiB beside a 32 MiB hipBLAS one


@pytest.mark.parametrize(
    "peak, status",
    [
        (0, "fits"),
        (20 * GiB, "fits"),
        # RTX 4090: 24,563 MiB printed; usable 24,563 MiB - 426 MiB - 8,519,680 B at the low end
        (24_563 * MiB - 426 * MiB - 8_519_680, "fits"),
        (24_563 * MiB - 426 * MiB - 8_519_680 + 1, "within the spread"),
        (24_563 * MiB - 287_047_680 - 8_519_680, "within the spread"),
        (24_563 * MiB - 287_047_680 - 8_519_680 + 1, "does not fit"),
        (100 * GiB, "does not fit"),
    ],
)
def test_the_verdict_places_a_peak_against_the_spread(peak, status):
    v = gpus.verdict(peak, "4090")
    assert v.status == status and v.fits == (status == "fits")
    assert v.headroom_bytes == 24_563 * MiB - 426 * MiB - 8_519_680 - peak
    assert v.gpu.key in v.describe() and status in v.describe()


def test_names_are_found_in_any_case_and_by_alias():
    assert gpus.find("RTX4090") is gpus.find("4090") is gpus.CATALOG["4090"]
    assert gpus.find("A100").key == "a100-80gb" and gpus.find(" H100 ").key == "h100"


@pytest.mark.parametrize("text, total", [("24GiB", 24 * GiB), ("24 GB", 24 * 10**9), ("80G", 80 * GiB)])
def test_an_explicit_size_is_a_card_of_that_total(text, total):
    gpu = gpus.find(text)
    assert gpu.total_bytes == (total, total) and gpu.source == "the size given"
    assert gpu.usable_bytes()[0] == total - 426 * MiB - 32 * MiB


@pytest.mark.parametrize("text", ["no-such-gpu", "4091", "0.1GiB", ""])
def test_an_unknown_name_lists_the_known_ones(text):
    with pytest.raises(ValueError, match=r"gpu|GPU") as e:
        gpus.find(text)
    assert "0.1GiB" in text or ("4090" in str(e.value) and "24GiB" in str(e.value))


def test_a_negative_peak_is_refused():
    with pytest.raises(ValueError, match="peak_reserved_bytes must be >= 0"):
        gpus.verdict(-1, "t4")


def test_memkit_exposes_the_module():
    assert memkit.gpus.find is gpus.find
