"""The symmetric-memory checks of test_symmetric_gpu.py across two GPUs (and across processes
with one GPU each).  Written to run unchanged on a two-GPU machine."""
from __future__ import annotations

import pytest
from test_symmetric_gpu import (_no_multicast, check_barrier_reuse, check_cycles, check_one_process,  # noqa: F401
                                check_timeout_names_rank, check_two_processes)

pytestmark = pytest.mark.multigpu


def test_one_process_two_gpus():
    check_one_process([0, 1])


def test_one_process_two_ranks_per_gpu():
    check_one_process([0, 1, 0, 1])


def test_barrier_is_reusable_across_gpus():
    check_barrier_reuse([0, 1])


def test_barrier_timeout_names_the_missing_rank_across_gpus():
    check_timeout_names_rank([0, 1])


def test_two_processes_one_gpu_each_full_path():
    check_two_processes([0, 1])


def test_100_create_destroy_cycles_on_two_gpus():
    check_cycles([0, 1], n=100)
