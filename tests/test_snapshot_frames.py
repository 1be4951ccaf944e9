"""What the snapshot reader makes of torch's stacks (``_snapshot_frames.py``): the phase the frames name, the site
(frame text) an allocation shows, and stacks told apart when torch shares its frame dicts between them.

Every snapshot here is plain data in torch's schema, read with :func:`read_snapshot`; stacks list frames
innermost first, as torch writes them. Like torch's symbolizer, one frame (file, line, name) is one dict shared
by every stack that holds it, while each trace entry has its own list.
"""

import numpy as np
import pytest

from memkit.memory import PHASES
from memkit.memory.events import ALLOC, FREE
from memkit.memory.snapshot import NO_SITE, STACK_FRAMES, read_snapshot

BASE = 0x7F00_0000_0000
_FRAMES: dict[tuple, dict] = {}


def frame(filename, name, line=1):
    """One frame dict, shared by every stack that holds it (as torch's symbolizer shares them)."""
    return _FRAMES.setdefault((filename, name, line), {"filename": filename, "line": line, "name": name})


def py(*frames):
    """Python frames from (filename, name) pairs, innermost first; line i + 1 for the i-th."""
    return [frame(f, n, i + 1) for i, (f, n) in enumerate(frames)]


def cpp(*names):
    return [frame("??", n, 0) for n in names]


def read_stacks(stacks, *, frees=False):
    """A one-device snapshot allocating once per stack (each entry its own list), freeing each with the same
    stack when ``frees``; returns the timeline and each allocation's index in it."""
    trace = []
    for i, stack in enumerate(stacks):
        trace.append({"action": "alloc", "addr": BASE + 512 * i, "size": 512, "stream": 0, "time_us": 10 * i,
                      "frames": list(stack)})  # fmt: skip
    if frees:
        for i, stack in enumerate(stacks):
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": BASE + 512 * i, "size": 512, "stream": 0,
                              "time_us": 10 * (len(stacks) + i), "frames": list(stack)})  # fmt: skip
    tl = read_snapshot({"segments": [], "device_traces": [trace]})
    allocs = np.flatnonzero(tl.column("action") == ALLOC).tolist()
    return tl, allocs


def phases(tl, rows):
    return [PHASES[tl.column("phase")[i]] for i in rows]


def sites(tl, rows):
    codes = tl.column("frame")
    return [tl.frames[codes[i]] if codes[i] >= 0 else None for i in rows]


MODULE = ("/torch/nn/modules/module.py", "_call_impl")
MAIN = ("/src/train.py", "<module>")

# (stack, the phase the reader reports): each names its phase in a different way
PHASE_CASES = {
    "diffusers' EMA step": (py(("/venv/diffusers/training_utils.py", "step"), ("/src/train.py", "main")), "ema"),
    "EMA wins over the optimizer and forward": (
        py(("/venv/diffusers/training_utils.py", "step"), ("/torch/optim/adamw.py", "adamw"), ("/src/m.py", "forward")),
        "ema",
    ),
    "another function of training_utils.py is no EMA step": (
        py(("/venv/diffusers/training_utils.py", "compute_snr"), ("/src/model.py", "forward"), MAIN),
        "forward",
    ),
    "the optimizer's own step": (py(("/torch/optim/adamw.py", "step"), ("/src/train.py", "main")), "optimizer"),
    "a Windows path to torch/optim": (
        py(("C:\\envs\\sd\\Lib\\site-packages\\torch\\optim\\adamw.py", "_single_tensor_adamw"), MAIN),
        "optimizer",
    ),
    "DeepSpeed's checkpointed backward (outside torch)": (
        py(("/src/model.py", "forward"), ("/venv/deepspeed/activation_checkpointing/checkpointing.py", "backward")),
        "backward",
    ),
    "a sampler's own 'backward' (the reverse process) outside torch": (
        py(("/src/model.py", "forward"), MODULE, ("/src/sampler.py", "backward"), MAIN),
        "forward",
    ),
    "the autograd engine's C++ frames": (
        cpp("at::_ops::mm::call(...)", "torch::autograd::Engine::thread_main(...)"),
        "backward",
    ),  # fmt: skip
    "nothing names a phase": (py(("/src/data.py", "collate"), MAIN), "other"),
}


@pytest.mark.parametrize("case", PHASE_CASES)
def test_the_phase_is_the_one_the_frames_name(case):
    stack, phase = PHASE_CASES[case]
    tl, rows = read_stacks([stack])
    assert phases(tl, rows) == [phase]
    assert tl.peak_phase == phase


def test_python_frames_are_the_site_even_below_cpp_frames_and_stdin_is_python():
    # stacks="all": C++ frames first, then Python ones; a "<stdin>" (or "<string>") file is Python code
    stack = cpp("at::native::add_out(...)", "at::_ops::add::call(...)") + py(("<stdin>", "<module>"))
    stack2 = cpp("at::native::mul_out(...)") + py(("<string>", "f"), ("/src/run.py", "main"))
    tl, rows = read_stacks([stack, stack2])
    assert sites(tl, rows) == ["<stdin>:1 <module>", "/src/run.py:2 main\n<string>:1 f"]


def test_a_native_frame_without_a_name_says_nothing_about_the_site():
    nameless = {"filename": "??", "line": 0}  # no "name" key at all
    tl, rows = read_stacks([[nameless, *cpp("execute_native_thread_routine", "start_thread", "clone")]])
    assert sites(tl, rows) == [NO_SITE]


def test_a_frame_that_is_not_a_dict_is_skipped_and_the_rest_still_read():
    stack = [None, "garbage", *py(("/src/model.py", "forward"), MAIN)]
    tl, rows = read_stacks([stack])
    assert phases(tl, rows) == ["forward"]
    assert sites(tl, rows) == ["/src/train.py:2 <module>\n/src/model.py:1 forward"]


def test_frees_in_torchs_snapshots_carry_no_site_and_add_no_frame_text():
    # torch logs a free with a stack (often its allocation's); the reader keeps sites for allocations only
    stacks = [py(("/src/a.py", "f"), MAIN), py(("/src/b.py", "g"), MAIN)]
    tl, rows = read_stacks(stacks, frees=True)
    frees = tl.column("action") == FREE
    assert frees.sum() == 2 and (tl.column("frame")[frees] == -1).all()
    assert sorted(tl.frames) == sorted(sites(tl, rows))
    assert phases(tl, np.flatnonzero(frees).tolist()) == ["other", "other"]


def test_a_torch_snapshot_has_no_ops_and_reads_into_pandas():
    tl, _ = read_stacks([py(("/src/model.py", "forward")), cpp("at::_ops::mm::call(...)")])
    assert tl.ops == [] and (tl.column("op") == -1).all()
    assert tl.to_pandas()["op"].tolist() == ["", ""]
    assert [a["op"] for a in tl.top_allocations(2)] == [None, None]


def test_one_site_is_one_frame_text_however_its_plumbing_differs():
    # the same op reached through different allocator internals: one site, one code, no duplicate text
    tail = cpp("at::_ops::mm::call(...)", "torch::autograd::Engine::thread_main(...)", "start_thread", "clone")
    a = cpp("torch::unwind::unwind()", "c10::cuda::CUDACachingAllocator::Native::malloc(...)") + tail
    b = cpp("torch::unwind::unwind()", "torch::CapturedTraceback::gather(bool, bool, bool)") + tail
    tl, rows = read_stacks([a, b, a])
    codes = tl.column("frame")[rows].tolist()
    assert codes[0] == codes[1] == codes[2] >= 0
    assert len(tl.frames) == len(set(tl.frames)) == 1


# ---- stacks told apart: torch shares frame dicts, each entry has its own list ---------------------------------
LINEAR = py(
    ("/torch/nn/functional.py", "linear"),
    ("/torch/nn/modules/linear.py", "forward"),
    MODULE,
    ("/torch/nn/modules/module.py", "_wrapped_call_impl"),
)


def test_stacks_that_differ_only_in_a_middle_frame_keep_their_own_sites():
    # the same op, from two layers: same innermost and outermost frames, same depth
    a = [*LINEAR, frame("/src/model.py", "forward", 10), frame(*MAIN, 99)]
    b = [*LINEAR, frame("/src/model.py", "forward", 20), frame(*MAIN, 99)]
    tl, rows = read_stacks([a, b] * 4)
    got = sites(tl, rows)
    assert got[0::2] == [got[0]] * 4 and got[1::2] == [got[1]] * 4
    assert "/src/model.py:10 forward" in got[0] and "/src/model.py:20 forward" in got[1]


def test_stacks_that_differ_in_the_last_frame_of_the_site_keep_their_own_sites():
    # deep stacks differing only in the outermost frame of the site text (the STACK_FRAMES-th)
    inner = [frame(f"/src/lib{i}.py", f"fn{i}", i) for i in range(STACK_FRAMES - 1)]
    outer = [frame(f"/src/outer{i}.py", f"up{i}", i) for i in range(4)]
    a = [*inner, frame("/src/caller.py", "first", 1), *outer]
    b = [*inner, frame("/src/caller.py", "second", 2), *outer]
    tl, rows = read_stacks([a, b, a, b])
    got = sites(tl, rows)
    assert got[0] == got[2] != got[1] == got[3]
    assert got[0].splitlines()[0] == "/src/caller.py:1 first" and got[1].splitlines()[0] == "/src/caller.py:2 second"


def test_stacks_all_with_deep_cpp_frames_keep_their_python_sites():
    # stacks="all": more C++ frames than a site holds come first, then Python frames that differ
    native = cpp(*(f"at::native::kernel{i}(...)" for i in range(STACK_FRAMES + 2)))
    a = [*native, *py(("/src/a.py", "f"), MAIN)]
    b = [*native, *py(("/src/b.py", "g"), MAIN)]
    tl, rows = read_stacks([a, b, a, b])
    assert sites(tl, rows) == ["/src/train.py:2 <module>\n/src/a.py:1 f", "/src/train.py:2 <module>\n/src/b.py:1 g"] * 2


ALLOCATOR = cpp(
    "torch::unwind::unwind()",
    "torch::CapturedTraceback::gather(bool, bool, bool)",
    "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)",
    "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(...)",
    "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)",
    "c10::StorageImpl::StorageImpl(...)",
    "c10::TensorImpl::TensorImpl(...)",
    "at::detail::empty_generic(...)",
    "at::native::empty_cuda(...)",
    "at::empty_strided(...)",
)


def test_cpp_only_stacks_that_differ_past_the_allocator_frames_keep_their_own_sites():
    # the autograd engine's thread records C++ only: many allocator frames, then the op that allocated
    engine = cpp("torch::autograd::Engine::thread_main(...)", "execute_native_thread_routine", "start_thread", "clone")
    mm = [*ALLOCATOR, *cpp("at::_ops::mm::call(...)"), *engine]
    addmm = [*ALLOCATOR, *cpp("at::_ops::addmm::call(...)"), *engine]
    tl, rows = read_stacks([mm, addmm, mm, addmm])
    got = sites(tl, rows)
    assert [s.splitlines()[-1] for s in got] == ["??:0 at::_ops::mm::call(...)", "??:0 at::_ops::addmm::call(...)"] * 2
    assert phases(tl, rows) == ["backward"] * 4


BLOCK = [
    *LINEAR,
    frame("/src/block.py", "forward", 5),
    frame(*MODULE, 2),
    frame("/torch/nn/modules/module.py", "_wrapped_call_impl", 2),
    frame("/src/model.py", "forward", 30),
    frame(*MODULE, 3),
]  # more frames than tell stacks apart by themselves


def test_a_checkpointed_blocks_recompute_is_backward_and_its_first_run_forward():
    # Same innermost frames, same depth. The first run starts at the script; the recompute runs in the autograd
    # engine's thread, whose Python stack starts at the checkpoint's unpack hook.
    first = [*BLOCK, frame("/src/train.py", "step", 7), frame(*MAIN, 9)]
    recompute = [*BLOCK, frame("/torch/utils/checkpoint.py", "recompute_fn", 40), frame("/torch/utils/checkpoint.py",
                                                                                      "unpack_hook", 50)]  # fmt: skip
    assert len(first) == len(recompute) > STACK_FRAMES + 1
    tl, rows = read_stacks([first, recompute, first, recompute])
    assert phases(tl, rows) == ["forward", "backward"] * 2


def test_a_recompute_on_the_calling_thread_is_backward_though_it_starts_at_the_script_too():
    # On the CPU the engine runs on the thread that called backward(): same innermost and outermost frames,
    # told apart by their depth
    first = [*BLOCK, frame("/src/train.py", "step", 7), frame(*MAIN, 9)]
    recompute = [
        *BLOCK,
        frame("/torch/utils/checkpoint.py", "recompute_fn", 40),
        frame("/torch/_tensor.py", "backward", 60),
        frame("/src/train.py", "step", 8),
        frame(*MAIN, 9),
    ]
    tl, rows = read_stacks([first, recompute, first, recompute])
    assert phases(tl, rows) == ["forward", "backward"] * 2
