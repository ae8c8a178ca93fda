"""What the FP8 null-driver tests share (tests/test_fp8_forward_null_driver.py,
tests/test_fp8_backward_null_driver.py): the layer's shape, fake device inputs at distinct
addresses, and a fixture that records every prepared launch."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from null_driver import FakeDeviceArray  # noqa: E402

import mok_rt as mok  # noqa: E402
from mok_rt.runtime import launch as rlaunch  # noqa: E402

T, H, I, Is, E, K = 200, 320, 192, 128, 6, 3     # 2 token blocks (token_rows 256), Ip = 256, partial blocks
BF = ml_dtypes.bfloat16


class Inputs:
    """A layer call's inputs as fake device arrays, each on its own 4 KB-aligned address from ``base``."""

    def __init__(self, tokens=T, base=1 << 44, shared=True):
        self._next = base
        self.ids = self.new((tokens, K), np.int32)
        self.x, self.d_out = self.new((tokens, H), BF), self.new((tokens, H), BF)
        self.tw = self.new((tokens, K), np.float32)
        self.experts = mok.ExpertWeights(self.new((E, I, H), BF), self.new((E, I, H), BF), self.new((E, H, I), BF))
        self.shared = (mok.ExpertWeights(self.new((Is, H), BF), self.new((Is, H), BF), self.new((H, Is), BF))
                       if shared else None)

    def new(self, shape, dtype, *, offset=0):
        ptr = self._next + offset
        self._next += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 4096) * 4096 + 4096
        return FakeDeviceArray(shape, dtype, ptr=ptr)


@pytest.fixture
def launches(monkeypatch):
    """Every launch enqueued: (kernel name, parameter bytes)."""
    seen = []
    real = rlaunch.PreparedLaunch.__call__

    def record(self):
        p = self.params
        seen.append((self.kernel.name, ctypes.string_at(ctypes.addressof(p), ctypes.sizeof(p))))
        real(self)
    monkeypatch.setattr(rlaunch.PreparedLaunch, "__call__", record)
    return seen
