"""commbench: MoE dispatch/combine communication benchmark and profiler."""

__version__ = "0.1.0"
