"""Host side of the CUDA kernels: parameter structs, the plan, tensor maps, launches, the device schedule,
traces.  Internal."""
