"""Run in a subprocess by test_cpu_paths.py (after ONEDNN_MAX_CPU_ISA is set): prints one JSON line of
{case: [tracked_peak, profiler_peak, tracked_end, profiler_end, lower_bound_ops, cpu_path]}."""

import json
import sys

import torch

import memkit
from memkit.memory.workspace.cpu_path import cpu_path, modelled

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from oracles import tracked_and_profiled  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def attention(shape, dtype, threads):
    torch.set_num_threads(threads)
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

    return tracked_and_profiled(step, inputs={"q": q, "k": k, "v": v})


def train(preset, dtype):
    torch.set_num_threads(1)
    model = memkit.load_model(preset, dtype=dtype)
    inputs = memkit.make_inputs(model)
    opt = torch.optim.AdamW(model.parameters())
    memkit.train_step(model, inputs, opt)
    return tracked_and_profiled(
        lambda: memkit.train_step(model, inputs, opt), model=model, optimizer=opt, inputs=inputs
    )


def main(presets: list[str]) -> None:
    out = {}
    cases = [
        (f"attention-{s}-{d}-{t}", attention, (s, DTYPES[d], t))
        for s in ((1, 2, 72, 16), (2, 2, 300, 32), (1, 1, 800, 8))
        for d in DTYPES
        for t in (1, 2)
    ]
    cases += [(f"train-{p}-{d}", train, (p, DTYPES[d])) for p in presets for d in DTYPES]
    for name, fn, args in cases:
        tl, (peak, end) = fn(*args)
        out[name] = [
            tl.peak_bytes - tl.baseline_bytes,
            peak,
            tl.end_bytes - tl.baseline_bytes,
            end,
            tl.meta["lower_bound_ops"],
        ]
    out["_path"] = repr(cpu_path())
    out["_bf16_modelled"] = modelled("mm", torch.bfloat16) and modelled(
        "_scaled_dot_product_flash_attention_for_cpu", torch.bfloat16
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main([p for p in sys.argv[1].split(",") if p])
