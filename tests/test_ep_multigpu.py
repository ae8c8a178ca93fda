"""The expert-parallel checks of test_ep_gpu.py across two GPUs (one process driving both, and one
process per GPU).  Written to run unchanged on a two-GPU machine."""
from __future__ import annotations

import pytest
from test_ep_gpu import (REPORT, check_capacity_error_on_every_rank, check_dead_peer_in_backward,  # noqa: F401
                         check_dead_peer_times_out,
                         check_dead_peer_two_processes, check_deterministic, check_ep_against_one_rank,
                         check_mismatched_configs_raise_on_every_rank, check_one_process_matches_reference,
                         check_schedule_matches_twin, check_two_processes_match_one_process, teardown_module)

pytestmark = pytest.mark.multigpu


def test_schedule_matches_twin_across_gpus():
    check_schedule_matches_twin([0, 1], (1000, 37), 6, 3)


@pytest.mark.parametrize("case", ["e6_1000_37", "e6_shared_limit", "empty_rank", "qwen3_4096x2"])
def test_one_process_two_gpus_match_reference(case):
    check_one_process_matches_reference(case, [0, 1])


@pytest.mark.parametrize("case", ["e6_1000_37", "qwen3_4096x2"])
def test_one_process_per_gpu_matches_one_process(case):
    check_two_processes_match_one_process(case, [0, 1])


def test_two_ranks_per_gpu():
    check_one_process_matches_reference("empty_rank", [0, 1, 0, 1])


def test_deterministic_across_gpus():
    check_deterministic("e6_shared_limit", [0, 1])


def test_ep2_against_ep1_across_gpus():
    check_ep_against_one_rank("qwen3_4096x2", [0, 1])


def test_capacity_error_on_every_gpu():
    check_capacity_error_on_every_rank([0, 1])


def test_dead_peer_across_gpus():
    check_dead_peer_times_out([0, 1])
    check_dead_peer_in_backward([0, 1])
    check_dead_peer_two_processes([0, 1])


def test_mismatched_configs_across_gpus():
    check_mismatched_configs_raise_on_every_rank([0, 1])
