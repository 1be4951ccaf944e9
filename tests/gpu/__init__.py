"""Tests against a real CUDA device (`make test-gpu`; skipped without one): a package, so that its conftest is
``gpu.conftest`` and never shadows ``tests/conftest.py``, which other test modules import as ``conftest``."""
