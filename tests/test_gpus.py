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


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
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
    card = gpus.GPU("mine", "A small card", (tl.peak_reserved_bytes + 300 * MiB,) * 2, "a test")  # a GPU object
    judged = memkit.estimate("pixart", size="tiny", gpu=card, progress=False)
    assert judged.meta["gpu"] == "mine" and judged.meta["verdict"] == "within the spread"
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


# --- compute and bandwidth, for a step-time model --------------------------------------------------------------------
# A second reading of each vendor document, written from the document: TFLOP/s dense (a "with sparsity" figure halved),
# memory GB/s, host link and NVLink GB/s per direction (PCIe x16: Gen3 15.75, Gen4 31.5, Gen5 63 after 128b/130b).
GEN3, GEN4, GEN5 = 15.75, 31.5, 63.0
PUBLISHED = {
    # NVIDIA T4 datasheet: "Single-Precision 8.1 TFLOPS", "Mixed-Precision (FP16/FP32) 65 TFLOPS", "320+ GB/s", Gen3 x16
    "t4": (dict(fp32=8.1, fp16=65), 320, GEN3, None, "T4"),
    # NVIDIA L4 datasheet: FP32 30.3; TF32 120*, BF16 242*, FP16 242*, FP8 485* (* sparsity); 300 GB/s; Gen4 x16
    "l4": (dict(fp32=30.3, tf32=120 / 2, bf16=242 / 2, fp16=242 / 2, fp8=485 / 2), 300, GEN4, None, "L4"),
    # no A10G datasheet: compute unknown; Baseten ("A10 vs A10G"): 600 GB/s like the A10; GA102: PCIe Gen 4
    "a10g": (None, 600, GEN4, None, "A10G"),
    # GA102 whitepaper appendix A, RTX 3090: FP32 35.6, TF32 35.6, FP16/BF16 with FP32 accumulate 71; 936 GB/sec;
    # NVLink "56.25 GB/sec bandwidth in each direction"
    "3090": (dict(fp32=35.6, tf32=35.6, bf16=71, fp16=71), 936, GEN4, 56.25, "GA102"),
    # Ada whitepaper appendix A, RTX 4090 (FP32 accumulate, dense/sparse): FP16 165.2/330.4, BF16 165.2/330.4,
    # FP8 330.3/660.6 (v2.02 correction), TF32 82.6/165.2, FP32 82.6; 1008 GB/sec
    "4090": (dict(fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2, fp8=330.3), 1008, GEN4, None, "Ada"),
    # RTX Blackwell whitepaper appendix A, RTX 5090: BF16/FP16 with FP32 accumulate 209.5, FP8 419; FP32 104.8;
    # 1792 GB/sec; TF32 not found
    "5090": (dict(fp32=104.8, bf16=209.5, fp16=209.5, fp8=419), 1792, GEN5, None, "Blackwell"),
    # NVIDIA L40S datasheet, dense | sparse*: TF32 183 | 366*, BF16 362.05 | 733*, FP8 733 | 1,466*; FP32 91.6; 864 GB/s
    "l40s": (dict(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733), 864, GEN4, None, "L40S"),
    # NVIDIA A100 datasheet: FP32 19.5, TF32 156 | 312*, BF16 312 | 624*; 1,555 GB/s (40GB), 2,039 GB/s (80GB SXM);
    # NVLink 600 GB/s (both directions)
    "a100-40gb": (dict(fp32=19.5, tf32=156, bf16=312, fp16=312), 1555, GEN4, 600 / 2, "A100"),
    "a100-80gb": (dict(fp32=19.5, tf32=156, bf16=312, fp16=312), 2039, GEN4, 600 / 2, "A100"),
    # H100 whitepaper v1.04 table 3, SXM5 (dense/sparse): BF16 989.4/1978.9, TF32 494.7/989.4, FP8 1978.9/3957.8,
    # FP32 66.9; datasheet: 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions)
    "h100": (dict(fp32=66.9, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9), 3350, GEN5, 900 / 2, "H100"),
    # NVIDIA H200 datasheet, SXM: FP32 67; TF32 989*, BF16 1,979*, FP16 1,979*, FP8 3,958*; 4.8 TB/s; NVLink 900 GB/s
    "h200": (dict(fp32=67, tf32=989 / 2, bf16=1979 / 2, fp16=1979 / 2, fp8=3958 / 2), 4800, GEN5, 900 / 2, "H200"),
    # NVIDIA Blackwell datasheet, HGX B200 (tensor figures with sparsity): TF32 2.2 PF, FP16/BF16 4.5 PF, FP8 9 PF;
    # FP32 75 TFLOPS; 180GB HBM3E 7.7 TB/s; NVLink 1.8 TB/s (both directions)
    "b200": (dict(fp32=75, tf32=2200 / 2, bf16=4500 / 2, fp16=4500 / 2, fp8=9000 / 2), 7700, GEN5, 1800 / 2, "B200"),
    # AMD Instinct MI300X datasheet, dense | sparse: TF32 653.7 | 1,307.4, FP16/BF16 1,307.4 | 2,614.9,
    # FP8 2,614.9 | 5,229.8, FP32 vector 163.4; 5.3 TB/s; Infinity Fabric, no NVLink
    "mi300x": (dict(fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9), 5300, GEN5, None, "MI300X"),
}


@pytest.mark.parametrize("key", sorted(PUBLISHED))
def test_each_cards_figures_are_its_vendor_documents(key):
    flops, memory, host, nvlink, document = PUBLISHED[key]
    gpu = gpus.CATALOG[key]
    if flops is None:
        assert gpu.flops is None and all(gpu.flops_for(d) is None for d in gpus.DTYPES)
    else:
        assert set(gpu.flops) == set(flops)  # a dtype the card lacks (or the source lacks) is absent, not zero
        for dtype in gpus.DTYPES:
            want = flops.get(dtype)
            assert gpu.flops_for(dtype) == (None if want is None else pytest.approx(want * 1e12, rel=1e-9)), dtype
    assert gpu.memory_bandwidth == pytest.approx(memory * 1e9, rel=1e-9)
    assert gpu.host_link == pytest.approx(host * 1e9, rel=1e-9)
    assert gpu.nvlink == (None if nvlink is None else pytest.approx(nvlink * 1e9, rel=1e-9))
    assert document in gpu.spec_source and ("datasheet" in gpu.spec_source or "whitepaper" in gpu.spec_source)


def test_every_catalog_card_has_a_reading():
    assert set(PUBLISHED) == set(gpus.CATALOG)


def test_the_figures_keep_the_architectures_ratios():
    cat = gpus.CATALOG
    for key, gpu in cat.items():
        bf16, fp16, fp8 = (gpu.flops_for(d) for d in ("bf16", "fp16", "fp8"))
        if bf16 is not None and fp16 is not None:
            assert bf16 == fp16, key  # same tensor-core rate (GeForce: both with FP32 accumulate)
        if fp8 is not None:  # Ada, Hopper, Blackwell, CDNA3: FP8 at twice FP16's dense rate (the L40S's sheet: 2.02x)
            assert fp8 / fp16 == pytest.approx(2, rel=0.015), key
        if gpu.flops is not None and "tf32" in gpu.flops:
            assert gpu.flops_for("fp32") <= gpu.flops_for("tf32") < fp16, key
    for lacking, dtype in [("t4", "bf16"), ("t4", "tf32"), ("t4", "fp8"), ("3090", "fp8"), ("a100-40gb", "fp8")]:
        assert dtype not in cat[lacking].flops and cat[lacking].flops_for(dtype) is None
    assert cat["h200"].memory_bandwidth > cat["h100"].memory_bandwidth > cat["a100-80gb"].memory_bandwidth
    assert cat["a100-80gb"].memory_bandwidth > cat["a100-40gb"].memory_bandwidth
    assert cat["b200"].flops_for("fp8") > cat["h100"].flops_for("fp8") > cat["4090"].flops_for("fp8")
    assert cat["h100"].flops_for("bf16") == pytest.approx(989.4e12)  # not the 1,979 with sparsity
    assert cat["4090"].flops_for("bf16") == pytest.approx(165.2e12)  # not the 330.3 with FP16 accumulate
    for gpu in cat.values():
        assert gpu.nvlink is None or gpu.nvlink > gpu.host_link
        assert gpu.host_link in (15.75e9, 31.5e9, 63e9)


@pytest.mark.parametrize("dtype", ["float16", "BF16", "int8", "fp64", ""])
def test_flops_for_names_the_allowed_dtypes(dtype):
    with pytest.raises(ValueError, match=r"one of fp32, tf32, bf16, fp16, fp8"):
        gpus.find("h100").flops_for(dtype)


def test_a_card_made_from_a_size_has_no_figures():
    gpu = gpus.find("24GiB")
    assert gpu.flops is None and gpu.memory_bandwidth is None and gpu.host_link is None and gpu.nvlink is None
    assert gpu.spec_source == "" and all(gpu.flops_for(d) is None for d in gpus.DTYPES)
    made = gpus.GPU("x", "a card", (GiB, GiB), "given")  # the new fields default
    assert made.flops is None and made.flops_for("fp8") is None


def test_flops_take_only_known_dtypes_and_the_catalog_stays_frozen():
    with pytest.raises(ValueError, match=r"unknown dtypes \['int8'\]"):
        gpus.GPU("x", "a card", (GiB, GiB), "given", flops={"bf16": 1e12, "int8": 2e12})
    h100 = gpus.CATALOG["h100"]
    with pytest.raises(TypeError):
        h100.flops["bf16"] = 0.0  # a read-only mapping: the frozen card's figures cannot drift
    assert hash(h100) == hash(gpus.find("h100"))


class _Props:
    def __init__(self, name, total_memory, major=8, minor=9):
        self.name, self.total_memory, self.major, self.minor = name, total_memory, major, minor


def _fake_cuda(monkeypatch, *devices):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(devices))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: devices[i])


def test_local_is_none_without_a_cuda_device(monkeypatch):
    _fake_cuda(monkeypatch)
    assert gpus.local() is None


def test_local_is_the_catalog_card_with_this_devices_own_total(monkeypatch):
    own = 24_000 * 2**20  # not the catalog's 24,563 MiB: a driver keeping more
    _fake_cuda(monkeypatch, _Props("NVIDIA GeForce RTX 4090", own))
    gpu = gpus.local()
    card = gpus.find("4090")
    assert gpu.key == "4090" and gpu.total_bytes == (own, own) and "cuda:0" in gpu.source
    assert gpu.flops_for("bf16") == card.flops_for("bf16") and gpu.sm == card.sm
    assert gpu.usable_bytes() == (own - gpus.CONTEXT_BYTES[1] - card.workspace_bytes,
                                  own - gpus.CONTEXT_BYTES[0] - card.workspace_bytes)  # fmt: skip


def test_local_makes_a_card_the_catalog_lacks_from_its_total(monkeypatch):
    _fake_cuda(monkeypatch, _Props("NVIDIA H100 80GB HBM3", 81_082 * 2**20, 9, 0), _Props("Some GPU", 10 * 2**30, 7, 5))
    gpu = gpus.local(1)
    assert (gpu.key, gpu.name, gpu.total_bytes, gpu.sm) == ("cuda:1", "Some GPU", (10 * 2**30,) * 2, 75)
    assert gpu.flops is None and gpus.verdict(9 * 2**30, gpu).status == "fits"
    assert gpus.local(0).key == "h100"


@pytest.mark.parametrize("index", [-1, 2, 1.0, True])
def test_local_refuses_a_device_this_machine_lacks(monkeypatch, index):
    _fake_cuda(monkeypatch, _Props("NVIDIA L4", 22_000 * 2**20), _Props("NVIDIA L4", 22_000 * 2**20))
    with pytest.raises(ValueError, match="index"):
        gpus.local(index)


def test_find_takes_a_gpu_as_itself():
    card = gpus.GPU("mine", "A card", (8 * GiB, 8 * GiB), "a test")
    assert gpus.find(card) is card and gpus.verdict(GiB, card).gpu is card
