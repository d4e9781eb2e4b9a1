"""One-sided (NVSHMEM-style) backends: the put/signal protocol, its CPU emulator, the GPU NVSHMEM backend."""
