"""Shared pytest configuration: GPU markers skip cleanly where there is no GPU."""
from __future__ import annotations

import os

import pytest

# Never let anything a test starts create NVLink multicast objects on shared machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
# JAX would otherwise take 75% of the GPU's memory as soon as a test imports it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_count() -> int:
    try:
        import mok_rt as mok
        return mok.device_count()
    except Exception:
        return 0


GPU_COUNT = _gpu_count()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "multigpu" in item.keywords and GPU_COUNT < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and GPU_COUNT < 1:
            item.add_marker(skip_gpu)
