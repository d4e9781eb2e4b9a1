"""A rank's outcome reaches the launcher as data over its own pipe: errors rebuilt by type, nothing read back
from a shared folder, and a temp folder other users can write into without the sticky bit refused."""

import contextlib
import os
import pickle
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from commbench.errors import CommError, StoppedError, UsageError, VerificationError
from commbench.run.dist import launch
from commbench.run.outcomes import RankFailure, check_temp_dir, error_data, rebuild_error


@pytest.mark.parametrize("error", [UsageError("bad"), VerificationError("3 wrong"), CommError("rank 2 died")])
def test_commbench_errors_come_back_as_their_own_type(error):
    back = rebuild_error(error_data(error, "Traceback ..."))
    assert type(back) is type(error) and str(back) == str(error) and back.exit_code == error.exit_code


def test_a_stop_keeps_its_signal_and_a_library_error_its_type_name():
    stopped = rebuild_error(error_data(StoppedError(1, "stopped by SIGHUP"), ""))
    assert isinstance(stopped, StoppedError) and stopped.signum == 1 and stopped.exit_code == 129
    failure = rebuild_error(error_data(ImportError("no module named deep_ep"), ""))
    assert isinstance(failure, RankFailure) and failure.type_name == "ImportError"


def test_error_data_is_plain_json_values():
    data = error_data(ValueError("x" * 10**6), "t" * 10**6)
    assert {type(value) for value in data.values()} <= {str, int, list, type(None)}
    assert len(data["message"]) <= 64 * 1024 and len(data["traceback"]) <= 64 * 1024


def test_a_temp_folder_others_can_write_without_the_sticky_bit_is_refused(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UsageError, match="every user and is not sticky"):
        check_temp_dir(str(shared))
    shared.chmod(0o1777)  # /tmp's own mode: fine
    check_temp_dir(str(shared))


def _result_entry(comm):
    return {"rank": comm.rank, "values": (1, 2.5)}


def _failing_entry(comm):
    if comm.rank == 1:
        raise ImportError("a library is missing")
    comm.barrier()


def test_a_launch_returns_rank_zeros_result_and_names_a_failing_rank():
    assert launch(2, _result_entry, (), process_group="gloo", timeout_s=30) == {"rank": 0, "values": (1, 2.5)}
    with pytest.raises(RuntimeError, match="rank 1 failed with ImportError: a library is missing"):
        launch(2, _failing_entry, (), process_group="gloo", timeout_s=30)


class _Planted:
    """A pickle that, if anyone ever loaded it, would leave a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


PLANTER = """
import os, sys, time
folder, payload = sys.argv[1], bytes.fromhex(sys.argv[2])
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    for name in os.listdir(folder):
        if name.startswith("commbench"):
            path = os.path.join(folder, name)
            try:
                if os.path.isdir(path):
                    for rank in range(4):
                        with open(os.path.join(path, f"rank{rank}.pkl"), "wb") as handle:
                            handle.write(payload)
            except OSError:
                pass
    for rank in range(4):
        try:
            with open(os.path.join(folder, f"commbench-launch-x-{rank}.pkl"), "wb") as handle:
                handle.write(payload)
        except OSError:
            pass
    time.sleep(0.01)
"""


def _second_user() -> tuple[int, str] | None:
    """(uid, a python it can run) of a second user, where this test can act as one (root)."""
    if os.geteuid() != 0:
        return None
    try:
        uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return None
    for python in (sys.executable, "/usr/bin/python3"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([python, "-c", "pass"], user=uid, check=True, timeout=30, capture_output=True)
            return uid, python
    return None


SECOND = _second_user()


@pytest.mark.skipif(SECOND is None, reason="needs root and a user nobody to act as a second user")
def test_another_user_planting_pickles_in_the_temp_folder_runs_nothing(tmp_path: Path, monkeypatch):
    """Two users: while a launch runs, user nobody writes pickles that would run code into every
    commbench-* name of the shared (sticky, world-writable) temp folder; the launch returns its own result
    and nothing of theirs is ever loaded."""
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="commbench-test-shared-", dir="/tmp"))
    shared.chmod(0o1777)
    marker = tmp_path / "loaded-by-commbench"
    payload = pickle.dumps(_Planted(str(marker))).hex()
    uid, python = SECOND
    planter = subprocess.Popen(
        [python, "-c", PLANTER, str(shared), payload, "20"],
        user=uid,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        monkeypatch.setenv("TMPDIR", str(shared))
        monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
        assert launch(2, _result_entry, (), process_group="gloo", timeout_s=30)["rank"] == 0
        planted = [name for name in os.listdir(shared) if name.endswith(".pkl")]
    finally:
        planter.kill()
        planter.wait()
        shutil.rmtree(shared, ignore_errors=True)
    assert planted, "the second user planted nothing: the test proved nothing"
    assert not marker.exists()


def test_a_launch_under_a_temp_folder_others_could_swap_files_in_is_refused_first(
    tmp_path: Path, monkeypatch
):
    import tempfile

    shared = tmp_path / "open"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may rename or replace what another user put there
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(UsageError, match="not sticky"):
        launch(2, _result_entry, (), process_group="gloo", timeout_s=30)
    assert os.listdir(shared) == []


def test_an_unwritable_home_gets_one_matplotlib_folder_that_goes_with_the_launch(tmp_path: Path, monkeypatch):
    from commbench.run.processes import matplotlib_dir_for, remove_scratch

    home = tmp_path / "home"
    home.mkdir()
    assert matplotlib_dir_for("abc", {"XDG_CONFIG_HOME": str(home)}) is None  # writable: nothing to do
    assert matplotlib_dir_for("abc", {"MPLCONFIGDIR": "/somewhere"}) is None  # the user's choice
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a user whose HOME is read-only
    path = matplotlib_dir_for("abc123", {"XDG_CONFIG_HOME": str(home)})
    assert path is not None and os.path.isdir(path) and "commbench-mpl-abc123-" in path
    monkeypatch.undo()
    remove_scratch("abc123")
    assert not os.path.exists(path)
