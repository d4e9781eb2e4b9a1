"""Hardware stage: what this machine shows (probes: NVML, sysfs, libraries) and environment capture."""
