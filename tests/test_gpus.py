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


def _cli(argv, capsys):
    import json

    from memkit.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, (json.loads(out.out) if "--json" in argv and code in (0, 1) else None), out.err


def test_the_command_line_exit_status_is_the_verdict(capsys):
    code, fits, _ = _cli(["estimate", "pixart", "--size", "tiny", "--gpu", "t4", "--json"], capsys)
    assert code == 0 and fits["fits"] is True and fits["verdict"] == "fits" and fits["gpu"] == "t4"
    assert fits["headroom_bytes"] == fits["usable_bytes"][0] - fits["peak_reserved_bytes"]
    # 0.6 GiB less the context (426 MiB) and the workspace (32 MiB, an explicit size is taken as sm90): ~156 MiB,
    # under small PixArt's bf16 weights alone
    code, short, _ = _cli(["estimate", "pixart", "--size", "small", "--gpu", "0.6GiB", "--json"], capsys)
    assert code == 1 and short["fits"] is False and short["verdict"] == "does not fit" and short["headroom_bytes"] < 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu", "no-such-gpu"], "unknown gpu 'no-such-gpu': one of t4, l4"),
        (["--gpu", "4090", "--device", "cpu"], "--gpu judges a --device cuda estimate"),
    ],
)
def test_a_bad_gpu_is_a_clean_error(argv, message, capsys):
    code, _, err = _cli(["estimate", "pixart", "--size", "tiny", *argv], capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_estimate_takes_a_gpu_and_judges_its_reserved_peak():
    tl = memkit.estimate("pixart", size="tiny", gpu="24GiB", progress=False)
    assert tl.meta["fits"] is True and tl.meta["gpu"] == "24GiB" and tl.meta["verdict"] == "fits"
    assert tl.meta["headroom_bytes"] == 24 * GiB - 426 * MiB - 32 * MiB - tl.peak_reserved_bytes
    again = memkit.estimate("pixart", size="tiny", progress=False)  # the process cache holds no verdict
    assert again.meta["cached"] and "fits" not in again.meta
    with pytest.raises(ValueError, match="gpu='4090' judges a device='cuda' estimate"):
        memkit.estimate("pixart", size="tiny", device="cpu", gpu="4090", progress=False)
    with pytest.raises(ValueError, match="unknown gpu"):
        memkit.estimate("pixart", size="tiny", gpu="4091", progress=False)


@pytest.mark.slow  # two full-size estimates (~10-20 s each)
def test_full_flux_does_not_fit_a_4090_and_full_pixart_does(capsys):
    # full FLUX.1-dev full fine-tune: 110.85 GiB allocated at its steady step, far over 24 GB; PixArt-Sigma's ~9.2 GiB
    code, flux, _ = _cli(["estimate", "flux", "--gpu", "4090", "--json"], capsys)
    assert code == 1 and flux["verdict"] == "does not fit" and flux["peak_reserved_bytes"] >= flux["peak_bytes"]
    code, pixart, _ = _cli(["estimate", "pixart", "--gpu", "4090", "--json"], capsys)
    assert code == 0 and pixart["fits"] and pixart["peak_reserved_bytes"] >= pixart["peak_bytes"]
