"""The learned kernel buffers are kept on disk, per torch version and CPU, so a new process does not learn again."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from memkit.memory.workspace import learned

MM = torch.ops.aten.mm.default


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A process that has learned nothing yet, with its cache folder in tmp_path; ``asked`` counts the worker's
    answers (a stand-in worker: 4096 bytes per call)."""
    monkeypatch.setenv("MEMKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(learned, "_cache", {})
    monkeypatch.setattr(learned, "_disk", None)
    monkeypatch.setattr(learned, "_disk_warned", set())
    asked = []

    def ask(op, args, kwargs, threads):
        asked.append(op)
        return 4096

    monkeypatch.setattr(learned, "_ask", ask)
    return asked


def new_process(monkeypatch):
    monkeypatch.setattr(learned, "_cache", {})
    monkeypatch.setattr(learned, "_disk", None)


def args(n=8):
    a = torch.empty(n, n, dtype=torch.bfloat16)
    return (a, a)


def test_a_new_process_reads_what_an_earlier_one_learned(fresh, monkeypatch):
    assert learned.learned_bytes(MM, args(), {}) == 4096
    assert len(fresh) == 1
    assert os.path.dirname(learned.cache_file()) == os.environ["MEMKIT_CACHE_DIR"]
    new_process(monkeypatch)
    assert learned.learned_bytes(MM, args(), {}) == 4096
    assert len(fresh) == 1  # answered from the file, no worker asked
    assert learned.learned_bytes(MM, args(16), {}) == 4096
    assert len(fresh) == 2  # another signature is learned
    with open(learned.cache_file()) as f:
        assert len(json.load(f)) == 2


def test_the_file_is_per_torch_version_and_cpu(fresh, monkeypatch):
    learned.learned_bytes(MM, args(), {})
    first = learned.cache_file()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert learned.cache_file() != first
    new_process(monkeypatch)
    learned.learned_bytes(MM, args(), {})
    assert len(fresh) == 2  # another torch: learned again


def test_the_file_is_per_cpu(fresh, monkeypatch):
    first = learned.cache_file()
    monkeypatch.setattr(learned, "_cpu_model", lambda: "another CPU")
    assert learned.cache_file() != first


def test_failures_are_not_kept_on_disk(fresh, monkeypatch):
    monkeypatch.setattr(learned, "_ask", lambda *a: None)
    assert learned.learned_bytes(MM, args(), {}) is None
    assert not os.path.exists(learned.cache_file())


def test_a_corrupt_file_is_ignored_with_a_warning(fresh, monkeypatch):
    path = learned.cache_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write('{"truncated": ')
    with pytest.warns(UserWarning, match="cannot be read"):
        assert learned.learned_bytes(MM, args(), {}) == 4096
    assert len(fresh) == 1
    new_process(monkeypatch)  # the file was rewritten whole
    assert learned.learned_bytes(MM, args(), {}) == 4096
    assert len(fresh) == 1


@pytest.mark.parametrize("content", ['["a list"]', '{"sig": "not a number"}', '{"sig": 1.5}'])
def test_a_file_of_the_wrong_shape_is_ignored(fresh, content):
    path = learned.cache_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(content)
    with pytest.warns(UserWarning, match="cannot be read"):
        assert learned.learned_bytes(MM, args(), {}) == 4096


def test_an_unwritable_folder_is_a_warning_not_an_error(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MEMKIT_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be made
    with pytest.warns(UserWarning, match="cannot be written"):
        assert learned.learned_bytes(MM, args(), {}) == 4096
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not at every answer
        assert learned.learned_bytes(MM, args(16), {}) == 4096
