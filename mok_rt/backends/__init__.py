"""Backends behind the API: the CUDA megakernels and the NumPy reference.  Internal."""
