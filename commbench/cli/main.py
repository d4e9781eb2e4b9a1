"""The ``commbench`` click group and its error handling: every error ends the command with one stderr line and
its exit code (2 bad input, 3 wrong data, 4 communication, 1 a bug, 128 + N stopped by signal N), no
traceback unless COMMBENCH_DEBUG=1.

Every input is validated before any process is launched, so bad input costs one line and exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import click

import commbench
from commbench.cli.backends import backends
from commbench.cli.compare import baseline, compare
from commbench.cli.fabric import simulate, topo
from commbench.cli.pattern import pattern
from commbench.cli.report import report
from commbench.cli.run import profile, run, suite
from commbench.errors import debug_enabled, error_line, one_line


def exit_code_and_message(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one stderr line for an error that ends the command: click's usage errors here,
    everything else by ``commbench.errors.error_line``."""
    if isinstance(exc, click.exceptions.ClickException):  # click's own usage errors (bad option, bad value)
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see '{exc.ctx.command_path} --help')"
        code = 2 if isinstance(exc, click.UsageError) else exc.exit_code
        return code, f"commbench: error: {one_line(exc.format_message())}{hint}"
    if isinstance(exc, click.exceptions.Abort):
        return error_line(KeyboardInterrupt())
    return error_line(exc)


def _exit_if_stranded(code: int) -> None:
    """A torchrun rank whose peers' store stopped answering may hold a store call that must not return
    during interpreter teardown (it would abort the process): leave at once with ``code`` then."""
    heartbeats = sys.modules.get("commbench.run.heartbeats")  # loaded only by a launch
    if heartbeats is not None:
        heartbeats.exit_if_stranded(code)
    nccl_env = sys.modules.get("commbench.run.nccl_env")
    if code == 4 and nccl_env is not None and nccl_env.applied() is not None:
        # NCCL communicators aborted after a timeout or a dead peer can block process-group teardown at exit:
        # the error line is out, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# click >= 8.2 raises this for a group called without a command; older versions print the help themselves.
_NO_ARGS_IS_HELP: type[Exception] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_Never", (Exception,), {})
)


class CommbenchGroup(click.Group):
    """A click group whose ``main`` turns every error into one stderr line and an exit code (no traceback,
    unless COMMBENCH_DEBUG=1). Living in ``main`` itself, this also holds under click's CliRunner."""

    def main(  # type: ignore[override]
        self,
        args: list[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        debug = debug_enabled()
        try:
            result = super().main(
                args=args,
                prog_name=prog_name or "commbench",
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
        except click.exceptions.Exit as exc:  # e.g. --help, --version
            result = exc.exit_code
        except _NO_ARGS_IS_HELP as exc:  # bare `commbench` (click >= 8.2): the help, not an error
            if not standalone_mode:
                raise
            click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
            result = 0
        except (Exception, KeyboardInterrupt, click.exceptions.Abort) as exc:
            if debug and not isinstance(exc, click.exceptions.ClickException):
                raise
            if not standalone_mode:
                raise
            code, message = exit_code_and_message(exc)
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
                click.echo(message, err=True)
            _exit_if_stranded(code)
            sys.exit(code)
        if not standalone_mode:
            return result
        code = result if isinstance(result, int) else 0
        _exit_if_stranded(code)
        sys.exit(code)


@click.group(
    cls=CommbenchGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.version_option(commbench.__version__, prog_name="commbench")
def cli() -> None:
    """MoE dispatch/combine communication benchmark (nccl-tests conventions: size, time, algbw, busbw,
    #wrong; GB = 1e9 bytes).

    \b
    Examples:
      commbench run --model deepseek-v3 --skew zipf:1.2 --tokens 4096 --world-size 4
      torchrun --nproc-per-node 8 -m commbench run --model deepseek-v3 --skew hot:8:0.3
      commbench run --pattern balanced --min-bytes 1K --max-bytes 64M --world-size 4
      commbench suite --world-size 4 --quick
      commbench profile --world-size 4 --skew zipf:1.2 --trace
      commbench pattern --model kimi-k2 --world-size 64 --tokens 4096 --skew zipf:1.2
      commbench report reports/20250101T000000Z
    """


for _command in (run, profile, suite, pattern, report, topo, simulate, baseline, compare, backends):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Console script: exit 0 on success, else the error's exit code and one line on stderr."""
    try:
        cli.main(args=argv, prog_name="commbench")
    except SystemExit as done:
        _leave_now_if_torch_loaded(done.code)
        raise


def _leave_now_if_torch_loaded(code: Any) -> None:
    """A process that imported torch spends ~1 s in interpreter teardown (2-core host, load 4): once
    everything is said, exit handlers run (atexit: multiprocessing's, temporary folders), stdio is flushed
    and the process leaves without that teardown. Not while another non-daemon thread runs (Python would
    wait for it), and never under click's CliRunner (it calls ``cli.main``, not this)."""
    if "torch" not in sys.modules or not isinstance(code, (int, type(None))):
        return
    import atexit
    import threading

    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)
