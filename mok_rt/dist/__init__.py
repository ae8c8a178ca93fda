"""Expert-parallel plumbing: process groups, symmetric memory, file-descriptor passing.

The groups are also exported at the top level (``mok.SingleProcessGroup`` ...), since every
expert-parallel user needs one; the symmetric heap and the device barrier are for those who build
their own kernels on mok_rt's runtime.
"""
from mok_rt.dist.group import CallableGroup, MPIGroup, ProcessGroup, SingleProcessGroup
from mok_rt.dist.barrier import device_barrier
from mok_rt.dist.symmetric import SymmetricHeap

__all__ = ["ProcessGroup", "SingleProcessGroup", "MPIGroup", "CallableGroup", "SymmetricHeap", "device_barrier"]
