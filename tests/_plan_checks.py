"""The well-formedness every task plan must have (tests of the bf16 / FP8 / EP plans share it), and
the one-GPU layer sizes the plan tests walk."""
from __future__ import annotations

from mok_rt.kernels import moe_launch as L


def small_dims(T=300, H=320, I=192, Is=320, E=5, k=3, R=1280):
    return L.LayerDims(tokens=T, hidden=H, intermediate=I, top_k=k, local_experts=E, capacity_rows=R,
                       shared_intermediate=Is)


# Ragged sizes with and without a shared expert, T = 0, T = 1, and qwen3-like dimensions.
PLAN_DIMS = [small_dims(), small_dims(Is=0), small_dims(T=0), small_dims(T=1, H=256, I=128, Is=128),
             small_dims(T=4096, H=2048, I=768, Is=0, E=128, k=8, R=4096 * 8 + 128 * 128)]


def check_plan_well_formed(plan, *, targets: bool = True) -> None:
    """Phases contiguous from 0 to ``plan.total``; every wait's producer phase ends before each of
    its non-empty consumer phases begins (tasks wait only on lower indices); with ``targets``, a
    wait's target times its units is what its producer phase signals (its task count)."""
    at = 0
    for ph in plan.phases:
        assert ph.begin == at
        at = ph.end
    assert at == plan.total
    for w in plan.waits:
        prod = plan.phase(w.producer)
        for c in w.consumers:
            if prod.count and plan.phase(c).count:
                assert prod.end <= plan.phase(c).begin, (w.counter, c)
        if targets and prod.count:
            assert w.target * w.units == prod.count, w
