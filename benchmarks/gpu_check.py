"""One-GPU check of the NCCL and NVSHMEM paths (run by benchmarks/gpu_check.sh; < 5 minutes on one H200).

Steps, each in its own process with its own timeout, each recorded (figure, or error and last stderr lines)
even when an earlier one failed:

1. environment: device, torch / Triton / NVSHMEM versions, the NVSHMEM device bitcode commbench would hand to
   torch's Triton linker, the packages commbench imports;
2. nvml dump (~2 s): everything NVML shows of the box (``commbench.hardware.nvml_dump``: every link's state,
   version and error counters, the NVLink field values per link and summed, both fabric info calls) and
   commbench's own readings of GPU 0 beside it (its GpuHealth, counter snapshots, and the preflight and
   health findings they give without a spec), written to nvml.json;
3. copy ceiling: a large device-to-device ``copy_`` timed with CUDA events; bandwidth counts bytes read +
   written (2 x size / time), the HBM figure the loopback put kernel is compared with;
4. the project's CLI at world size 1, verification on: ``commbench run`` on NCCL (deepseek-v3), then
   ``commbench suite --quick --backend nccl`` under torchrun (``python -m torch.distributed.run --standalone
   --nproc-per-node 1``; ``--no-pairwise``: the pairwise test needs two ranks);
5. the NVSHMEM set-up compile: one PE builds, launches and verifies the put / wait kernels of every knob
   setting the CLI runs below use (default, ``wait=nvshmem``, ``signal_op=set``: each a Triton
   specialization), so those runs load them from Triton's cache and a build failure shows once, here;
6. ``commbench run`` on NVSHMEM puts: default knobs, ``--backend-option wait=nvshmem``, ``signal_op=set``,
   ``--backend-option counts=device --cuda-graph 10`` (dispatch and combine, the counts exchange included,
   captured into a CUDA graph of 10 calls and replayed; only when ``commbench run --help`` lists
   ``--cuda-graph``: else SKIP with that note), and the torch
   ``all_to_all_vdev_2d`` reference variant on mixtral-8x22b in selection mode (torch's kernels take at
   most 16 experts per rank; deepseek-v3 has 256 at world 1). A set-up compile that timed out skips them
   (they would hang the same way); one that failed leaves them to record their own errors, on shorter
   timeouts;
7. loopback put kernel: a child process as PE 0 of a one-rank job puts deepseek-v3 dispatch rows to itself;
   dispatch and combine are verified, then the put kernel alone is launched back to back under CUDA events
   for a few (num_blocks, chunk_bytes) settings; bandwidth = 2 x bytes / time (read + write, as the copy),
   reported as % of the copy ceiling (target >= 85 %). The child saves its figures after every setting.

Every CLI step keeps its figures (results.json), its verdict and its FAIL / WARN findings (verdict.json):
a verdict FAIL (a preflight finding, say) fails the step but is not wrong data; "verification" is the
#wrong figures alone. NVSHMEM can end a process with abort() or a segfault instead of an exception, so this
parent process never touches the GPU: a step that dies is recorded with its exit code or signal and its last
stderr lines, and gpu_check.json, gpu_check.csv and measurements.md (a section for docs/measurements.md) are
rewritten atomically under --out after every step, so what finished before survives an abort, a hang
(killed at the step's timeout) and gpu_check.sh's overall limit (SIGTERM: the step running then is recorded
as stopped). A step that would start with less time left than it needs is recorded as SKIP (out of time
budget); the loopback step's time is kept in reserve. cli_runs.log keeps the CLI runs' output; 6 files in
all with gpu_check.sh's log (the device tool returns at most 8); the CLI report folders and the steps'
result files go to a temporary folder. Prints a short table last. Exit 0 when every step passed (or was
skipped) and verification was clean, 1 otherwise, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import datetime
import importlib
import importlib.metadata
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

TARGET_PERCENT = 85.0
BUDGET_S = 265.0  # whole check; gpu_check.sh kills it at 285 s
LOOPBACK_RESERVE_S = 75.0  # kept for the loopback step when the CLI steps run long
TAIL_LINES = 12  # stderr lines kept for a step that failed
REPO = Path(__file__).resolve().parent.parent
RESULT_ENV = "GPU_CHECK_RESULT"  # where a step's process writes its result (JSON)


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_atomic(path: Path, text: str) -> None:
    """Whole file or nothing: a reader (or a kill mid-write) never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def exit_description(code: int | None) -> tuple[str, str | None]:
    """("exit 1", None) or ("killed by SIGABRT", "SIGABRT") for a subprocess return code."""
    if code is None:
        return "still running", None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}", name
    return f"exit {code}", None


class Stopped(Exception):
    """SIGTERM / SIGINT to this script (gpu_check.sh's overall time limit): stop, record, write."""


class Check:
    """The steps run so far, and the files written after each one."""

    def __init__(self, out: Path, work: Path | None = None) -> None:
        self.out = out
        self.work = work or Path(tempfile.mkdtemp(prefix="commbench-gpu-check-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.steps: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def remaining(self, reserve: float = 0.0) -> float:
        return BUDGET_S - (time.monotonic() - self.started) - reserve

    def record(self, entry: dict[str, Any]) -> dict[str, Any]:
        self.steps.append(entry)
        print(f"[gpu_check] {entry['step']}: {entry['status']} ({entry.get('seconds', 0)} s)", flush=True)
        write_outputs(self, self.out)
        return entry

    def _skipped(self, name: str, needs_s: float) -> dict[str, Any] | None:
        if self.remaining() >= needs_s:
            print(f"[gpu_check] {name} ...", flush=True)
            return None
        return self.record({"step": name, "status": "SKIP", "seconds": 0.0, "error": "out of time budget"})

    def step(self, name: str, fn: Any, needs_s: float = 10.0) -> dict[str, Any]:
        """A step run in this process (one that only starts processes of its own, as ``cli_run``)."""
        skipped = self._skipped(name, needs_s)
        if skipped:
            return skipped
        began = time.monotonic()
        try:
            result = fn() or {}
            status = result.pop("status", "ok")
        except Stopped:
            self.record({"step": name, "status": "FAIL", "error": "stopped by SIGTERM (overall time limit)"})
            raise
        except Exception as exc:  # noqa: BLE001 - every step is recorded, the check goes on
            traceback.print_exc()
            result, status = {"error": _one_line(exc)}, "FAIL"
        return self.record({"step": name, "status": status, "seconds": _since(began), **result})

    def isolated(
        self, name: str, step: str, kwargs: dict[str, Any], timeout_s: float, needs_s: float = 10.0
    ) -> dict[str, Any]:
        """A GPU step of this file (``STEPS``) in a process of its own: ``process_step`` of its command."""
        command = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--child", step]
        return self.process_step(name, [*command, "--child-kwargs", json.dumps(kwargs)], timeout_s, needs_s)

    def process_step(
        self, name: str, command: list[str], timeout_s: float, needs_s: float = 10.0
    ) -> dict[str, Any]:
        """Run ``command`` as step ``name``: it writes its result (a JSON object) to the file named by
        $GPU_CHECK_RESULT, as often as it likes. Whatever it wrote last is kept; a non-zero exit, a signal
        or the timeout makes the step FAIL with that and the last stderr lines."""
        skipped = self._skipped(name, needs_s)
        if skipped:
            return skipped
        began = time.monotonic()
        result_path = self.work / f"step{len(self.steps)}.json"
        result_path.unlink(missing_ok=True)
        process = _start(command, {RESULT_ENV: str(result_path)}, stderr=subprocess.PIPE)
        tails = {kind: collections.deque(maxlen=TAIL_LINES) for kind in ("stdout", "stderr")}
        readers = [
            threading.Thread(target=_forward, args=(stream, sink, tails[kind]), daemon=True)
            for kind, stream, sink in (
                ("stdout", process.stdout, sys.stdout),
                ("stderr", process.stderr, sys.stderr),
            )
        ]
        for reader in readers:
            reader.start()
        problem = None
        try:
            process.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            problem = f"timed out after {timeout_s:g} s (killed)"
        except Stopped:
            problem = "stopped by SIGTERM (overall time limit)"
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            for reader in readers:
                reader.join(timeout=5)
        result = _read_result(result_path)
        how, signal_name = exit_description(process.returncode)
        entry: dict[str, Any] = {"step": name, "status": result.pop("status", "ok"), "seconds": _since(began)}
        entry.update(result)
        entry["exit_code"] = process.returncode
        if signal_name:
            entry["signal"] = signal_name
        if problem or process.returncode != 0 or not result_path.exists():
            entry["status"] = "FAIL"
            tail = list(tails["stderr"]) or list(tails["stdout"])
            entry["stderr_tail"] = tail
            cause = problem or (how if result_path.exists() else f"{how} before writing a result")
            last = tail[-1].strip() if tail else ""
            entry["error"] = "; ".join(x for x in (cause, entry.get("error") or last) if x)[:300]
        self.record(entry)
        if problem and problem.startswith("stopped"):
            raise Stopped()
        return entry


def _since(began: float) -> float:
    return round(time.monotonic() - began, 1)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def _forward(stream: io.TextIOBase, sink: Any, tail: collections.deque) -> None:
    """Copy a step's output into this process's (gpu_check.log) line by line, keeping the last lines."""
    for line in iter(stream.readline, ""):
        tail.append(line.rstrip("\n"))
        with contextlib.suppress(ValueError, OSError):
            sink.write(line)
            sink.flush()


def _read_result(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


# ----------------------------------------------------------------------------------------------------------
# The GPU steps (run in a child process: ``gpu_check.py --child NAME``).


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "nvshmem": _version("nvidia-nvshmem-cu13") or _version("nvidia-nvshmem-cu12"),
    }
    missing = []
    for module in ("numpy", "pandas", "click", "pyarrow", "matplotlib", "yaml", "pynvml", "commbench.cli"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            missing.append(f"{module} ({type(exc).__name__})")
    info["missing_imports"] = missing
    try:
        import torch.distributed._symmetric_memory as symm_mem

        from commbench.backends.shmem import bitcode
        from commbench.backends.shmem.symmetric import MIN_TORCH, torch_release

        release = torch_release(str(torch.__version__))
        info["torch_supported"] = release is None or release >= MIN_TORCH
        info["torch_nvshmem_available"] = bool(symm_mem.is_nvshmem_available())
        info["has_all_to_all_vdev_2d"] = hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d")
        info["NVSHMEM_LIB_DIR"] = os.environ.get("NVSHMEM_LIB_DIR")
        found = bitcode.find_device_bitcode(
            bitcode.candidate_dirs(), lambda: torch.cuda.get_device_capability()
        )
        info["nvshmem_device_bitcode"] = os.path.realpath(found) if found else None
    except Exception as exc:  # noqa: BLE001
        info["torch_nvshmem_available"] = f"error: {exc}"
    try:  # last, and apart: the versions above are recorded even when the GPU is unusable
        info["device"] = torch.cuda.get_device_name(0)
        info["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # noqa: BLE001
        info["error"] = f"no usable GPU: {_one_line(exc)}"
    if missing or info.get("torch_supported") is False or "error" in info:
        info["status"] = "FAIL"
    return info


def copy_ceiling(size_bytes: int = 2 << 30, reps: int = 20) -> dict[str, Any]:
    import torch

    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    ok = bool(torch.equal(dst[:: 1 << 20], src[:: 1 << 20]))
    return {
        "bytes": size_bytes,
        "time_us": round(seconds * 1e6, 1),
        "copy_GBps": round(2 * size_bytes / seconds / 1e9, 1),
        "status": "ok" if ok else "FAIL",
    }


def _one_rank_comm(timeout_s: float) -> Any:
    from commbench.run.dist import free_port, init_comm

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    return init_comm("nccl", timeout_s)


def loopback(
    tokens: int, configs: list[dict[str, Any]], launches: int, progress: Any = None
) -> dict[str, Any]:
    """PE 0 puts deepseek-v3 dispatch rows to itself: verification, then the put kernel's bandwidth.

    ``launches`` 0: the set-up compile (each setting's Triton kernels built into Triton's cache, launched
    and verified, not timed). ``progress(result)`` after every setting: what was measured survives an
    abort in a later one."""
    import torch

    from commbench.backends.shmem.nvshmem import NvshmemBackend
    from commbench.inputs.models import load_model
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.payload import (
        count_wrong_combine,
        count_wrong_rows,
        decode_header,
        encode_rows,
        expected_combine,
        expected_rows,
        expert_outputs,
        received_keys,
    )
    from commbench.traffic.plan import plan_rank
    from commbench.traffic.routing import RoutingConfig, route_rank

    comm = _one_rank_comm(20.0)  # also the signal-wait timeout: a broken kernel fails, it does not hang
    model = load_model("deepseek-v3")
    cfg = RoutingConfig(model=model, skew=parse_skew("uniform"), world_size=1, tokens_per_rank=tokens, seed=0)
    host_plan = plan_rank(route_rank(cfg, 0), model, 1, "token")
    plan = host_plan.to(comm.device)
    tokens_rows = encode_rows(0, torch.arange(plan.num_tokens, device=comm.device), plan.dispatch_row_bytes)
    moved = plan.num_send_rows * plan.dispatch_row_bytes
    result: dict[str, Any] = {
        "tokens": tokens,
        "rows": plan.num_send_rows,
        "dispatch_bytes": moved,
        "configs": [],
        "wrong_total": 0,
    }
    for options in configs:
        print(f"[gpu_check]   loopback {options or 'default knobs'} ...", flush=True)
        entry: dict[str, Any] = {**options, "error": "did not finish"}
        backend = NvshmemBackend(comm, options)
        try:
            backend.setup(plan)
            counts = backend.exchange_counts(plan.send_counts)
            received = backend.dispatch(tokens_rows, plan, counts)
            backend.synchronize()
            wrong_dispatch = count_wrong_rows(received, expected_rows([host_plan], 0, comm.device))
            src, token = decode_header(received)
            expert_out = expert_outputs(src, token, received_keys(counts, 0, "token"), model.hidden)
            combined = backend.combine(expert_out, plan, counts)
            backend.synchronize()
            reference, tolerance = expected_combine(plan, model.hidden)
            wrong_combine = count_wrong_combine(combined, reference, tolerance)
            result["wrong_total"] += wrong_dispatch + wrong_combine
            entry = {**backend.knobs(), "dispatch_wrong": wrong_dispatch, "combine_wrong": wrong_combine}
            if not launches:  # the set-up compile: built, launched and verified, not timed
                continue
            layout = backend._phases["dispatch"]
            epoch = backend._trackers["dispatch"].epoch
            for _ in range(3):
                backend.launch_puts("dispatch", layout, plan.dispatch_row_bytes, epoch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(launches):
                backend.launch_puts("dispatch", layout, plan.dispatch_row_bytes, epoch)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / launches
            entry["kernel_us"] = round(seconds * 1e6, 1)
            entry["kernel_GBps"] = round(2 * moved / seconds / 1e9, 1)
        except Exception as exc:  # noqa: BLE001 - one failing config must not hide the others
            traceback.print_exc()
            entry = {**options, "error": _one_line(exc)}
        finally:
            backend.close()
            print(f"[gpu_check]   loopback {entry}", flush=True)
            result["configs"].append(entry)
            _loopback_summary(result, len(configs), timed=launches > 0)
            if progress is not None:
                progress(result)
    return result


def _loopback_summary(result: dict[str, Any], planned: int, timed: bool = True) -> None:
    """``default`` / ``best`` of the timed settings; ok when every planned setting ran (and was timed,
    unless this is the set-up compile) with nothing wrong."""
    finished = [c for c in result["configs"] if ("kernel_GBps" in c if timed else "error" not in c)]
    if timed and finished:
        result["default"] = finished[0]
        result["best"] = max(finished, key=lambda c: c["kernel_GBps"])
    done = len(finished) == planned and result["wrong_total"] == 0
    result["status"] = "ok" if done else "FAIL"


def nvml_snapshot(path: str) -> dict[str, Any]:
    """What NVML shows of this box (``commbench.hardware.nvml_dump``: links, fabric, counters, field
    values), with commbench's own readings of CUDA device 0 beside it (``read_health``, the counters
    before and after nothing, and how the preflight and health judges take them without a spec), written
    to ``path`` (nvml.json); returns a summary for the table."""
    from commbench.hardware.health import read_health, watch_counters
    from commbench.hardware.nvml_dump import dump_nvml
    from commbench.report.judge.counters import counter_elements
    from commbench.report.judge.preflight import preflight_elements

    began = time.monotonic()
    dump = dump_nvml()
    dump_s = round(time.monotonic() - began, 2)
    health = read_health(0)
    watch = watch_counters(0)
    after = watch.finish()
    elements = preflight_elements([health], None) + counter_elements([watch.before], [after])
    dump["commbench"] = {
        "health": health.to_dict(),
        "counters_before": watch.before.to_dict(),
        "counters_after": after.to_dict(),
        "elements": [{"status": e.status, "name": e.name, "message": e.message} for e in elements],
    }
    write_atomic(Path(path), json.dumps(dump, indent=1, default=str))
    links = sorted(set(health.nvlink_active) | set(health.nvlink_inactive))
    findings = [f"{e.status} {e.name}: {e.message}" for e in elements if e.status in ("FAIL", "WARN")]
    return {
        "dump_s": dump_s,
        "gpus": len(dump.get("gpus", [])),
        "nvml": dump.get("nvml"),
        "nvlink": f"{len(health.nvlink_active)} of {len(links)} links active" if links else "no NVLink",
        "fabric": health.fabric_state or health.skipped.get("fabric", "-"),
        "nvlink_counters_read": sorted(watch.before.nvlink),
        "findings": findings,
        "status": "FAIL" if not dump.get("nvml") or any(f.startswith("FAIL") for f in findings) else "ok",
    }


STEPS = {
    "environment": environment,
    "nvml": nvml_snapshot,
    "copy ceiling": copy_ceiling,
    "loopback": loopback,
}


def child_main(step: str, kwargs: dict[str, Any]) -> int:
    """One GPU step in this process; its result goes to $GPU_CHECK_RESULT (after every loopback setting)."""
    path = Path(os.environ[RESULT_ENV])
    sys.path.insert(0, str(REPO))

    def save(result: dict[str, Any]) -> None:
        write_atomic(path, json.dumps(result, indent=1, default=str))

    try:
        fn = STEPS[step]
        result = fn(**kwargs, progress=save) if step == "loopback" else fn(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the parent records it; the traceback goes to stderr
        traceback.print_exc()
        save({"status": "FAIL", "error": _one_line(exc)})
        return 1
    save(result)
    return 0


# ----------------------------------------------------------------------------------------------------------
# The parent: CLI runs, the files, the order of the steps.


def _start(command: list[str], extra_env: dict[str, str], stderr: int) -> subprocess.Popen:
    """``command`` from the repo with this checkout importable, in its own session: on a timeout its
    children (spawned ranks, NVSHMEM proxy threads) are killed with it instead of spinning on the GPU."""
    env = {**os.environ, **extra_env, "PYTHONPATH": _pythonpath()}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=stderr, text=True, errors="replace", env=env, cwd=REPO,
        start_new_session=True,
    )  # fmt: skip


RUN = ("run", "--world-size", "1")  # commbench run, ranks spawned by commbench itself
# torchrun's single-node launcher (a free rendezvous port: --standalone) with one worker. The suite's
# pairwise link test needs two ranks: at world size 1 it is refused (exit 2), so it is left out.
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "commbench")
TORCHRUN_SUITE = (*TORCHRUN, "suite", "--quick", "--no-pairwise")
MAX_FINDINGS = 6  # verdict findings kept per CLI step


def cli_run(
    out: Path, work: Path, name: str, args: list[str], timeout_s: float, launcher: tuple[str, ...] = RUN
) -> dict[str, Any]:
    """One commbench command: ``python -m commbench`` + ``launcher`` (default: ``run --world-size 1``; a
    ``TORCHRUN`` tuple starts it under torchrun) + ``--out`` + ``args``. Its report folder goes under
    ``work``, its output is appended to ``out``/cli_runs.log; the result has the figures of results.json
    and the verdict (status and findings) of verdict.json."""
    folder = work / name
    prefix = ["-m", "commbench", *launcher] if launcher[0] != "-m" else list(launcher)
    command = [sys.executable, *prefix, "--out", str(folder), *args]
    process = _start(command, {}, stderr=subprocess.STDOUT)
    timed_out = False
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except BaseException as exc:  # the timeout, or SIGTERM to this script (Stopped): the run goes too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        timed_out = True
    with open(out / "cli_runs.log", "a") as log:
        log.write(f"===== {name}: {' '.join(command[1:])}\n{output}\n")
    result: dict[str, Any] = {"command": " ".join(command[1:]), "exit_code": process.returncode}
    if timed_out:
        return {**result, "status": "FAIL", "error": f"timed out after {timeout_s:g} s"}
    result.update(_results_figures(folder / "results.json"))
    result.update(_verdict(folder / "verdict.json"))
    tail = output.strip().splitlines()
    if process.returncode != 0:
        how, signal_name = exit_description(process.returncode)
        if signal_name:
            result["signal"] = signal_name
        failed = [f for f in result.get("findings", []) if f.startswith("FAIL")]
        last = f"verdict {result['verdict']}: {failed[0]}" if failed else (tail[-1] if tail else "")
        result["error"] = f"{how}: {last}" if last else how
        result["output_tail"] = tail[-TAIL_LINES:]
    result["status"] = "ok" if process.returncode == 0 else "FAIL"
    return result


def _results_figures(path: Path) -> dict[str, Any]:
    """Per phase the last row's p50 time, algbw and #wrong; the rows, their #wrong summed, the largest
    balanced size's busbw (a suite)."""
    if not path.exists():
        return {}
    loaded = json.loads(path.read_text())
    rows = loaded["results"] if isinstance(loaded, dict) and "results" in loaded else loaded
    rows = [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []
    out: dict[str, Any] = {"rows": len(rows), "wrong_total": sum(int(row.get("wrong") or 0) for row in rows)}
    for row in rows:
        phase = row.get("phase")
        out[f"{phase}_us"] = row.get("time_us_p50")
        out[f"{phase}_algbw_GBps"] = row.get("algbw_GBps")
        out[f"{phase}_wrong"] = row.get("wrong")
    balanced = [row for row in rows if row.get("phase") == "alltoall" and row.get("size_bytes")]
    if balanced:
        largest = max(balanced, key=lambda row: row["size_bytes"])
        out["alltoall_max_bytes"] = largest["size_bytes"]
        out["alltoall_max_busbw_GBps"] = largest.get("busbw_GBps")
    return out


def _verdict(path: Path) -> dict[str, Any]:
    """verdict.json's status and its FAIL / WARN findings ("FAIL group/name: message")."""
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    elements = [e for e in verdict.get("elements", []) if e.get("status") in ("FAIL", "WARN")]
    elements.sort(key=lambda e: e["status"] != "FAIL")
    findings = [f"{e['status']} {e.get('group')}/{e.get('name')}: {e.get('message')}"[:240] for e in elements]
    return {"verdict": verdict.get("status"), "findings": findings[:MAX_FINDINGS]}


def listed_option(command: str, flag: str, timeout_s: float = 60.0) -> tuple[bool, str]:
    """Whether ``commbench COMMAND --help`` lists ``flag`` (an option another checkout may not have yet),
    and a note saying so."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "commbench", command, "--help"], capture_output=True, text=True,
            timeout=timeout_s, env={**os.environ, "PYTHONPATH": _pythonpath()}, cwd=REPO,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`commbench {command} --help` did not answer ({_one_line(exc)})"
    if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", done.stdout):
        return True, f"`commbench {command} --help` lists {flag}"
    return False, f"`commbench {command} --help` does not list {flag} (not in this checkout): step not run"


# The steps, in the order they run (and the table's).
ENV, NVML, COPY = "environment", "nvml dump", "copy ceiling"
NCCL, SUITE = "nccl world 1", "nccl torchrun suite --quick"
COMPILE = "nvshmem set-up compile"
NVSHMEM, WAIT, SET = "nvshmem world 1", "nvshmem wait=nvshmem", "nvshmem signal_op=set"
GRAPH, VDEV, LOOP = "nvshmem --cuda-graph", "nvshmem vdev2d world 1", "loopback put kernel"
TABLE_STEPS = (ENV, NVML, COPY, NCCL, SUITE, COMPILE, NVSHMEM, WAIT, SET, GRAPH, VDEV)
RUN_STEPS = (NCCL, NVSHMEM, WAIT, SET, GRAPH, VDEV)  # commbench run at world size 1
NVML_FILE = "nvml.json"
CUDA_GRAPH = ("--cuda-graph", "10")  # calls per captured CUDA graph (commbench.run.graphs; an even N)
# NVSHMEM's calls can be captured only with the counts exchanged and laid out on the device.
GRAPH_OPTIONS = ("--backend-option", "counts=device")
# The knob settings the set-up compile builds (each a Triton specialization of the put / wait kernels: the
# wait mode and the signal op are constexprs) before the CLI runs of the same settings use them.
COMPILE_CONFIGS: tuple[dict[str, Any], ...] = ({}, {"wait": "nvshmem"}, {"signal_op": "set"})


def _figure(step: dict[str, Any]) -> str:
    """The table cell of a step: its figure (when it has one), its verdict, and why it failed or was
    skipped."""
    if not step:
        return "not run"
    name, parts = step["step"], []
    if name == ENV and step.get("device"):
        parts.append(f"{step.get('device')} torch {step.get('torch')}")
    elif name == NVML and "nvlink" in step:
        counters = step.get("nvlink_counters_read") or []
        parts.append(
            f"{step['nvlink']}; fabric {step.get('fabric')}; {len(counters)} NVLink error counters read; "
            f"{len(step.get('findings') or [])} finding(s) without a spec; dump {step.get('dump_s')} s"
        )
    elif name == COPY and step.get("copy_GBps"):
        parts.append(f"{step['copy_GBps']} GB/s (read+write)")
    elif name == SUITE and "rows" in step:
        text = f"{step['rows']} rows #wrong {step.get('wrong_total')}"
        if step.get("alltoall_max_busbw_GBps") is not None:
            text += f"; alltoall {step['alltoall_max_bytes']} B busbw {step['alltoall_max_busbw_GBps']} GB/s"
        parts.append(text)
    elif name == COMPILE and step.get("configs"):
        built = [c for c in step["configs"] if "error" not in c]
        total, wrong = len(step["configs"]), step.get("wrong_total")
        parts.append(f"{len(built)} of {total} settings built and verified (#wrong {wrong})")
    elif name in RUN_STEPS and step.get("dispatch_us") is not None:
        parts.append(
            f"dispatch {step.get('dispatch_us')} us #wrong {step.get('dispatch_wrong')}; "
            f"combine {step.get('combine_us')} us #wrong {step.get('combine_wrong')}"
        )
    if step.get("verdict"):
        parts.append(f"verdict {step['verdict']}")
    for key in ("error", "note"):
        if step.get(key):
            parts.append(str(step[key]))
    return "; ".join(parts)[:240] or "-"


def _wrong_counts(step: dict[str, Any]) -> list[int]:
    """The #wrong figures a step reported (none: it verified no data)."""
    return [
        int(step[key])
        for key in ("dispatch_wrong", "combine_wrong", "wrong_total")
        if step.get(key) is not None
    ]


def write_outputs(check: Check, out: Path) -> tuple[list[list[str]], bool]:
    """gpu_check.json, gpu_check.csv and measurements.md from the steps so far (each written atomically)."""
    steps = {s["step"]: s for s in check.steps}
    env = steps.get(ENV, {})
    ceiling = steps.get(COPY, {}).get("copy_GBps")
    loop = steps.get(LOOP, {})
    table: list[list[str]] = [["check", "status", "figure"]]
    for name in TABLE_STEPS:
        table.append([name, steps.get(name, {}).get("status", "-"), _figure(steps.get(name, {}))])
    percent = None
    passed_target = False
    for key in ("default", "best"):
        config = loop.get(key)
        if not config:
            continue
        pct = 100.0 * config["kernel_GBps"] / ceiling if ceiling else None
        if key == "default":
            percent = pct
        passed_target = passed_target or (pct is not None and pct >= TARGET_PERCENT)
        knobs = f"blocks {config.get('num_blocks')} chunk {config.get('chunk_bytes')} B"
        figure = f"{config['kernel_GBps']} GB/s = {pct:.1f}% of copy ({knobs})" if pct else "-"
        table.append([f"loopback put ({key})", loop.get("status", "-"), figure])
    if loop and "error" in loop:
        table.append(["loopback put kernel", loop.get("status", "-"), _figure(loop)])
    # Data: the NCCL run, the NVSHMEM run and the loopback verified every byte, and no step that verified
    # data found a wrong one (a verdict FAIL of another kind, a preflight finding, is not wrong data).
    wrong = sorted(name for name, step in steps.items() if any(_wrong_counts(step)))
    unverified = [name for name in (NCCL, NVSHMEM, LOOP) if not _wrong_counts(steps.get(name, {}))]
    verification = not wrong and not unverified
    why = f"#wrong in {', '.join(wrong)}" if wrong else f"not verified: {', '.join(unverified)}"
    table.append(
        ["verification", "ok" if verification else "FAIL", "#wrong 0 in every step" if verification else why]
    )
    table.append(
        [
            "target >= 85% of copy",
            "ok" if passed_target else "MISS",
            f"default {percent:.1f}%" if percent else "-",
        ]
    )
    summary = {
        "steps": check.steps,
        "copy_GBps": ceiling,
        "loopback_percent_of_copy_default": percent,
        "target_percent": TARGET_PERCENT,
        "target_met": passed_target,
        "verification_clean": verification,
        "nvml_file": NVML_FILE if (out / NVML_FILE).exists() else None,
        "total_seconds": round(time.monotonic() - check.started, 1),
    }
    write_atomic(out / "gpu_check.json", json.dumps(summary, indent=2, default=str))
    buffer = io.StringIO()
    csv.writer(buffer).writerows(table)
    write_atomic(out / "gpu_check.csv", buffer.getvalue())
    lines = [
        f"## {env.get('date_utc')}: {env.get('device')} (gpu_check)",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), Triton {env.get('triton')}, "
        f"NVSHMEM {env.get('nvshmem')}, NCCL {env.get('nccl')}, {env.get('sms')} SMs.",
        "",
        "| check | status | figure |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c.replace('|', '/')} |" for a, b, c in table[1:]],
        "",
    ]
    write_atomic(out / "measurements.md", "\n".join(lines))
    ok = all(s["status"] in ("ok", "SKIP") for s in check.steps) and verification
    return table, ok


def _stop(signum: int, frame: Any) -> None:
    raise Stopped()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank of the CLI runs")
    parser.add_argument(
        "--loopback-tokens", type=int, default=16384, help="tokens of the loopback kernel check"
    )
    parser.add_argument("--launches", type=int, default=50, help="back-to-back put kernels timed per config")
    parser.add_argument("--quick", action="store_true", help="one loopback config, no vdev2d run")
    parser.add_argument("--child", choices=sorted(STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--child-kwargs", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, json.loads(args.child_kwargs))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli_runs.log").unlink(missing_ok=True)
    # One GPU, one host: NVSHMEM needs no network transport, and its unique-id bootstrap may use loopback.
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    import torch  # this process only counts devices (no CUDA context); the steps use the GPU

    if torch.cuda.device_count() < 1:
        print("gpu_check: no CUDA device on this machine; run it where a GPU is lent", file=sys.stderr)
        write_atomic(out / "gpu_check.json", json.dumps({"status": "no GPU"}))
        return 2
    signal.signal(signal.SIGTERM, _stop)
    check = Check(out)
    try:
        run_steps(check, args)
    except (Stopped, KeyboardInterrupt):
        print("[gpu_check] stopped: the files hold every step finished so far", file=sys.stderr, flush=True)
    table, ok = write_outputs(check, out)
    widths = [max(len(str(row[i])) for row in table) for i in range(3)]
    print()
    for row in table:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(f"\nresults in {out} (gpu_check.json, gpu_check.csv, measurements.md, cli_runs.log, {NVML_FILE})")
    shutil.rmtree(check.work, ignore_errors=True)
    return 0 if ok else 1


def run_steps(check: Check, args: argparse.Namespace) -> None:
    """Every step in order; each one's figure or error is recorded whatever the earlier ones did. Only a
    set-up compile that timed out stops the NVSHMEM steps after it (they would hang the same way); one that
    failed quickly leaves them to run, on shorter timeouts, and record their own errors."""
    out, work = check.out, check.work

    def budget(limit: float, reserve: float = LOOPBACK_RESERVE_S) -> float:
        return max(10.0, min(limit, check.remaining(reserve)))

    check.isolated(ENV, "environment", {}, budget(45))
    check.isolated(NVML, "nvml", {"path": str(out / NVML_FILE)}, budget(30))
    check.isolated(COPY, "copy ceiling", {}, budget(45))
    # --timeout also bounds the NVSHMEM signal waits: a broken kernel fails in 30 s instead of spinning.
    timing = ["--tokens", str(args.tokens), "--warmup", "5", "--iters", "20", "--timeout", "30"]
    common = ["--model", "deepseek-v3", *timing]
    nccl = [*common, "--backend", "nccl"]
    check.step(NCCL, lambda: cli_run(out, work, "nccl", nccl, budget(60)), 25)
    suite = ["--backend", "nccl", "--timeout", "30"]
    check.step(SUITE, lambda: cli_run(out, work, "nccl_suite", suite, budget(75), TORCHRUN_SUITE), 30)
    compiled = check.isolated(
        # The CLI runs' token count: the same plan sizes, so the same Triton specializations where it can.
        COMPILE, "loopback", {"tokens": args.tokens, "configs": list(COMPILE_CONFIGS), "launches": 0},
        budget(90), 30,
    )  # fmt: skip
    hung = "timed out" in str(compiled.get("error", ""))
    limit = 45.0 if compiled.get("status") == "ok" else 30.0
    nvshmem = [*common, "--backend", "nvshmem"]

    def skip_if_hung(name: str) -> bool:
        if hung:
            note = f"not run: the set-up compile {compiled['error']} (this step would hang the same way)"
            check.record({"step": name, "status": "SKIP", "seconds": 0.0, "note": note})
        return hung

    def nvshmem_step(name: str, folder: str, run_args: list[str], needs: Any = None) -> None:
        if skip_if_hung(name):
            return

        def run() -> dict[str, Any]:
            if needs is not None:  # an option this checkout may not have: asked first, skipped with a note
                listed, note = needs()
                if not listed:
                    return {"status": "SKIP", "note": note}
            return cli_run(out, work, folder, run_args, budget(limit))

        check.step(name, run, 25)

    nvshmem_step(NVSHMEM, "nvshmem", nvshmem)
    nvshmem_step(WAIT, "nvshmem_wait", [*nvshmem, "--backend-option", "wait=nvshmem"])
    nvshmem_step(SET, "nvshmem_set", [*nvshmem, "--backend-option", "signal_op=set"])
    graph = [*nvshmem, *GRAPH_OPTIONS, *CUDA_GRAPH]
    nvshmem_step(GRAPH, "nvshmem_graph", graph, lambda: listed_option("run", CUDA_GRAPH[0]))
    if not args.quick:
        # all_to_all_vdev_2d takes <= 16 experts per rank: mixtral-8x22b (8 experts) in selection mode.
        vdev = ["--model", "mixtral-8x22b", *timing, "--backend", "nvshmem", "--send-mode", "selection"]
        nvshmem_step(VDEV, "nvshmem_vdev2d", [*vdev, "--backend-option", "variant=vdev2d"])
    configs: list[dict[str, Any]] = [{}]
    if not args.quick:
        configs += [
            {"chunk_bytes": 512 * 1024},
            {"chunk_bytes": 32 * 1024},
            {"num_blocks": 64},
            {"num_warps": 32},
            {"put": "blocking"},
            {"signal": "segment", "chunk_bytes": 512 * 1024},
        ]
    if skip_if_hung(LOOP):
        return
    loop = {"tokens": args.loopback_tokens, "configs": configs, "launches": args.launches}
    check.isolated(LOOP, "loopback", loop, budget(90, reserve=0.0), 30)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written: skip interpreter teardown (NVSHMEM finalization with a live process group).
    os._exit(code)
