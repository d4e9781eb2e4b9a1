"""backends/shmem"""
