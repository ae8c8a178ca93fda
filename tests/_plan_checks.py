"""The well-formedness every task plan must have (tests of the bf16 / FP8 / EP plans share it)."""
from __future__ import annotations


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
