"""Who started this process (torchrun, srun or commbench's own spawn), and Slurm tasks as torchrun ranks.

torchrun gives each worker RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
MASTER_PORT, and everything that runs a rank of an external launch (``run.comm.init_comm`` with env://,
heartbeats in the c10d store, the watchdog, stop signals) reads those. A task started by ``srun`` has
Slurm's variables instead (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, the node lists and the
tasks per node), so ``adopt_slurm_task`` writes the torchrun variables from them into the environment once,
before anything else looks, and the torchrun path runs unchanged.

The rule for ``--world-size`` in a Slurm allocation (``adopt_slurm_task``):

- inside an srun step (SLURM_STEP_ID set): each task is one rank. ``--world-size`` may be left out or equal
  SLURM_NTASKS; a different one is refused when the step has several tasks (each would start its own run),
  and spawns that many local ranks when the step has one task (``srun -n 1 ... --world-size 4``);
- outside a step (the batch script itself, or an salloc shell, always task 0; or processes started with
  Slurm's task variables by hand): ``--world-size N`` in task 0 spawns N local ranks here; without it task 0
  is rank 0 of SLURM_NTASKS and says on stderr that, if it is the batch script, no other rank will join
  (the rendezvous then times out naming them); a task other than 0 is always a rank.
"""

from __future__ import annotations

import os
import re
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass

from commbench.errors import UsageError
from commbench.run.processes import LAUNCH_ID_VARIABLE

# Set by ``adopt_slurm_task``: the torchrun variables of this process were written from Slurm's.
LAUNCHER_VARIABLE = "COMMBENCH_LAUNCHER"
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# MASTER_PORT derived from the job and step ids: unprivileged and below Linux's default ephemeral range
# (32768-60999), where the kernel picks the local ports of outgoing connections.
PORT_BASE = 15000
PORT_SPAN = 15000
_NODE_LIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TASKS_PER_NODE_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_NODE_COUNT_VARIABLES = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
_STEP_ID_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASK_GROUP = re.compile(r"(\d+)(?:\(x(\d+)\))?")
_said: set[str] = set()  # the lines already printed (each once per process)


# ---------------------------------------------------------------------------------------------------------
# Slurm's compressed notations


def _split_top_level(text: str, what: str) -> list[str]:
    """Comma-separated items of ``text``, leaving commas inside [...] alone; UsageError on bad brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
        if depth not in (0, 1):
            raise UsageError(f"{what} {text!r}: unbalanced or nested brackets")
    if depth:
        raise UsageError(f"{what} {text!r}: unbalanced or nested brackets")
    items.append(text[start:])
    if any(not item.strip() for item in items):
        raise UsageError(f"{what} {text!r}: empty item")
    return [item.strip() for item in items]


def _host_parts(item: str, text: str) -> list[str | list[tuple[str, str]]]:
    """One host pattern as literal text and bracket groups, each group a list of (first, last) numbers as
    written (their width is the zero padding)."""
    parts: list[str | list[tuple[str, str]]] = []
    for index, piece in enumerate(re.split(r"[\[\]]", item)):
        if index % 2 == 0:
            if piece:
                parts.append(piece)
            continue
        group = []
        for span in piece.split(","):
            match = _RANGE.fullmatch(span.strip())
            if match is None:
                raise UsageError(f"Slurm host list {text!r}: {span!r} is not a number or a range like 01-04")
            first, last = match.group(1), match.group(2) or match.group(1)
            if int(last) < int(first):
                raise UsageError(f"Slurm host list {text!r}: range {span!r} runs backwards")
            group.append((first, last))
        parts.append(group)
    return parts


def _expand_parts(parts: list[str | list[tuple[str, str]]]) -> Iterator[str]:
    """Every host of one pattern, lazily (the first of a huge range costs nothing)."""
    if not parts:
        yield ""
        return
    head, rest = parts[0], parts[1:]
    if isinstance(head, str):
        for tail in _expand_parts(rest):
            yield head + tail
        return
    for first, last in head:
        width = len(first)  # "07-10" -> 07, 08, 09, 10; "1-10" -> 1 .. 10
        for number in range(int(first), int(last) + 1):
            for tail in _expand_parts(rest):
                yield f"{number:0{width}d}{tail}"


def expand_hostlist(text: str) -> Iterator[str]:
    """The hosts of a Slurm host list such as ``gpu-[01-04,07],login1`` or ``rack[1-2]-n[01-18]`` in Slurm's
    order (zero padding kept), lazily; UsageError for a malformed list (checked before the first host)."""
    if not text.strip():
        raise UsageError("Slurm host list is empty")
    patterns = [_host_parts(item, text) for item in _split_top_level(text.strip(), "Slurm host list")]
    for parts in patterns:
        yield from _expand_parts(parts)


def tasks_on_node(text: str, node: int) -> int:
    """Tasks on node ``node`` (0-based) from Slurm's per-node counts such as ``4(x18),2``; UsageError when
    malformed or when the list has no such node."""
    seen = 0
    for group in _split_top_level(text.strip(), "Slurm tasks per node"):
        match = _TASK_GROUP.fullmatch(group)
        if match is None:
            raise UsageError(f"Slurm tasks per node {text!r}: {group!r} is not N or N(xM)")
        count, repeats = int(match.group(1)), int(match.group(2) or 1)
        if node < seen + repeats:
            return count
        seen += repeats
    raise UsageError(f"Slurm tasks per node {text!r} lists {seen} node(s), this task is on node {node}")


def derived_port(job_id: str, step_id: str) -> int:
    """A MASTER_PORT every task of one step computes alike (crc32: the same in every process, unlike
    hash()), different for other steps and jobs sharing a node (apart from rare collisions)."""
    return PORT_BASE + zlib.crc32(f"{job_id}.{step_id}".encode()) % PORT_SPAN


# ---------------------------------------------------------------------------------------------------------
# One Slurm task


def is_slurm_task(environ: Mapping[str, str]) -> bool:
    """A Slurm task that torchrun did not start: SLURM_PROCID and SLURM_NTASKS set, RANK and WORLD_SIZE not
    (torchrun under srun gives its workers both sets; its variables win)."""
    return (
        "SLURM_PROCID" in environ
        and "SLURM_NTASKS" in environ
        and not any(name in environ for name in ("RANK", "WORLD_SIZE"))
    )


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """srun sets SLURM_STEP_ID in every task it starts; the batch script and an salloc shell have none."""
    return any(name in environ for name in _STEP_ID_VARIABLES)


def _integer(environ: Mapping[str, str], name: str, minimum: int = 0, maximum: int | None = None) -> int:
    text = environ[name].strip()
    top = (1 << 31) if maximum is None else maximum
    # ASCII digits only: str.isdigit() takes "²" and "①", which int() then refuses.
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or not minimum <= int(text) <= top:
        whose = "Slurm's " if name.startswith("SLURM_") else ""
        wanted = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise UsageError(f"{whose}{name}={environ[name]!r} is not a whole number {wanted}")
    return int(text)


def check_torchrun_env(environ: Mapping[str, str]) -> int:
    """torchrun's variables of this process checked before any rendezvous (one line, exit 2, naming the
    variable): RANK in 0..WORLD_SIZE-1, WORLD_SIZE >= 1, LOCAL_RANK below LOCAL_WORLD_SIZE, MASTER_PORT a TCP
    port, MASTER_ADDR set. Returns WORLD_SIZE."""
    world = _integer(environ, "WORLD_SIZE", 1)
    rank = _integer(environ, "RANK", 0)
    if rank >= world:
        raise UsageError(f"RANK={rank} is not below WORLD_SIZE={world}; ranks are 0..{world - 1}")
    if environ.get("LOCAL_WORLD_SIZE", "").strip():
        local_world = _integer(environ, "LOCAL_WORLD_SIZE", 1, world)
        if environ.get("LOCAL_RANK", "").strip() and _integer(environ, "LOCAL_RANK", 0) >= local_world:
            raise UsageError(
                f"LOCAL_RANK={environ['LOCAL_RANK'].strip()} is not below LOCAL_WORLD_SIZE={local_world}"
            )
    elif environ.get("LOCAL_RANK", "").strip():
        _integer(environ, "LOCAL_RANK", 0, world - 1)
    _integer(environ, "MASTER_PORT", 1, 65535)
    if not environ.get("MASTER_ADDR", "").strip():
        raise UsageError("MASTER_ADDR is empty; set it to the host of rank 0")
    return world


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name]
    return None


@dataclass(frozen=True)
class SlurmTask:
    """One Slurm task as a torchrun rank."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    master_addr: str
    master_port: int

    def torchrun_variables(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _local_world_size(environ: Mapping[str, str], world_size: int, node: int) -> int:
    """This node's task count: the per-node list at SLURM_NODEID, else SLURM_NTASKS_PER_NODE, else all
    tasks when the job has one node (or says nothing), else an even share."""
    found = _first_set(environ, _TASKS_PER_NODE_VARIABLES)
    if found is not None:
        return tasks_on_node(found[1], node)
    if environ.get("SLURM_NTASKS_PER_NODE", "").strip():
        return min(world_size, _integer(environ, "SLURM_NTASKS_PER_NODE", 1))
    counted = _first_set(environ, _NODE_COUNT_VARIABLES)
    nodes = _integer(environ, counted[0], 1) if counted is not None else 1
    if world_size % nodes:
        raise UsageError(
            f"cannot tell this node's Slurm tasks: {world_size} tasks on {nodes} nodes and no "
            "SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE; pass srun --ntasks-per-node"
        )
    return world_size // nodes


def read_slurm_task(environ: Mapping[str, str]) -> SlurmTask:
    """This task's torchrun-style place from Slurm's variables; UsageError (one line) for a value that is
    malformed or cannot work."""
    world_size = _integer(environ, "SLURM_NTASKS", 1)
    rank = _integer(environ, "SLURM_PROCID")
    if rank >= world_size:
        raise UsageError(f"Slurm's SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}")
    node = _integer(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    local_world = _local_world_size(environ, world_size, node)
    if "SLURM_LOCALID" in environ:
        local_rank = _integer(environ, "SLURM_LOCALID")
    elif local_world == world_size:  # one node: the local rank is the rank
        local_rank = rank
    else:
        raise UsageError("Slurm's SLURM_LOCALID is missing on a job of several nodes")
    if not 1 <= local_world <= world_size or local_rank >= local_world:
        raise UsageError(
            f"Slurm task {rank}: local id {local_rank} does not fit this node's {local_world} task(s) "
            f"(of {world_size})"
        )
    addr = environ.get("MASTER_ADDR", "").strip()
    if not addr:
        listed = _first_set(environ, _NODE_LIST_VARIABLES)
        if listed is not None:
            addr = next(expand_hostlist(listed[1]))
        elif local_world == world_size:
            addr = "127.0.0.1"
        else:
            raise UsageError("no Slurm node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST): set MASTER_ADDR")
        if rank == 0 and node != 0:
            raise UsageError(
                f"Slurm task 0 runs on node {node}, not on the first node of the step ({addr}) that would "
                "hold the rendezvous: set MASTER_ADDR to task 0's host, or use a block/cyclic distribution"
            )
    if environ.get("MASTER_PORT", "").strip():
        port = _integer(environ, "MASTER_PORT", 1)
        if port > 65535:
            raise UsageError(f"MASTER_PORT={port} is not a TCP port")
    else:
        step = _first_set(environ, _STEP_ID_VARIABLES)
        job = environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID", ""))
        port = derived_port(job, step[1] if step else "")
    return SlurmTask(rank, world_size, local_rank, local_world, node, addr, port)


def _say_once(line: str, say: Callable[[str], None] | None) -> None:
    if say is not None:
        say(line)
    elif line not in _said:
        print(line, file=sys.stderr, flush=True)
    _said.add(line)


def adopt_slurm_task(
    world_size: int | None,
    environ: MutableMapping[str, str] | None = None,
    say: Callable[[str], None] | None = None,
) -> SlurmTask | None:
    """In a Slurm task (``is_slurm_task``) that is one rank, write the torchrun variables into ``environ``
    (default: this process's) and return the task; None when this process is not one (not under Slurm,
    already adopted or under torchrun, or it spawns ``world_size`` local ranks: said in one line on stderr,
    or to ``say``, when the job has more than one task). UsageError for a combination that cannot work (see
    the module docstring). Calling it again changes nothing."""
    environ = os.environ if environ is None else environ
    if not is_slurm_task(environ):
        return None
    tasks = _integer(environ, "SLURM_NTASKS", 1)
    in_step = in_srun_step(environ)
    # Without SLURM_STEP_ID a task other than 0 is still a task (the batch script is always task 0): a
    # launcher that passes Slurm's task variables on, or processes started with them by hand.
    in_step = in_step or _integer(environ, "SLURM_PROCID") != 0
    if world_size is not None and (world_size != tasks or not in_step):
        if in_step and tasks > 1:
            raise UsageError(
                f"--world-size {world_size} differs from this srun step's SLURM_NTASKS={tasks}: drop "
                "--world-size (each Slurm task is one rank), or start one task (srun -n 1) to spawn "
                f"{world_size} local ranks"
            )
        if _integer(environ, "SLURM_PROCID") != 0:
            raise UsageError(
                f"--world-size {world_size} in Slurm task {environ['SLURM_PROCID']}: only task 0 may spawn "
                "local ranks"
            )
        if tasks > 1:
            where = "this srun step" if in_step else "this Slurm job (outside srun)"
            _say_once(
                f"commbench: --world-size {world_size} given in {where} of SLURM_NTASKS={tasks}: spawning "
                f"{world_size} local ranks here (for one rank per Slurm task: srun without --world-size)",
                say,
            )
        return None
    if not in_step and tasks > 1:
        # Task 0 of several without SLURM_STEP_ID: ranks started with Slurm's variables by something other
        # than srun, or the batch script itself, where no other rank will come: the rendezvous then times
        # out naming the ranks that never joined. Said now, so that the wait is not a mystery.
        _say_once(
            f"commbench: SLURM_PROCID=0 of SLURM_NTASKS={tasks} without SLURM_STEP_ID: running as rank 0 of "
            f"{tasks} Slurm tasks; if this is the batch script itself the other ranks never join: start the "
            "ranks with srun, or pass --world-size N to spawn N local ranks",
            say,
        )
    task = read_slurm_task(environ)
    environ.update(task.torchrun_variables())
    environ[LAUNCHER_VARIABLE] = "slurm"
    return task


def launcher(environ: Mapping[str, str] | None = None) -> str:
    """How this process's ranks were started, for the report: "torchrun" (torchrun's variables), "slurm"
    (srun tasks, adopted by ``adopt_slurm_task``) or "spawn" (commbench's own local ranks: a spawned rank,
    or the process that spawns them). Meaningful once ``run.comm.resolve_world_size`` has run."""
    environ = os.environ if environ is None else environ
    if LAUNCH_ID_VARIABLE in environ:
        return "spawn"
    if not all(name in environ for name in TORCHRUN_VARIABLES):
        return "spawn"
    return "slurm" if environ.get(LAUNCHER_VARIABLE) == "slurm" else "torchrun"


# ---------------------------------------------------------------------------------------------------------
# GPU binding


def external_devices_fit(local_world_size: int, device_count: int) -> bool:
    """Whether ranks started by torchrun or srun can each get a GPU: one per local rank, or exactly one
    visible to each task (``srun --gpus-per-task=1`` / CUDA_VISIBLE_DEVICES binding)."""
    return device_count >= local_world_size or device_count == 1


def rank_device(local_rank: int, local_world_size: int, device_count: int) -> int:
    """The CUDA ordinal of a rank: its local rank when the host shows a device per local rank, device 0 when
    the task sees exactly one (bound per task); UsageError otherwise."""
    if device_count >= local_world_size:
        return local_rank
    if device_count == 1:
        return 0
    raise UsageError(
        f"local rank {local_rank} of {local_world_size} sees {device_count} CUDA device(s): need one per "
        "local rank, or exactly one per task (srun --gpus-per-task=1)"
    )
