"""The profiler's analyses: steps and stragglers, communication kernels, overlap, the comm/compute budget."""
