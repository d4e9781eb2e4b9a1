"""A hung rank is named: heartbeats, the peers a failed collective waited for, the launcher's root cause for a
stopped (SIGSTOP) rank, spawned and torchrun-style; stop signals deferred while files are written."""

import datetime
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from commbench.cli.main import exit_code_and_message
from commbench.errors import CommbenchError, CommError, StoppedError
from commbench.run.dist import launch
from commbench.run.heartbeats import (
    Beat,
    BoardUnavailable,
    SharedBoard,
    StoreBoard,
    describe_peers,
    exit_if_stranded,
)
from commbench.run.launcher import launch_error
from commbench.run.liveness import KeepAlive, RankMonitor, deferred_stop
from commbench.run.processes import process_state, remove_scratch
from tests.run.processes import Lines, free_port, kill_marked, new_mark, run_env, start_torchrun_style

TIMEOUT_S = 4.0  # collective timeout of the hang tests: a stopped rank is stale long before it


def _beat(rank, age_s=0.0, activity="job 'x' dispatch > barrier", state="running", since_s=1.0):
    now = time.time()
    return Beat(rank, "h", 1000 + rank, "cpu", now - age_s, activity, now - since_s, state)


def test_peers_named_by_their_heartbeats():
    beats = {
        0: _beat(0),
        1: _beat(1, age_s=11.0, activity="job 'x' dispatch"),  # stopped 11 s ago
        2: _beat(2, state="failed", activity="job 'x' dispatch > barrier"),
        3: _beat(3, state="stopped by SIGTERM", activity="routing"),
    }
    text = describe_peers(beats, 0, 5, "job 'x' dispatch > barrier", 1.0, timed_out=True)
    # The stale rank first (what the collective waited for), then departures, a stop before a failure.
    assert text.startswith(
        "waiting for rank 1 (host h, pid 1001, cpu): last seen 11 s ago in 'job 'x' dispatch'"
    )
    assert text.index("rank 3 (host h, pid 1003, cpu) left (stopped by SIGTERM") < text.index(
        "rank 2 (host h"
    )
    assert "no heartbeat ever from rank(s) 4" in text
    # Every peer alive: after a timeout, the ones busy elsewhere are named; in the same operation, none.
    alive = {0: _beat(0), 1: _beat(1, activity="routing", since_s=30.0), 2: _beat(2)}
    text = describe_peers(alive, 0, 3, "job 'x' dispatch > barrier", 1.0, timed_out=True)
    assert text == "waiting for rank 1 (host h, pid 1001, cpu) is alive in 'routing' for 30 s"
    same = {0: _beat(0), 1: _beat(1)}
    assert describe_peers(same, 0, 2, "job 'x' dispatch > barrier", 1.0, True) == (
        "every peer is alive and in this operation"
    )
    assert describe_peers(same, 0, 2, "job 'x' dispatch > barrier", 1.0, timed_out=False) == ""
    assert Beat(2, "h", 7, "cuda:2", 0.0, "", 0.0).who() == "rank 2 (host h, pid 7, GPU 2)"


def test_beats_travel_through_shared_memory_and_a_torn_slot_is_skipped():
    import multiprocessing

    board = SharedBoard(3, multiprocessing.get_context("spawn"))
    beat = _beat(1, activity="x" * 2000)  # an operation name too long for a slot is cut, not lost
    board.publish(beat)
    board.publish(_beat(2))
    read = board.read()
    assert sorted(read) == [1, 2] and read[1].pid == beat.pid and read[1].activity.startswith("xxx")
    assert Beat.decode(beat.encode()[:40]) is None and Beat.decode(b"\0" * 8) is None


def test_store_board_reads_beats_and_names_the_store_that_does_not_answer(monkeypatch):
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
    board = StoreBoard("127.0.0.1", port, 2, bound_s=1.0)
    try:
        board.publish(_beat(1))
        board.flush(5.0)
        assert list(board.read()) == [1]  # rank 0 never published: left out, not waited for
    finally:
        board.close()
    del master
    gone = StoreBoard("127.0.0.1", free_port(), 2, bound_s=0.5)
    start = time.monotonic()
    with pytest.raises(
        BoardUnavailable, match=r"c10d store at 127.0.0.1:\d+ \(in rank 0's process\).*rank 0"
    ):
        gone.read()
    assert time.monotonic() - start < 10  # bounded, never hanging
    gone.close()
    exit_if_stranded(0)  # nothing is left running in a store call here: returns


def test_process_state_sees_a_stopped_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert process_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None
    assert process_state(os.getpid()) == "R"


def test_stopped_error_carries_its_signal_and_exit_code():
    error = pickle.loads(pickle.dumps(StoppedError(signal.SIGTERM, "rank 2: stopped by SIGTERM")))
    assert (error.signum, error.exit_code, str(error)) == (15, 143, "rank 2: stopped by SIGTERM")
    assert exit_code_and_message(StoppedError(signal.SIGHUP)) == (129, "commbench: stopped by SIGHUP")
    assert exit_code_and_message(KeyboardInterrupt())[0] == 130


def test_a_stop_signal_waits_for_the_end_of_a_deferred_block():
    before = signal.getsignal(signal.SIGTERM)
    monitor = RankMonitor.install(0)
    try:
        written = []
        with pytest.raises(StoppedError, match="^rank 0: stopped by SIGTERM$"), deferred_stop():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, and only records the signal
            written.append("row")
            os.kill(os.getpid(), signal.SIGINT)  # a second signal (Ctrl-C, then the forward) is ignored
            time.sleep(0.05)
            written.append("row")
        assert written == ["row", "row"] and monitor.signum == signal.SIGTERM
    finally:
        monitor.close()
    assert signal.getsignal(signal.SIGTERM) == before  # the handlers are restored


def test_remove_scratch_removes_only_its_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "commbench-shmem-emu-abc123-00ff").write_text("heap")
    (tmp_path / "commbench-launch-abc123-x1").mkdir()
    (tmp_path / "commbench-shmem-emu-other-00ff").write_text("another run's heap")
    remove_scratch("abc123")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commbench-shmem-emu-other-00ff"]


def test_launch_error_names_the_stopped_rank_ahead_of_the_timeouts():
    def proc(code):
        return SimpleNamespace(exitcode=code)

    timeout = CommError("rank 0: barrier timed out after 4 s waiting for rank 2 (...)")
    outcomes = {r: ("error", timeout, "") for r in (0, 1, 3)}
    liveness = {2: ("T", _beat(2, age_s=6.0)), 1: ("S", _beat(1))}
    error = launch_error([proc(1), proc(None), proc(None), proc(1)], outcomes, {1, 2}, [], 4.0, [0], liveness)
    assert str(error).startswith(
        "rank 2 (host h, pid 1002, cpu) stopped responding: process stopped by a signal"
    )
    assert "rank(s) 0, 1, 3 timed out waiting" in str(error) and "rank 1 (host" not in str(error)
    # Alive and fresh, it was only waiting too: the survivors' own error stands.
    liveness = {2: ("S", _beat(2))}
    error = launch_error([proc(1), proc(1), proc(None), proc(1)], outcomes, {2}, [], 4.0, [0], liveness)
    assert error is timeout


# ----------------------------------------------------------------------------------------------------------
# Real ranks: one stops itself with SIGSTOP in the middle of a barrier loop


def stopping_entry(comm, victim, folder):
    """Barriers until the victim stops itself; a survivor leaves its own error message in ``folder``."""
    try:
        for step in range(1_000_000):
            comm.barrier()
            if step == 20 and comm.rank == victim:
                os.kill(os.getpid(), signal.SIGSTOP)
    except CommError as exc:  # (not a StoppedError: the launcher stops a survivor that is still waiting)
        Path(folder, f"rank{comm.rank}.txt").write_text(str(exc))
        raise


def torchrun_rank_main():
    """One torchrun-style rank of the hang test (run by the test in its own process)."""
    try:
        launch(None, stopping_entry, (int(os.environ["VICTIM"]), os.environ["FOLDER"]), "gloo", TIMEOUT_S)
    except CommbenchError as exc:
        print(f"commbench: error: {exc}", file=sys.stderr, flush=True)
        exit_if_stranded(exc.exit_code)  # as the CLI does
        sys.exit(exc.exit_code)


def _waited_for(message):
    return set(map(int, re.findall(r"waiting for rank (\d+) \(", message)))


@pytest.mark.parametrize("victim", [0, 3])  # the rank that writes the report, and another (the last)
def test_spawned_run_names_the_rank_stopped_with_sigstop(tmp_path, victim):
    start = time.monotonic()
    with pytest.raises(CommError) as info:
        launch(4, stopping_entry, (victim, str(tmp_path)), process_group="gloo", timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert re.match(
        rf"rank {victim} \(host .+, pid \d+, cpu\) stopped responding: process stopped by a "
        r"signal \(state T",
        message,
    ), message
    assert "stopped responding" not in message.split(";", 1)[1]  # that rank only
    assert time.monotonic() - start < 120
    survivors = {int(p.stem[4:]): p.read_text() for p in tmp_path.glob("rank*.txt")}
    assert survivors and victim not in survivors
    for rank, text in survivors.items():  # the survivors' own messages name it too
        assert _waited_for(text) == {victim}, (rank, text)


@pytest.mark.parametrize("victim", [0, 2])
def test_torchrun_style_survivors_name_the_rank_stopped_with_sigstop(tmp_path, victim):
    mark = new_mark()
    argv = ["-c", "from tests.run.test_liveness import torchrun_rank_main; torchrun_rank_main()"]
    env = run_env(tmp_path, mark, VICTIM=str(victim), FOLDER=str(tmp_path))
    ranks = start_torchrun_style(argv, 4, env)
    stderr = [Lines(rank.stderr) for rank in ranks]
    try:
        codes = {r: ranks[r].wait(180) for r in range(4) if r != victim}
        assert process_state(ranks[victim].pid) == "T"
    finally:
        kill_marked(mark)
    assert set(codes.values()) == {4}, codes
    for rank, _ in codes.items():
        last = stderr[rank].messages()[-1]
        assert last.startswith(f"commbench: error: rank {rank}: "), last
        if victim == 0:  # rank 0 holds the c10d store: it does not answer, and the message says so
            assert "c10d store at 127.0.0.1" in last and "rank 0 is stopped, hung or unreachable" in last, (
                last
            )
        else:
            assert _waited_for(last) == {victim}, last


# ----------------------------------------------------------------------------------------------------------
# A rank no launcher watches (torchrun, Slurm) watches itself; a peer whose process is gone is named so; a
# rank torch aborted (SIGABRT) is not taken for the cause


def test_a_rank_without_a_launcher_reports_its_own_hang():
    monitor = RankMonitor.install(3)
    try:
        hung = []
        progress = [0.0] * 4
        monitor.watch_progress(0.6, 0.25, progress, on_hang=hung.append)
        monitor.interval_s = 0.05  # the thread looks every 50 ms
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # heartbeats (Comm.heartbeat) keep it quiet
            progress[3] = time.monotonic()
            time.sleep(0.05)
        with deferred_stop():  # rank 0 writing its files is not a hang
            time.sleep(1.0)
            assert hung == []
        monitor.enter("job 'x' dispatch")
        deadline = time.monotonic() + 10
        while not hung and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(hung) == 1 and isinstance(hung[0], CommError)
        assert re.fullmatch(
            r"rank 3: 'job 'x' dispatch' made no progress for \d+ s \(hang; timeout 0.25 s\)", str(hung[0])
        ), str(hung[0])
    finally:
        monitor.close()


def test_a_peer_whose_process_is_gone_is_named_as_gone():
    import multiprocessing

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    board = SharedBoard(2, multiprocessing.get_context("spawn"))
    now = time.time()
    board.publish(Beat(1, socket.gethostname(), child.pid, "cuda:1", now, "job 'x' dispatch", now))
    monitor = RankMonitor.install(0)
    try:
        monitor.attach(board, 2, "cuda:0", 1.0)
        text = monitor.peers_text(timed_out=True)
    finally:
        monitor.close()
    assert text == (
        f"rank 1 (host {socket.gethostname()}, pid {child.pid}, GPU 1) left (exited without a last "
        "heartbeat: killed or aborted, last in 'job 'x' dispatch')"
    )


def test_a_rank_torch_aborted_is_a_consequence_of_the_stopped_rank():
    def proc(code):
        return SimpleNamespace(exitcode=code)

    # Ranks 0 and 1 were aborted by torch's NCCL watchdog while waiting for rank 2, stopped with SIGSTOP.
    liveness = {2: ("T", _beat(2, age_s=6.0))}
    error = launch_error([proc(-6), proc(-6), proc(None)], {}, {2}, [], 4.0, [0], liveness)
    assert str(error).startswith("rank 2 (host h, pid 1002, cpu) stopped responding: process stopped")
    assert "rank(s) 0, 1 aborted by torch (SIGABRT) waiting" in str(error)
    # Nobody else stopped responding: the abort is the cause, and the line says where SIGABRT comes from.
    error = launch_error([proc(-6), proc(0)], {1: ("ok", None, "")}, set(), [], 4.0, [0], {})
    assert str(error).startswith("rank 0 exited with signal SIGABRT without reporting an error")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in str(error)


def hanging_entry(comm):
    comm.barrier()
    if comm.rank == 1:
        with comm.guard("stuck step"):
            time.sleep(600)  # no collective, no heartbeat: only the rank's own watchdog can end it
    comm.barrier()


def torchrun_hanging_rank_main():
    try:
        launch(None, hanging_entry, (), "gloo", 1.0)
    except CommbenchError as exc:
        print(f"commbench: error: {exc}", file=sys.stderr, flush=True)
        exit_if_stranded(exc.exit_code)
        sys.exit(exc.exit_code)


def test_torchrun_style_rank_stuck_in_its_step_reports_itself_with_exit_4(tmp_path):
    mark = new_mark()
    argv = [
        "-c",
        "from tests.run.test_liveness import torchrun_hanging_rank_main; torchrun_hanging_rank_main()",
    ]
    ranks = start_torchrun_style(argv, 2, run_env(tmp_path, mark))
    stderr = [Lines(rank.stderr) for rank in ranks]
    start = time.monotonic()
    try:
        codes = [rank.wait(60) for rank in ranks]
    finally:
        kill_marked(mark)
    assert codes == [4, 4], (codes, [s.text() for s in stderr])
    assert time.monotonic() - start < 40
    # Rank 1's own watchdog, after 2 x timeout + 5 s without progress; rank 0 timed out waiting for it.
    last = stderr[1].messages()[-1]
    assert re.match(
        r"commbench: error: rank 1: 'stuck step' made no progress for \d+ s \(hang; timeout 1 s\)", last
    )
    assert (
        stderr[0].messages()[-1].startswith("commbench: error: rank 0: barrier timed out after 1 s waiting")
    )


def test_a_long_step_beats_until_it_ends() -> None:
    """The helper thread beats while the main thread is busy (here: waiting for four beats, 30 s at most)."""
    beats: list[float] = []
    with KeepAlive(lambda: beats.append(time.monotonic()), 0.01, 60.0) as alive:
        deadline = time.monotonic() + 30
        while len(beats) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not alive.expired.is_set()
    assert len(beats) >= 6  # the first, at least four from the thread, and the step's end


def test_a_long_step_stops_beating_at_its_bound() -> None:
    """A step stuck past the bound goes quiet, so the hang watchdog still reports it, one bound later."""
    beats: list[int] = []
    with KeepAlive(lambda: beats.append(1), 0.01, 0.05) as alive:
        assert alive.expired.wait(30)
        quiet = len(beats)
        time.sleep(0.1)
        assert len(beats) == quiet
    assert len(beats) == quiet + 1  # the step's end is progress


class _CountingBoard:
    """A board that records when each beat was published (the monitor thread's wakes)."""

    def __init__(self) -> None:
        self.walls: list[float] = []

    def publish(self, beat: Beat) -> None:
        self.walls.append(time.monotonic())

    def read(self) -> dict:
        return {}

    def flush(self, bound_s: float) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_timed_window_gets_no_beat_but_its_opening_one_and_one_per_bound() -> None:
    """Inside ``quiet`` (a timed window) the heartbeat thread does not wake at its interval: one beat as the
    window opens, then none closer together than the bound; a window longer than the bound still beats (a
    peer must not see this rank as stale), and after it the interval beats resume."""
    monitor = RankMonitor.install(0)
    board = _CountingBoard()
    try:
        monitor.attach(board, 2, "cpu", 0.02)
        bound = monitor.quiet_bound_s()
        assert bound < 4 * 0.02 + 0.5  # the staleness bound (heartbeats.stale_after_s)
        time.sleep(0.1)
        with monitor.quiet():
            opened = len(board.walls)
            deadline = time.monotonic() + 30
            while len(board.walls) < opened + 2 and time.monotonic() < deadline:  # a long window
                time.sleep(0.01)
            inside = board.walls[opened - 1 :]
        assert len(inside) >= 3  # the opening beat and two bounded ones
        gaps = [later - earlier for earlier, later in zip(inside, inside[1:], strict=False)]
        assert min(gaps) >= 0.9 * bound  # a thread at its interval would beat every 0.02 s
        after = len(board.walls)
        deadline = time.monotonic() + 30
        while len(board.walls) < after + 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(board.walls) >= after + 3
    finally:
        monitor.close()


def test_a_beat_is_judged_when_the_run_ended_not_after_the_ranks_were_stopped():
    """Stopping the ranks takes seconds on a loaded host: a rank fresh at the snapshot was only waiting."""

    def proc(code):
        return SimpleNamespace(exitcode=code)

    timeout = CommError("rank 0: dispatch timed out after 3 s waiting for rank 1 (...)")
    beat = _beat(1, age_s=30.0)  # read fresh at the snapshot; 30 s old by the time the launcher judges
    liveness = {1: ("S", beat)}
    error = launch_error(
        [proc(1), proc(None)], {0: ("error", timeout, "")}, {1}, [], 3.0, [0], liveness, beat.wall
    )
    assert error is timeout
    # Judged at the same moment without the snapshot's time, that beat is stale: the rank is blamed.
    error = launch_error([proc(1), proc(None)], {0: ("error", timeout, "")}, {1}, [], 3.0, [0], liveness)
    assert "rank 1" in str(error) and "stopped responding" in str(error)


def test_a_store_that_accepted_then_went_away_is_named_as_exited():
    """Rank 0 stopped mid-read (a busy host): its store accepted the connection, never answered, and is gone
    by the time the read gives up: "has exited", not "stopped, hung or unreachable"."""
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    port = listener.getsockname()[1]
    board = StoreBoard("127.0.0.1", port, 2, bound_s=0.5)
    threading.Timer(0.3, listener.close).start()  # rank 0's process exits during the read
    with pytest.raises(BoardUnavailable, match=r"rank 0 (has exited|is gone)"):  # refused, or reset mid-read
        board.read()
    board.close()
    hung = socket.create_server(("127.0.0.1", 0))  # still listening when the read gives up: hung
    try:
        with pytest.raises(BoardUnavailable, match=r"did not answer within 0.5 s: rank 0 is stopped, hung"):
            StoreBoard("127.0.0.1", hung.getsockname()[1], 2, bound_s=0.5).read()
    finally:
        hung.close()
