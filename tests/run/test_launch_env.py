"""Slurm tasks as torchrun ranks: host lists, tasks per node, the variables written, the --world-size rule,
bad values, the launcher named for the report and the GPU a rank drives."""

import os
import re
import subprocess
import sys

import pytest
import torch

from commbench.errors import UsageError
from commbench.run import launch_env
from commbench.run.comm import check_group_devices, resolve_backend, resolve_world_size
from commbench.run.launch_env import (
    LAUNCHER_VARIABLE,
    PORT_BASE,
    PORT_SPAN,
    adopt_slurm_task,
    derived_port,
    expand_hostlist,
    launcher,
    rank_device,
    read_slurm_task,
    tasks_on_node,
)
from commbench.run.processes import LAUNCH_ID_VARIABLE

# Every variable an adoption reads or writes: cleared for each test that touches os.environ.
MANAGED = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    LAUNCHER_VARIABLE,
    LAUNCH_ID_VARIABLE,
)


def srun_task(rank: int, **extra: str) -> dict[str, str]:
    """What srun gives task ``rank`` of 8 tasks on 2 nodes (gpu-[01-02], 4 each), job 4242 step 0."""
    env = {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": str(rank % 4),
        "SLURM_NODEID": str(rank // 4),
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu-[01-02]",
        "SLURM_JOB_NODELIST": "gpu-[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
    }
    env.update(extra)
    return env


@pytest.fixture
def clean_environ(monkeypatch):
    """os.environ without any Slurm or torchrun variable; whatever a test's adoption writes is removed
    afterwards (each name is set through monkeypatch first, so that it is restored)."""
    for name in [*MANAGED, *(n for n in os.environ if n.startswith("SLURM_"))]:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setattr(launch_env, "_said", set())
    return monkeypatch


# ---------------------------------------------------------------------------------------------------------
# Slurm's notations


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("localhost", ["localhost"]),
        ("gpu-[01-04,07],login1", ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-07", "login1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a,b[3],c", ["a", "b3", "c"]),
        (" gpu-[1-2] ", ["gpu-1", "gpu-2"]),
    ],
)
def test_hostlist_expansion_keeps_order_and_zero_padding(text, hosts):
    assert list(expand_hostlist(text)) == hosts


def test_first_host_of_a_huge_range_costs_nothing():
    assert next(expand_hostlist("node[0000-9999999999],x")) == "node0000"


@pytest.mark.parametrize("text", ["", "n[1-", "n1-2]", "n[a-b]", "n[3-1]", "a,,b", "n[[1]]", "n[1,]", "n[]"])
def test_malformed_hostlist_is_a_usage_error(text):
    with pytest.raises(UsageError, match="Slurm host list"):
        next(expand_hostlist(text))


@pytest.mark.parametrize(
    ("text", "node", "tasks"),
    [
        ("4(x18),2", 0, 4),
        ("4(x18),2", 17, 4),
        ("4(x18),2", 18, 2),
        ("2,3", 1, 3),
        ("8", 0, 8),
        ("1(x2)", 1, 1),
    ],
)
def test_tasks_on_node_reads_the_compressed_form(text, node, tasks):
    assert tasks_on_node(text, node) == tasks


@pytest.mark.parametrize(("text", "node"), [("4(x18),2", 19), ("4(x)", 0), ("x", 0), ("4(x2", 0), ("", 0)])
def test_bad_tasks_per_node_is_a_usage_error(text, node):
    with pytest.raises(UsageError, match="Slurm tasks per node"):
        tasks_on_node(text, node)


def test_derived_port_is_unprivileged_per_step_and_the_same_in_every_process():
    ports = {derived_port("4242", str(step)) for step in range(20)}
    assert len(ports) >= 19  # steps of one job rarely collide
    assert all(PORT_BASE <= port < PORT_BASE + PORT_SPAN for port in ports)
    assert PORT_BASE > 1024 and PORT_BASE + PORT_SPAN <= 32768
    assert derived_port("4242", "0") != derived_port("4243", "0")
    # Another interpreter with another hash seed computes the same port (no hash() randomization).
    code = "from commbench.run.launch_env import derived_port; print(derived_port('4242', '0'))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == derived_port("4242", "0")


# ---------------------------------------------------------------------------------------------------------
# Slurm task -> torchrun variables


def test_srun_task_becomes_a_torchrun_rank():
    env = srun_task(6)
    task = adopt_slurm_task(None, env)
    assert task is not None and task.rank == 6
    assert {name: env[name] for name in MANAGED[:-1]} == {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu-01",
        "MASTER_PORT": str(derived_port("4242", "0")),
        LAUNCHER_VARIABLE: "slurm",
    }
    assert launcher(env) == "slurm"
    before = dict(env)
    assert adopt_slurm_task(None, env) is None and adopt_slurm_task(8, env) is None  # idempotent
    assert env == before


def test_every_task_of_a_step_agrees_on_the_rendezvous():
    places = [read_slurm_task(srun_task(rank)) for rank in range(8)]
    assert {(p.master_addr, p.master_port) for p in places} == {("gpu-01", derived_port("4242", "0"))}
    assert [(p.node, p.local_rank) for p in places] == [(r // 4, r % 4) for r in range(8)]


def test_users_master_addr_and_port_win():
    env = srun_task(1, MASTER_ADDR="10.0.0.7", MASTER_PORT="29511")
    adopt_slurm_task(8, env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"]) == ("10.0.0.7", "29511", "1")


def test_uneven_nodes_and_other_sources_of_the_local_count():
    # 18 nodes of 4 and one of 2: the last node's tasks have a local world of 2.
    env = srun_task(72, SLURM_NTASKS="74", SLURM_NODEID="18", SLURM_LOCALID="0")
    env["SLURM_STEP_TASKS_PER_NODE"] = "4(x18),2"
    assert read_slurm_task(env).local_world_size == 2
    # The step's list wins over the job's.
    env = srun_task(0, SLURM_TASKS_PER_NODE="8(x2)")
    assert read_slurm_task(env).local_world_size == 4
    env = {k: v for k, v in srun_task(5).items() if "TASKS_PER_NODE" not in k}
    assert read_slurm_task(dict(env, SLURM_NTASKS_PER_NODE="4")).local_world_size == 4
    assert read_slurm_task(env).local_world_size == 4  # 8 tasks on SLURM_NNODES=2
    with pytest.raises(UsageError, match="pass srun --ntasks-per-node"):
        read_slurm_task(dict(env, SLURM_NNODES="3"))
    # The bare minimum (one node): local rank = rank, the rendezvous on this host.
    task = read_slurm_task({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "3"})
    assert (task.local_rank, task.local_world_size, task.node, task.master_addr) == (1, 2, 0, "127.0.0.1")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_NTASKS": "eight"}, "SLURM_NTASKS='eight' is not a whole number"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is not a whole number >= 1"),
        ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1'"),
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not below SLURM_NTASKS=8"),
        ({"SLURM_LOCALID": "4"}, "local id 4 does not fit this node's 4 task"),
        ({"SLURM_NODEID": "2"}, "lists 2 node\\(s\\), this task is on node 2"),
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x2"}, "Slurm tasks per node"),
        ({"SLURM_STEP_NODELIST": "gpu-[02-01]"}, "runs backwards"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({"SLURM_NODEID": "1", "SLURM_PROCID": "0"}, "task 0 runs on node 1"),
    ],
)
def test_bad_slurm_values_are_one_line_usage_errors(change, message):
    with pytest.raises(UsageError, match=message) as caught:
        adopt_slurm_task(None, srun_task(5, **change))
    assert "\n" not in str(caught.value)


def test_several_nodes_without_a_node_list_or_local_id_are_refused():
    env = {k: v for k, v in srun_task(5).items() if "NODELIST" not in k}
    with pytest.raises(UsageError, match="set MASTER_ADDR"):
        read_slurm_task(env)
    assert read_slurm_task(dict(env, MASTER_ADDR="gpu-01")).master_addr == "gpu-01"
    env = {k: v for k, v in srun_task(5).items() if k != "SLURM_LOCALID"}
    with pytest.raises(UsageError, match="SLURM_LOCALID is missing"):
        read_slurm_task(env)


# ---------------------------------------------------------------------------------------------------------
# The --world-size rule


def batch_script(tasks: int) -> dict[str, str]:
    """The batch script of `sbatch -N 2 --ntasks-per-node=...`: task 0's variables, no srun step."""
    return {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": str(tasks),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": f"{tasks // 2}(x2)",
        "SLURM_JOB_NODELIST": "gpu-[01-02]",
        "SLURM_JOB_ID": "77",
    }


@pytest.mark.parametrize("world_size", [4, 8])
def test_world_size_in_a_batch_script_spawns_local_ranks_and_says_so(world_size):
    env, said = batch_script(8), []
    assert adopt_slurm_task(world_size, env, said.append) is None
    assert env == batch_script(8)  # nothing written: the launcher spawns
    assert launcher(env) == "spawn"
    assert len(said) == 1 and f"spawning {world_size} local ranks here" in said[0]
    assert "SLURM_NTASKS=8" in said[0] and "outside srun" in said[0]


def test_task_0_without_a_step_is_rank_0_and_says_the_batch_script_would_wait():
    # Processes started by hand with Slurm's task variables (no SLURM_STEP_ID) are ranks; task 0 cannot
    # tell that from the batch script itself, so it says so and runs as rank 0.
    said: list[str] = []
    task = adopt_slurm_task(None, batch_script(8), said.append)
    assert task is not None and (task.rank, task.world_size) == (0, 8)
    assert len(said) == 1 and "without SLURM_STEP_ID: running as rank 0 of 8" in said[0]
    assert "start the ranks with srun, or pass --world-size N" in said[0]
    other: list[str] = []
    env = dict(batch_script(8), SLURM_PROCID="3", SLURM_LOCALID="3")
    assert adopt_slurm_task(None, env, other.append).rank == 3 and other == []
    env = dict(batch_script(2), SLURM_NTASKS="1", SLURM_TASKS_PER_NODE="1")
    assert adopt_slurm_task(None, env).world_size == 1  # a one-task job is a world of one


def test_world_size_inside_srun_steps():
    with pytest.raises(UsageError, match="--world-size 4 differs from this srun step's SLURM_NTASKS=8"):
        adopt_slurm_task(4, srun_task(0))
    assert adopt_slurm_task(8, srun_task(0)) is not None  # equal: Slurm ranks
    # One task (srun -n 1): it spawns, silently (there is nothing else it could have meant).
    env, said = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "2"}, []
    assert adopt_slurm_task(4, env, said.append) is None and said == [] and "RANK" not in env
    with pytest.raises(UsageError, match="--world-size 4 differs from"):
        adopt_slurm_task(4, dict(batch_script(8), SLURM_PROCID="3"))


def test_torchrun_and_spawned_ranks_are_left_alone():
    env = dict(srun_task(3), RANK="9", WORLD_SIZE="16", MASTER_ADDR="h", MASTER_PORT="1")
    before = dict(env)
    assert adopt_slurm_task(None, env) is None and env == before
    assert launcher(env) == "torchrun"  # torchrun started under srun: its variables win
    assert launcher({}) == "spawn"
    assert launcher(dict(env, **{LAUNCH_ID_VARIABLE: "x"})) == "spawn"


def test_resolve_world_size_adopts_this_process_once(clean_environ, capfd):
    for name, value in srun_task(5).items():
        clean_environ.setenv(name, value)
    assert resolve_world_size(None) == 8
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]) == ("5", "1", "1")
    assert resolve_world_size(None) == 8 and resolve_world_size(8) == 8
    assert launcher() == "slurm"
    with pytest.raises(UsageError, match="differs from torchrun's WORLD_SIZE=8"):
        resolve_world_size(4)
    assert capfd.readouterr().err == ""


def test_resolve_world_size_in_a_batch_script(clean_environ, capfd):
    for name, value in batch_script(8).items():
        clean_environ.setenv(name, value)
    assert resolve_world_size(4) == 4 and resolve_world_size(4) == 4
    assert "RANK" not in os.environ and launcher() == "spawn"
    err = capfd.readouterr().err
    assert err.count("commbench: --world-size 4 given in this Slurm job") == 1, err  # said once
    assert resolve_world_size(None) == 8 and os.environ["RANK"] == "0" and launcher() == "slurm"
    assert "without SLURM_STEP_ID: running as rank 0 of 8" in capfd.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# GPU binding


@pytest.mark.parametrize(
    ("local_rank", "local_world", "devices", "device"),
    [(3, 4, 4, 3), (3, 4, 8, 3), (3, 4, 1, 0), (0, 1, 1, 0), (0, 1, 8, 0)],
)
def test_rank_device(local_rank, local_world, devices, device):
    assert rank_device(local_rank, local_world, devices) == device


@pytest.mark.parametrize(("local_rank", "local_world", "devices"), [(1, 4, 2), (3, 4, 3), (0, 1, 0)])
def test_rank_device_refuses_a_binding_that_cannot_work(local_rank, local_world, devices):
    with pytest.raises(UsageError, match=f"sees {devices} CUDA device"):
        rank_device(local_rank, local_world, devices)


def test_backend_check_follows_the_binding_rule(clean_environ):
    devices = {"count": 1}
    clean_environ.setattr(torch.cuda, "device_count", lambda: devices["count"])
    # Spawned ranks: one device each on this host.
    with pytest.raises(UsageError, match="backend nccl needs 4 CUDA device\\(s\\) on this host, found 1"):
        check_group_devices("nccl", 4, "nccl")
    # srun tasks bound to one GPU each (--gpus-per-task=1): local rank 3 drives device 0.
    for name, value in srun_task(7).items():
        clean_environ.setenv(name, value)
    resolve_world_size(None)
    assert resolve_backend("auto", 8) == ("nccl", "auto: srun with 1 local CUDA device(s) -> nccl")
    check_group_devices("nccl", 8, "nvshmem")
    devices["count"] = 2
    with pytest.raises(UsageError, match="needs 4 CUDA device.*one per local rank, or exactly 1 per task"):
        check_group_devices("nccl", 8, "nccl")
    devices["count"] = 4
    check_group_devices("nccl", 8, "nccl")


@pytest.mark.parametrize(
    ("variables", "words"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a whole number >= 1"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'"),
        (
            {"RANK": "0", "WORLD_SIZE": "\u00b2"},
            "WORLD_SIZE='\u00b2'",
        ),  # a superscript two: isdigit() says yes
        ({"RANK": "\u2460", "WORLD_SIZE": "2"}, "RANK='\u2460'"),  # a circled one
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "abc"}, "MASTER_PORT='abc'"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"},
            "MASTER_PORT='99999' is not a whole number in 1..65535",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK=2 is not below",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ],
)
def test_torchrun_variables_are_checked_before_any_rendezvous(variables, words):
    from commbench.run.launch_env import check_torchrun_env

    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **variables}
    with pytest.raises(UsageError, match=re.escape(words)):
        check_torchrun_env(environ)


def test_a_bad_torchrun_variable_is_one_line_and_exit_2_from_the_cli(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "4", "WORLD_SIZE": "4"}
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "commbench", "run", "--pattern", "balanced", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "commbench: error: RANK=4 is not below WORLD_SIZE=4; ranks are 0..3"
    ]
    assert not out.exists()
