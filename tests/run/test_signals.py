"""Stopping a run never leaves ranks behind: a stop signal to the launcher (SIGTERM; SIGINT to its whole
process group, as Ctrl-C sends), a SIGKILLed launcher, and SIGTERM to one torchrun-style rank (rank 0, which
writes the report, and another). Real 4-rank gloo runs of the CLI, one per behaviour: every process of the run
gone in time, no temporary folder left, the report folder whole and marked INCOMPLETE, the documented exit
code and one line saying which signal stopped the run. The three stop signals (SIGINT, SIGTERM, SIGHUP) share
one path in the launcher and in a rank: that each is caught and named is checked in-process."""

import json
import os
import signal
import subprocess
import sys
import time
from xml.etree import ElementTree

import pytest

from commbench.errors import StoppedError
from commbench.run.launcher import LauncherSignals
from commbench.run.liveness import STOP_SIGNALS, RankMonitor, deferred_stop
from tests.run.processes import (
    Lines,
    check_report_files,
    commbench_temp_left,
    kill_marked,
    marked_processes,
    new_mark,
    run_env,
    seconds_until_gone,
    start_torchrun_style,
)

# A balanced sweep whose first sizes finish in seconds and whose last ones take minutes: the signal comes
# after two rows are written, while the run is far from done.
RUN_ARGS = [
    "run", "--backend", "gloo", "--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "16M",
    "--step-factor", "4", "--iters", "300", "--warmup", "1", "--timeout", "20",
]  # fmt: skip
STARTUP_S = 240  # 4 ranks importing torch on a busy 2-core CI machine
GONE_S = {"signal": 15.0, "kill": 20.0}
# Without a launcher the peers of a stopped torchrun rank see it leave through gloo's closed connections or,
# at worst, their collective timeout (--timeout 20) naming it from its heartbeat: bounded, never a hang.
TORCHRUN_GONE_S = 45.0


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda signum: signal.Signals(signum).name)
def test_every_stop_signal_is_recorded_by_the_launcher_and_a_rank(signum):
    before = signal.getsignal(signum)
    signals = LauncherSignals().install()
    try:
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # the handler runs here: it records the signal for the watch loop, which forwards it
        assert signals.signum == signum and not signals.escalated
        os.kill(os.getpid(), signum)
        time.sleep(0.05)
        assert signals.escalated  # a second signal asks for the hard kill at once
    finally:
        signals.restore()
    assert signal.getsignal(signum) == before
    name = signal.Signals(signum).name
    monitor = RankMonitor.install(2)
    try:
        with pytest.raises(StoppedError, match=f"^rank 2: stopped by {name}$") as info, deferred_stop():
            os.kill(os.getpid(), signum)
            time.sleep(0.05)
        assert info.value.signum == signum and info.value.exit_code == 128 + signum
    finally:
        monitor.close()
    assert signal.getsignal(signum) == before


def _check_incomplete_report(out, reason):
    check_report_files(out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "incomplete", meta.get("status")
    assert reason in meta["incomplete_reason"], meta["incomplete_reason"]
    assert "INCOMPLETE" in (out / "summary.md").read_text()
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) >= 3  # the header and the two sizes that finished before the signal
    # The verdict of a stopped run is never silent: INCOMPLETE (stopped) or FAIL (a rank died), with why.
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["status"] in ("INCOMPLETE", "FAIL"), verdict["status"]
    assert verdict["run"]["state"] != "complete" and verdict["reason"]
    suites = ElementTree.parse(out / "junit.xml").getroot()
    assert suites.tag == "testsuites" and len(suites) >= 1


@pytest.mark.parametrize(
    ("how", "signum"),
    [
        ("launcher", signal.SIGTERM),  # forwarded to every rank (SIGHUP and SIGINT take the same path)
        ("group", signal.SIGINT),  # Ctrl-C in a terminal: the launcher and every rank get it
        ("launcher", signal.SIGKILL),
    ],
    ids=["sigterm", "ctrl-c-group", "sigkill"],
)
def test_a_signal_to_the_launcher_ends_every_rank_and_keeps_what_finished(tmp_path, how, signum):
    mark = new_mark()
    out = tmp_path / "report"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "commbench", *RUN_ARGS, "--world-size", "4", "--out", str(out)],
        env=run_env(tmp_path, mark),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell job has
    )
    stderr = Lines(launcher.stderr)
    try:
        assert stderr.wait_for("[2/", STARTUP_S), stderr.text(0)
        ranks = [name for name in marked_processes(mark).values() if name.startswith("commbench-r")]
        assert len(ranks) == 4, ranks  # ranks are named for ps/top
        if how == "group":
            os.killpg(launcher.pid, signum)
        else:
            launcher.send_signal(signum)
        gone_s = seconds_until_gone(mark, GONE_S["kill" if signum == signal.SIGKILL else "signal"])
        launcher.wait(30)
        print(f"{how} {signal.Signals(signum).name}: last process gone {gone_s:.2f} s after the signal")
        assert gone_s is not None, f"still running: {marked_processes(mark)}"
    finally:
        kill_marked(mark)
    assert commbench_temp_left(tmp_path) == []
    if signum == signal.SIGKILL:
        assert launcher.returncode == -signal.SIGKILL
        # The ranks noticed their launcher was gone; rank 0 still closed the report.
        _check_incomplete_report(out, "the launcher")
        return
    name = signal.Signals(signum).name
    assert launcher.returncode == 128 + signum
    messages = stderr.messages()
    assert messages[-1].startswith(f"commbench: stopped by {name}; all 4 ranks were stopped"), messages
    assert "INCOMPLETE" in messages[-1] and "Traceback" not in stderr.text()
    _check_incomplete_report(out, f"stopped by {name}")


@pytest.mark.parametrize("victim", [0, 2])
def test_sigterm_to_one_torchrun_rank_ends_it_and_its_peers_name_it(tmp_path, victim):
    mark = new_mark()
    out = tmp_path / "report"
    argv = ["-m", "commbench", *RUN_ARGS, "--out", str(out)]
    ranks = start_torchrun_style(argv, 4, run_env(tmp_path, mark))
    stderr = [Lines(rank.stderr) for rank in ranks]
    try:
        assert stderr[0].wait_for("[2/", STARTUP_S), stderr[0].text(0)
        ranks[victim].send_signal(signal.SIGTERM)
        gone_s = seconds_until_gone(mark, TORCHRUN_GONE_S)
        codes = [rank.wait(30) for rank in ranks]
        print(f"torchrun-style rank {victim} SIGTERM: last process gone {gone_s:.2f} s after the signal")
        assert gone_s is not None, f"still running: {marked_processes(mark)}"
    finally:
        kill_marked(mark)
    expected = [143 if rank == victim else 4 for rank in range(4)]
    assert codes == expected, [stderr[r].text()[-1500:] for r in range(4) if codes[r] != expected[r]]
    assert stderr[victim].messages()[-1].startswith(f"commbench: rank {victim}: stopped by SIGTERM")
    for rank in range(4):
        if rank != victim:
            last = stderr[rank].messages()[-1]
            # The departure is the dead-rank error, naming who left and why: from its last heartbeat, or, for
            # rank 0 (whose process holds the c10d store of the heartbeats), as gone with its store when the
            # survivor looks after rank 0 has exited (which comes first is a busy host's scheduling).
            assert last.startswith(f"commbench: error: rank {rank}: "), last
            named = f"rank {victim} (host " in last and "left (stopped by SIGTERM" in last
            # Its store either gone or refusing reads (a busy host sees both): rank 0 is named as gone.
            store_gone = "(in rank 0's process)" in last and (
                "rank 0 has exited" in last or "rank 0 is gone" in last
            )
            assert named or (victim == 0 and store_gone), last
    assert commbench_temp_left(tmp_path) == []
    _check_incomplete_report(out, "stopped by SIGTERM" if victim == 0 else f"rank {victim}")
