"""`commbench --help` and every `commbench <cmd> --help` import neither torch, pandas nor matplotlib."""

import subprocess
import sys

PROBE = """
import sys
from commbench.cli.main import cli
for command in sorted(cli.commands) + [""]:
    try:
        cli.main([command, "--help"] if command else ["--help"], standalone_mode=False)
    except SystemExit:
        pass
print(sorted(name for name in ("torch", "pandas", "matplotlib") if name in sys.modules))
"""


def test_help_of_every_command_loads_no_heavy_module() -> None:
    # A fresh interpreter: the test session itself has imported torch long ago.
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
