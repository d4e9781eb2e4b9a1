"""The ``commbench`` command line (click): ``main`` is the console script, ``cli`` the command group.

Modules: main (the group, one-line errors and exit codes), options (option types, options shared by several
commands), inputs (routing and size checks), launch (the one launch of run and suite), run (run, suite),
pattern, report, fabric (topo, simulate).
"""

from commbench.cli.main import cli, main

__all__ = ["cli", "main"]
