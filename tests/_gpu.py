"""What GPU tests need beyond a GPU, found when a test runs (never at collection).

A module-level ``pytest.importorskip("cupy")`` skipped a whole GPU module at collection, before
its ``gpu`` marker applied, so on a GPU machine without CuPy the kernel tests vanished from the
run.  Here a missing CuPy skips each test with a reason -- or, with ``MOK_RT_REQUIRE_GPU=1``,
fails it.
"""
from __future__ import annotations

import importlib
import os

import pytest

REQUIRE_ENV = "MOK_RT_REQUIRE_GPU"
CUPY_MISSING = "CuPy is not installed (pip install -e '.[test]' brings cupy-cuda13x)"


def require_gpu() -> bool:
    """Whether a GPU test that cannot run must fail instead of skipping."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def skip_or_fail(reason: str) -> None:
    if require_gpu():
        pytest.fail(f"{reason} [{REQUIRE_ENV}=1: not skipped]", pytrace=False)
    pytest.skip(reason)


def need_cupy():
    try:
        return importlib.import_module("cupy")
    except ImportError:
        skip_or_fail(CUPY_MISSING)


class _LazyCupy:
    """Stands in for the ``cupy`` module; imports it at first use, inside a test."""

    def __getattr__(self, name):
        return getattr(need_cupy(), name)


cp = _LazyCupy()
