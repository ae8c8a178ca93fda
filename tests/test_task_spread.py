"""The backward kernels' grab order spreads a phase through the one before it (cuda_src/moe/pipeline/
spread.cuh: the FP8 widen through the dX tiles, the combine through the wgrad tiles, one GPU).  The
header's own code, compiled for the host, must give a permutation with the stated walk; the plans
must meet the condition that makes it valid (no spread task waits on a task it may now precede)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from _plan_checks import PLAN_DIMS

from mok_rt.kernels import moe_plan

REPO = Path(__file__).resolve().parents[1]

_MAIN = r"""
#include <cstdio>
#include <cstdlib>
#include "moe/pipeline/spread.cuh"
// argv: host_begin guest_begin guest_count stride (stride < 0: Spread::early) first last
int main(int argc, char** argv) {
  const int hb = atoi(argv[1]), gb = atoi(argv[2]), gc = atoi(argv[3]), st = atoi(argv[4]);
  const mok::pipe::Spread s = st < 0 ? mok::pipe::Spread::early(hb, gb, gc) : mok::pipe::Spread::of(hb, gb, gc, st);
  for (int t = atoi(argv[5]); t < atoi(argv[6]); ++t) printf("%d\n", s.map(t));
  return 0;
}
"""


@pytest.fixture(scope="module")
def spread_exe(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++)")
    d = tmp_path_factory.mktemp("spread")
    (d / "main.cpp").write_text(_MAIN)
    exe = d / "spread"
    res = subprocess.run([cxx, "-std=c++17", "-D__host__=", "-D__device__=", "-I", str(REPO / "cuda_src"),
                          str(d / "main.cpp"), "-o", str(exe)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return exe


def _walk(exe, hb, gb, gc, stride, first, last):
    out = subprocess.run([str(exe), *map(str, (hb, gb, gc, stride, first, last))], capture_output=True,
                         text=True, check=True).stdout
    return [int(v) for v in out.split()]


@pytest.mark.parametrize("hb,host,gc,stride", [
    (10, 64, 8, 8), (10, 65, 8, 8), (0, 43008, 256, -1), (7, 100, 3, -1), (3, 5, 9, 4), (0, 17, 1, -1),
    (5, 40, 4, 100), (0, 0, 5, 2), (4, 12, 0, 3)])
def test_spread_is_a_permutation_with_the_stated_walk(spread_exe, hb, host, gc, stride):
    gb = hb + host
    got = _walk(spread_exe, hb, gb, gc, stride, hb - 3, gb + gc + 3)
    positions = list(range(hb - 3, gb + gc + 3))
    assert sorted(got) == positions                                      # a permutation ...
    assert got[:3] == positions[:3] and got[-3:] == positions[-3:]       # ... of [hb, gb + gc) only
    inner = got[3:-3]
    hosts = [t for t in inner if t < gb]
    assert hosts == sorted(hosts) and [t for t in inner if t >= gb] == list(range(gb, gb + gc))  # each in order
    if gc == 0 or host < gc:
        assert inner == list(range(hb, gb + gc))                         # nothing to spread: plan order
        return
    want = host // (2 * gc) if stride < 0 else min(stride, host // gc)
    guest_at = [i for i, t in enumerate(inner) if t >= gb]
    if want == 0:
        assert inner == list(range(hb, gb + gc))
        return
    assert guest_at == [k * (want + 1) + want for k in range(gc)]       # one guest after every `want` hosts
    if stride < 0:   # early: at least half the host tasks come after the last guest
        assert sum(1 for t in inner[guest_at[-1]:] if t < gb) >= host - host // 2


def _waits_on(plan, consumer):
    return {w.producer for w in plan.waits if consumer in w.consumers}


@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
@pytest.mark.parametrize("d", PLAN_DIMS)
def test_backward_plans_allow_the_spreads(d, precision):
    plan = moe_plan.backward_plan(d, precision=precision)
    names = [ph.name for ph in plan.phases]
    # The combine is the last phase; its host range [wgrad_down, combine) holds only the wgrads,
    # none of which it waits on (it waits on dX: the one GPU's dx_done, the shared dX).
    comb = plan.phase("combine")
    assert comb.end == plan.total and names.index("wgrad_down") < names.index("combine")
    host = names[names.index("wgrad_down"):names.index("combine")]
    assert host == ["wgrad_down", "wgrad_gate_up", "shared_wgrad"]
    assert not _waits_on(plan, "combine") & set(host)
    if precision == "fp8_block":
        # widen follows the dX tiles directly on one GPU (dx_notify is empty), h_tiles of them per
        # widen task, and waits on nothing.
        dx, wd = plan.phase("routed_dx"), plan.phase("widen")
        assert plan.phase("dx_notify").count == 0 and dx.end == wd.begin
        assert dx.count == wd.count * plan.tiles["h_tiles"]
        assert not _waits_on(plan, "widen")
