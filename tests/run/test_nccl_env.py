"""NCCL error handling: the TORCH_NCCL_* settings chosen for a run (user values kept, timeouts ordered so that
commbench reports before torch aborts), and on GPUs, a hung NCCL collective ending as one line and exit 4."""

import os
import re
import signal
import sys
import time

import pytest
import torch

from commbench.errors import CommbenchError, CommError
from commbench.run.comm import hang_bound_s
from commbench.run.dist import launch
from commbench.run.heartbeats import exit_if_stranded
from commbench.run.nccl_env import (
    ASYNC_ERROR_HANDLING,
    BLOCKING_WAIT,
    DUMP_ON_TIMEOUT,
    HEARTBEAT_TIMEOUT,
    SETTINGS,
    WAIT_TIMEOUT_DUMP,
    applied,
    apply_nccl_error_env,
    nccl_error_env,
)
from tests.run.processes import Lines, kill_marked, new_mark, run_env, start_torchrun_style


def test_without_user_settings_a_failure_is_an_error_and_torch_kills_last():
    environ = {"PATH": "/bin"}
    chosen = nccl_error_env(environ, 10.0, hang_bound_s(10.0))
    assert environ == {"PATH": "/bin"}  # only read
    assert chosen.set_by_commbench == {
        ASYNC_ERROR_HANDLING: "2",  # abort the communicators, keep the process: the error reaches Python
        DUMP_ON_TIMEOUT: "0",
        WAIT_TIMEOUT_DUMP: "1000",
        HEARTBEAT_TIMEOUT: "480",
    }
    assert chosen.user == () and chosen.notes == () and chosen.values == chosen.set_by_commbench
    # NCCL's timeout, then commbench's watchdog, then torch's heartbeat monitor (the kill).
    assert chosen.process_group_timeout_s == 10.0 < hang_bound_s(10.0) < 480
    # A long timeout moves torch's kill past commbench's watchdog (2 x 300 + 5 s) by a minute.
    assert nccl_error_env({}, 300.0, hang_bound_s(300.0)).values[HEARTBEAT_TIMEOUT] == "665"


def test_the_users_settings_are_kept_and_the_order_still_holds():
    user = {ASYNC_ERROR_HANDLING: "3", DUMP_ON_TIMEOUT: "1", HEARTBEAT_TIMEOUT: "900"}
    chosen = nccl_error_env(user, 10.0, 25.0)
    assert chosen.set_by_commbench == {}  # nothing of theirs is overwritten; no dump wait cut under a dump
    assert chosen.values == user and set(chosen.user) == set(user)
    # Torch would end the rank at its collective timeout: that timeout moves past commbench's watchdog.
    assert chosen.process_group_timeout_s == 85.0
    assert len(chosen.notes) == 1 and "ends a rank whose collective times out" in chosen.notes[0]
    # Too short a heartbeat timeout of theirs is kept, and said.
    short = nccl_error_env({HEARTBEAT_TIMEOUT: "30"}, 10.0, 25.0)
    assert HEARTBEAT_TIMEOUT not in short.set_by_commbench and "use at least 85" in short.notes[0]
    assert short.process_group_timeout_s == 10.0


def test_torchs_older_names_count_as_the_users():
    chosen = nccl_error_env({"NCCL_ASYNC_ERROR_HANDLING": "1"}, 10.0, 25.0)
    assert ASYNC_ERROR_HANDLING not in chosen.set_by_commbench
    assert chosen.values["NCCL_ASYNC_ERROR_HANDLING"] == "1" and chosen.process_group_timeout_s == 85.0
    # Under both names torch reads the TORCH_ one.
    both = nccl_error_env({"NCCL_ASYNC_ERROR_HANDLING": "1", ASYNC_ERROR_HANDLING: "2"}, 10.0, 25.0)
    assert both.process_group_timeout_s == 10.0 and both.notes == ()


def test_blocking_wait_raises_at_the_timeout_itself():
    chosen = nccl_error_env({BLOCKING_WAIT: "1", ASYNC_ERROR_HANDLING: "3"}, 10.0, 25.0)
    assert chosen.process_group_timeout_s == 10.0  # no watchdog thread: wait() raises in the rank
    assert any("host waits" in note for note in chosen.notes)
    assert "not an integer" in nccl_error_env({ASYNC_ERROR_HANDLING: "x"}, 10.0, 25.0).notes[0]


def test_applied_settings_go_into_the_environment_and_are_recorded():
    environ = {ASYNC_ERROR_HANDLING: "0"}
    chosen = apply_nccl_error_env(10.0, 25.0, environ)
    assert environ == {ASYNC_ERROR_HANDLING: "0", **chosen.set_by_commbench}
    assert applied() is chosen
    meta = chosen.to_meta()
    assert (
        meta["values"][ASYNC_ERROR_HANDLING] == "0" and ASYNC_ERROR_HANDLING not in meta["set_by_commbench"]
    )
    assert meta["process_group_timeout_s"] == 10.0


# ----------------------------------------------------------------------------------------------------------
# On GPUs: an NCCL collective that cannot finish ends as commbench's line and exit 4, not torch's SIGABRT

TIMEOUT_S = 3.0


def env_entry(comm):
    comm.barrier()
    return {k: v for k, v in os.environ.items() if k.startswith("TORCH_NCCL_")}


def test_a_gloo_run_leaves_torchs_nccl_settings_alone(monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert launch(2, env_entry, (), process_group="gloo", timeout_s=30) == {}


@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")
def test_an_nccl_rank_gets_the_settings_before_its_group_is_made():
    settings = launch(1, env_entry, (), process_group="nccl", timeout_s=TIMEOUT_S)
    assert settings[ASYNC_ERROR_HANDLING] == "2" and settings[DUMP_ON_TIMEOUT] == "0", settings


def hung_nccl_rank_main():
    """One torchrun-style NCCL rank whose barrier cannot finish: the stream it waits on runs a spin kernel
    for two minutes, so torch's watchdog times the barrier out and the host stays blocked in C."""

    def entry(comm):
        comm.barrier()
        torch.cuda._sleep(int(240e9))  # ~2 min of GPU clock cycles on the current stream
        with comm.guard("stuck step"):
            comm.barrier()

    try:
        launch(None, entry, (), "nccl", TIMEOUT_S)
    except CommbenchError as exc:
        print(f"commbench: error: {exc}", file=sys.stderr, flush=True)
        exit_if_stranded(exc.exit_code)
        sys.exit(exc.exit_code)


@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "user", [{}, {ASYNC_ERROR_HANDLING: "3", WAIT_TIMEOUT_DUMP: "100"}], ids=["ours", "3"]
)
def test_a_hung_nccl_collective_ends_with_commbench_line_and_exit_4(tmp_path, user):
    # "3": the user keeps torch's tear-down, which would abort the rank 0.4 s after NCCL's timeout: that
    # timeout moves past commbench's watchdog, which reports first.
    mark = new_mark()
    argv = ["-c", "from tests.run.test_nccl_env import hung_nccl_rank_main; hung_nccl_rank_main()"]
    (rank,) = start_torchrun_style(argv, 1, run_env(tmp_path, mark, **user))
    stderr = Lines(rank.stderr)
    start = time.monotonic()
    try:
        code = rank.wait(90)
    finally:
        kill_marked(mark)
    assert code == 4, (code, stderr.text())  # not -SIGABRT
    last = stderr.messages()[-1]
    assert re.match(r"commbench: error: rank 0: 'stuck step > barrier' made no progress for \d+ s", last), (
        last
    )
    assert time.monotonic() - start < hang_bound_s(TIMEOUT_S) + 40


def stopping_nccl_entry(comm, victim):
    for step in range(1_000_000):
        comm.barrier()
        if step == 20 and comm.rank == victim:
            os.kill(os.getpid(), signal.SIGSTOP)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_spawned_nccl_run_names_the_rank_stopped_with_sigstop():
    with pytest.raises(CommError) as info:
        launch(2, stopping_nccl_entry, (1,), process_group="nccl", timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert re.match(r"rank 1 \(host .+, pid \d+, GPU 1\) stopped responding: process stopped", message), (
        message
    )
    assert "SIGABRT" not in message.split("stopped responding", 1)[1].split(";")[0]


def torchrun_nccl_rank_main():
    try:
        launch(None, stopping_nccl_entry, (int(os.environ["VICTIM"]),), "nccl", TIMEOUT_S)
    except CommbenchError as exc:
        print(f"commbench: error: {exc}", file=sys.stderr, flush=True)
        exit_if_stranded(exc.exit_code)
        sys.exit(exc.exit_code)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_torchrun_style_nccl_survivor_names_the_stopped_rank(tmp_path):
    mark = new_mark()
    argv = ["-c", "from tests.run.test_nccl_env import torchrun_nccl_rank_main; torchrun_nccl_rank_main()"]
    ranks = start_torchrun_style(argv, 2, run_env(tmp_path, mark, VICTIM="1"))
    stderr = Lines(ranks[0].stderr)
    try:
        code = ranks[0].wait(120)
    finally:
        kill_marked(mark)
    assert code == 4, (code, stderr.text())
    last = stderr.messages()[-1]
    assert last.startswith("commbench: error: rank 0: ") and "rank 1 (host" in last, last
