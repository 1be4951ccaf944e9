"""The command line, run in-process through ``main([...])``, plus one real ``python -m memkit --help``."""

import dataclasses
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import memkit
from memkit.cli import main
from memkit.cli._common import report_variants
from memkit.memory.events import COLUMNS
from memkit.optimizations import Spec

PRESET = "pixart"  # the cheapest tiny preset to estimate and to compare


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A snapshot of a tracked tiny training step, and that step's timeline."""
    from memkit.memory import write_snapshot

    model = memkit.load_model(PRESET)
    inputs = memkit.make_inputs(model)
    with memkit.track(model, inputs=inputs, record_stacks=True) as timeline:
        memkit.train_step(model, inputs)
    path = tmp_path_factory.mktemp("snapshots") / "step.pickle"
    write_snapshot(timeline, path)
    return path, timeline


def test_python_m_memkit_help():
    done = subprocess.run([sys.executable, "-m", "memkit", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for command in ("estimate", "inspect", "report"):
        assert command in done.stdout


@pytest.mark.parametrize("command", ["estimate", "inspect", "report"])
def test_every_subcommand_help_has_an_example(capsys, command):
    code, out, _ = _run(capsys, command, "--help")
    assert code == 0
    assert "examples:" in out and f"memkit {command} " in out.split("examples:")[1]


# what memkit.estimate's meta says of its steps (a stand-in estimate's timeline carries it)
STEADY_META = {
    "steps": 2,
    "measured": "first and steady",
    "first_step_peak_bytes": 0,
    "steady_peak_bytes": 0,
    "bytes": "allocated",
}


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_estimate_json_peak_equals_the_library(capsys):
    code, out, err = _run(capsys, "estimate", PRESET, "--size", "tiny", "--device", "cpu", "--json")
    assert code == 0, err
    result = json.loads(out)
    timeline = memkit.estimate(
        PRESET, size="tiny", mode="training", dtype=torch.bfloat16, optimizer="adamw", device="cpu"
    )
    assert result["peak_bytes"] == timeline.peak_bytes
    assert result["baseline_bytes"] == timeline.baseline_bytes
    assert result["peak_by_category"] == timeline.peak_by_category()
    assert result["parameters"] == timeline.meta["parameters"]
    assert (result["dtype"], result["optimizer"], result["device"]) == ("bfloat16", "adamw", "cpu")


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
def test_the_fsdp_flag_is_the_registry_entry_and_its_old_options_still_work(capsys):
    fsdp = memkit.optimizations.parse("fsdp:2,bf16")
    assert fsdp == memkit.FSDP(world_size=2, mixed_precision=torch.bfloat16)
    timeline = memkit.estimate(PRESET, size="tiny", dtype=torch.float32, optimizations=[fsdp])
    unsharded = memkit.estimate(PRESET, size="tiny", dtype=torch.float32)
    for flags in (["--fsdp", "2,bf16"], ["--fsdp", "2", "--fsdp-param-dtype", "bf16"]):
        memkit.estimation.clear_cache()  # each run estimates, not a copy of the one before
        code, out, err = _run(capsys, "estimate", PRESET, "--size", "tiny", "--dtype", "fp32", "--json", *flags)
        assert code == 0, err
        result = json.loads(out)
        assert result["parallel"] == "fsdp:2,bfloat16" and result["optimizations"] == []
        assert result["peak_bytes"] == timeline.peak_bytes < unsharded.peak_bytes
        assert result["peak_by_category"] == timeline.peak_by_category()
    assert "--fsdp-param-dtype is deprecated" in err and "use --fsdp 2,bf16" in err


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
def test_estimate_fsdp_is_the_library_s_parallel_estimate(capsys):
    argv = ["estimate", "flux", "--size", "tiny", "--fsdp", "4", "--fsdp-param-dtype", "bf16", "--json"]
    code, out, err = _run(capsys, *argv, "--dtype", "fp32")
    assert code == 0, err
    result = json.loads(out)
    fsdp = memkit.FSDP(world_size=4, mixed_precision=torch.bfloat16)
    timeline = memkit.estimate("flux", size="tiny", dtype=torch.float32, optimizer="adamw", parallel=fsdp)
    assert result["parallel"] == "fsdp:4,bfloat16"
    assert result["peak_bytes"] == timeline.peak_bytes
    assert result["peak_by_category"] == timeline.peak_by_category()
    argv = ["estimate", "flux", "--size", "tiny", "--fsdp", "2", "--fsdp-keep-unsharded", "--optimizer", "none"]
    code, out, err = _run(capsys, *argv, "--fsdp-cpu-offload")
    assert code == 0, err
    # no optimizer: the peak is in backward, where every block's gathered copy is still kept
    assert "sharded: fsdp:2,keep-unsharded,cpu-offload (FSDP2)" in out and "unsharded_parameter" in out
    # the shards and their gradients in CPU memory, listed apart from the GPU's peak
    host = out[out.index("in CPU memory, off the GPU peak") :]
    assert "parameter" in host and "gradient" in host


def test_estimate_table_with_checkpointing_defaults_to_cuda(capsys):
    code, out, err = _run(capsys, "estimate", PRESET, "--size", "tiny", "--checkpointing", "all", "--unit", "B")
    assert code == 0, err
    timeline = memkit.estimate(
        PRESET,
        size="tiny",
        dtype=torch.bfloat16,
        optimizer="adamw",
        device="cuda",
        optimizations=[memkit.Checkpointing(pattern="all")],
    )
    assert "peak (B)" in out and f"{timeline.peak_bytes:,}" in out
    assert "checkpointing:all" in out and "device cuda" in out


def test_optimization_flags_come_from_the_registry_and_compose(capsys, monkeypatch):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Marker:
        level: str = "on"

        @classmethod
        def parse(cls, value):
            if value not in ("on", "high"):
                raise ValueError(f"level must be one of ['on', 'high'], got {value!r}")
            return cls(level=value)

        def apply(self, model):
            return memkit.Handle(lambda: None, name=str(self))

        def __str__(self):
            return f"marker:{self.level}"

    seen = {}

    def fake_estimate(preset, **kwargs):
        seen.update(kwargs)
        columns = {name: np.zeros(0, dtype) for name, dtype in COLUMNS}
        return memkit.Timeline(columns, meta={"dtype": "bfloat16", "parameters": 0, "seconds": 0.0, **STEADY_META})

    spec = Spec(name="marker", config=Marker, summary="a test switch", metavar="LEVEL", choices=("on", "high"))
    monkeypatch.setitem(memkit.optimizations._REGISTRY, "marker", spec)
    monkeypatch.setattr(memkit, "estimate", fake_estimate)
    code, out, err = _run(capsys, "estimate", PRESET, "--checkpointing", "all", "--marker", "high")
    assert code == 0, err
    assert [str(o) for o in seen["optimizations"]] == ["checkpointing:all", "marker:high"]
    assert "checkpointing:all, marker:high" in out
    code, out, err = _run(capsys, "estimate", PRESET, "--marker")  # the flag alone: the default choice
    assert code == 0, err
    assert [str(o) for o in seen["optimizations"]] == ["marker:on"]
    code, _, err = _run(capsys, "estimate", PRESET, "--marker", "low")
    assert code == 2 and "--marker low" in err and "['on', 'high']" in err


def test_unknown_preset_exits_2_with_the_list(capsys):
    for argv in (["estimate", "fluxx"], ["report", "fluxx"]):
        code, _, err = _run(capsys, *argv)
        assert code == 2
        assert "fluxx" in err and all(name in err for name in memkit.PRESETS)
        assert "Traceback" not in err


def test_refused_checkpointing_pattern_names_the_allowed_ones(capsys):
    code, _, err = _run(capsys, "estimate", PRESET, "--size", "tiny", "--checkpointing", "every:two")
    assert code == 2
    assert "--checkpointing every:two" in err and "'every:N', 'skip-every:N'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_checkpointing_patterns_and_providers_on_the_command_line(capsys):
    code, out, _ = _run(
        capsys, "estimate", PRESET, "--size", "tiny", "--training", "--checkpointing", "every:2@selective"
    )
    assert code == 0 and "checkpointing:every:2@selective" in out
    code, _, err = _run(capsys, "estimate", PRESET, "--size", "tiny", "--checkpointing", "all@moon")
    assert code == 2 and "provider must be one of ['torch', 'selective', 'offload']" in err


@pytest.mark.slow
def test_checkpointing_auto_fits_a_budget(capsys):
    code, out, _ = _run(capsys, "estimate", "flux", "--size", "tiny", "--checkpointing", "auto", "--budget", "1GiB")
    assert code == 0 and "checkpointing auto: checkpointing:none: 0 of 2 blocks" in out and "fits" in out
    code, out, err = _run(
        capsys, "estimate", "flux", "--size", "tiny", "--checkpointing", "auto@selective", "--budget", "1KiB", "--json"
    )
    assert code == 0 and "does NOT fit" in err
    plan = json.loads(out)["checkpoint_plan"]
    assert plan["blocks"] == 2 and plan["checkpointed"] == 2 and not plan["fits"]
    for argv, message in (
        (["--checkpointing", "auto"], "needs --budget SIZE"),
        (["--budget", "1GiB"], "--budget goes with --checkpointing auto"),
        (["--checkpointing", "auto", "--budget", "lots"], "--budget lots: a size must be"),
        (["--checkpointing", "auto@moon", "--budget", "1GiB"], "provider must be one of"),
    ):
        code, _, err = _run(capsys, "estimate", "flux", "--size", "tiny", *argv)
        assert code == 2 and message in err, (argv, err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["estimate", PRESET, "--dtype", "int8"], "invalid choice"),
        (["estimate", PRESET, "--steps", "two"], "invalid int value"),
        (["estimate", PRESET, "--training", "--inference"], "not allowed with"),
        (["estimate", "flux", "--frames", "9"], "--frames does not apply to 'flux'"),
        (["estimate", "flux", "--size", "tiny", "--height", "33"], "multiple of 16"),
        (["estimate", PRESET, "--inference", "--optimizer", "sgd"], "training only"),
        (["report", PRESET, "--size", "full"], "invalid choice"),
        (["estimate", PRESET, "--fsdp", "0"], "--fsdp 0: world_size must be an int >= 1, got 0"),
        (["estimate", PRESET, "--fsdp", "two"], "--fsdp two: world_size, the first part of the fsdp value"),
        (["estimate", PRESET, "--fsdp", "2,fast"], "--fsdp 2,fast: fsdp value '2,fast': unknown option 'fast'"),
        (["estimate", PRESET, "--fsdp-keep-unsharded"], "go with --fsdp N"),
        (["estimate", PRESET, "--fsdp-cpu-offload"], "--fsdp-cpu-offload go with --fsdp N"),
        (["estimate", PRESET, "--offload", "cpu", "--fsdp", "2"], "parallel=memkit.FSDP(..., cpu_offload=True)"),
    ],
)
def test_bad_input_exits_2(capsys, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_report_writes_one_self_contained_html(capsys, tmp_path):
    path = tmp_path / "report.html"
    code, out, err = _run(capsys, "report", PRESET, "--out", str(path), "--repeats", "0", "--quiet")
    assert code == 0, err
    page = path.read_text()
    for name in ("baseline", *report_variants()):
        assert f"<th>{name}</th>" in page
    assert page.count('class="plotly-graph-div"') == 2  # comparison and baseline timeline
    assert page.count("window.PlotlyConfig") == 1  # plotly.js inlined once
    assert "<h2>Machine</h2>" in page and torch.__version__ in page
    assert str(path) in out


def test_inspect_prints_the_tracked_peak(capsys, snapshot):
    path, timeline = snapshot
    code, out, err = _run(capsys, "inspect", str(path), "--top", "3")
    assert code == 0, err
    assert f"{timeline.peak_bytes:,} B" in out and f"{timeline.baseline_bytes:,} B" in out
    assert "top 3 allocations" in out
    code, out, err = _run(capsys, "inspect", str(path), "--json")
    summary = json.loads(out)
    assert code == 0
    assert summary["peak_bytes"] == timeline.peak_bytes
    assert summary["peak_by_category"] == timeline.peak_by_category()
    assert len(summary["top"]) == 10 and summary["top"][0]["bytes"] == timeline.top_allocations(1)[0]["bytes"]


def test_inspect_refuses_bad_snapshots_cleanly(capsys, snapshot, tmp_path):
    good = snapshot[0].read_bytes()
    files = {
        "truncated.pickle": good[: len(good) // 2],
        "garbage.pickle": b"\x00not a pickle at all" * 10,
        "other.pickle": pickle.dumps({"hello": [1, 2, 3]}),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        code, _, err = _run(capsys, "inspect", str(tmp_path / name))
        assert code == 2, name
        assert err.startswith("memkit inspect: error:") and "Traceback" not in err, name
    code, _, err = _run(capsys, "inspect", str(tmp_path / "missing.pickle"))
    assert code == 2 and "no such file" in err


def test_inspect_refuses_a_crafted_snapshot_and_runs_nothing(capsys, tmp_path):
    import os

    marker = tmp_path / "ran"

    class MakesDir:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    # dicts with the keys of a snapshot: only the refusal of the global rejects them, before anything runs
    crafted = {
        "call.pickle": {"segments": [], "device_traces": [[MakesDir()]]},
        "reference.pickle": {"segments": [], "device_traces": [], "allocator_settings": {"hook": os.mkdir}},
    }
    for name, evil in crafted.items():
        (tmp_path / name).write_bytes(pickle.dumps(evil))
        code, _, err = _run(capsys, "inspect", str(tmp_path / name))
        assert code == 2 and "Traceback" not in err, name
        assert f"refused to load the global {os.mkdir.__module__}.mkdir" in err, name
    assert not marker.exists()


def test_a_lower_bound_is_said_in_the_table_and_the_json(capsys, monkeypatch):
    def fake_estimate(preset, **kwargs):
        columns = {name: np.zeros(0, dtype) for name, dtype in COLUMNS}
        meta = {"dtype": "bfloat16", "parameters": 0, "seconds": 0.0, "lower_bound_ops": ["aten.mystery.default"]}
        meta.update(STEADY_META)
        return memkit.Timeline(columns, meta=meta)

    monkeypatch.setattr(memkit, "estimate", fake_estimate)
    code, out, err = _run(capsys, "estimate", PRESET)
    assert code == 0, err
    assert "LOWER BOUND" in out and "aten.mystery.default" in out
    code, out, err = _run(capsys, "estimate", PRESET, "--json")
    assert json.loads(out)["lower_bound_ops"] == ["aten.mystery.default"]


def _many_allocations_snapshot(path, n=6000):
    trace = [{"action": "alloc", "addr": 512 * i, "size": 512, "stream": 0, "time_us": i} for i in range(n)]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4))
    return path


def test_inspect_and_help_start_without_torch(snapshot, tmp_path):
    # reading a snapshot needs numpy alone: no torch, plotly or diffusers at start-up (estimate --help still
    # lists the registry's flags, which is where torch loads)
    code = (
        "import sys, contextlib, io\n"
        "from memkit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['inspect', {str(snapshot[0])!r}, '--top', '3']) == 0\n"
        "    assert main(['--help']) == 0 and main(['--version']) == 0 and main(['inspect', '--help']) == 0\n"
        "print(sorted(m for m in ('torch', 'plotly', 'diffusers', 'memkit.optimizations') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_estimate_help_still_lists_the_registrys_flags(capsys):
    code, out, _ = _run(capsys, "estimate", "--help")
    assert code == 0 and "--checkpointing" in out and "bf16" in out


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    path = _many_allocations_snapshot(tmp_path / "many.pickle")
    cmd = [sys.executable, "-m", "memkit", "inspect", str(path), "--top", "6000"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        proc.stdout.readline()  # `| head -1`: read a line, then go away
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert code in (0, 141)  # 141 = 128 + SIGPIPE when the pipe closed before the end


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_the_job_flags_break_the_peak_down_by_phase_and_component(capsys):
    argv = ["estimate", "flux", "--size", "tiny", "--lora", "4", "--text-encoders", "cpu", "--vae", "gpu",
            "--validate", "100:4", "--json"]  # fmt: skip
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    result = json.loads(out)
    assert list(result["peak_by_phase"]) == ["load", "training", "validation", "saving"]
    assert set(result["peak_by_component"]) == {"transformer", "text_encoder", "text_encoder_2", "vae"}
    assert result["peak_phase"] in result["peak_by_phase"]
    peak = result["peak_by_phase"][result["peak_phase"]]
    assert result["job_peak_reserved_bytes"] == peak["reserved"] >= result["peak_reserved_bytes"]
    assert result["host_peak_bytes"] >= result["peak_by_phase"]["training"]["host"] > 0  # the text encoders
    assert result["pipeline"] == "text encoders cpu, VAE gpu, validate 100:4"
    code, out, err = _run(capsys, *argv[:-1])  # the table names the phases and the job's peak
    assert code == 0, err
    assert "by phase: allocated / reserved / host" in out and "<- the job's peak" in out
    assert "text_encoder_2" in out and "host memory, the job's most" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--text-encoders", "disk"], "argument --text-encoders: invalid choice: 'disk'"),
        (["--validate", "100"], "--validate 100: validate must be EVERY:STEPS"),
        (["--inference", "--validate", "10:2"], "--validate samples during training"),
        (["--cfg", "batch"], "--cfg applies to --inference and to --validate's denoising step"),
        (["--quantize-on", "gpu"], "--quantize-on goes with --quantize METHOD"),
        (["--inference", "--precompute"], "--precompute is a phase of a training job"),
    ],
)
def test_bad_job_flags_say_what_is_allowed(capsys, flags, message):
    code, _, err = _run(capsys, "estimate", "flux", "--size", "tiny", *flags)
    assert code == 2 and message in err and "Traceback" not in err
