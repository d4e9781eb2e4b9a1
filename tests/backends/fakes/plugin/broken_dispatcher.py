"""A plug-in whose module does not import (a dependency that is not installed)."""

import commbench_no_such_dependency  # noqa: F401

BrokenBackend = None
