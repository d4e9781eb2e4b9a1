"""One-GPU check of the NCCL and NVSHMEM paths (run by benchmarks/gpu_check.sh; < 5 minutes on one H200).

Steps, each recorded even when an earlier one failed:

1. environment: device, torch / Triton / NVSHMEM versions, the packages commbench imports;
2. copy ceiling: a large device-to-device ``copy_`` timed with CUDA events; bandwidth counts bytes read +
   written (2 x size / time), the HBM figure the loopback put kernel is compared with;
3. the project's CLI (``python -m commbench run``) at world size 1, verification on: NCCL and NVSHMEM puts
   (default knobs) on deepseek-v3, and the torch ``all_to_all_vdev_2d`` reference variant on mixtral-8x22b
   in selection mode (torch's kernels take at most 16 experts per rank; deepseek-v3 has 256 at world 1);
4. loopback put kernel: this process as PE 0 of a one-rank job puts deepseek-v3 dispatch rows to itself;
   dispatch and combine are verified, then the put kernel alone is launched back to back under CUDA events
   for a few (num_blocks, chunk_bytes) settings; bandwidth = 2 x bytes / time (read + write, as the copy),
   reported as % of the copy ceiling (target >= 85 %).

Writes gpu_check.json, gpu_check.csv, measurements.md (a section for docs/measurements.md) and cli_runs.log
(the CLI runs' output) under --out, at most 8 files in all (the device tool returns no more); the CLI report
folders go to a temporary folder. Prints a short table last. Exit 0 when every step passed and
verification was clean, 1 otherwise, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

TARGET_PERCENT = 85.0
BUDGET_S = 265.0  # whole check; gpu_check.sh kills it at 285 s
LOOPBACK_RESERVE_S = 75.0  # kept for the loopback step when the CLI steps run long
REPO = Path(__file__).resolve().parent.parent


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


class Check:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def remaining(self, reserve: float = 0.0) -> float:
        return BUDGET_S - (time.monotonic() - self.started) - reserve

    def step(self, name: str, fn: Any, needs_s: float = 10.0) -> dict[str, Any]:
        began = time.monotonic()
        if self.remaining() < needs_s:
            entry = {"step": name, "status": "SKIP", "seconds": 0.0, "error": "out of time budget"}
            self.steps.append(entry)
            print(f"[gpu_check] {name}: skipped (time budget)", flush=True)
            return entry
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            result = fn() or {}
            status = result.pop("status", "ok")
        except Exception as exc:  # noqa: BLE001 - every step is recorded, the check goes on
            traceback.print_exc()
            result, status = (
                {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"},
                "FAIL",
            )
        entry = {"step": name, "status": status, "seconds": round(time.monotonic() - began, 1), **result}
        self.steps.append(entry)
        print(f"[gpu_check] {name}: {status} ({entry['seconds']} s)", flush=True)
        return entry


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "triton": _version("triton"),
        "nvshmem": _version("nvidia-nvshmem-cu13") or _version("nvidia-nvshmem-cu12"),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    try:
        import torch.distributed._symmetric_memory as symm_mem

        info["torch_nvshmem_available"] = bool(symm_mem.is_nvshmem_available())
        info["has_all_to_all_vdev_2d"] = hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d")
    except Exception as exc:  # noqa: BLE001
        info["torch_nvshmem_available"] = f"error: {exc}"
    missing = []
    for module in ("numpy", "pandas", "click", "pyarrow", "matplotlib", "yaml", "pynvml", "commbench.cli"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            missing.append(f"{module} ({type(exc).__name__})")
    info["missing_imports"] = missing
    if missing:
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
    del src, dst
    torch.cuda.empty_cache()
    return {
        "bytes": size_bytes,
        "time_us": round(seconds * 1e6, 1),
        "copy_GBps": round(2 * size_bytes / seconds / 1e9, 1),
        "status": "ok" if ok else "FAIL",
    }


def cli_run(out: Path, work: Path, name: str, args: list[str], timeout_s: float) -> dict[str, Any]:
    """One ``commbench run`` (report folder under ``work``, output appended to ``out``/cli_runs.log)."""
    folder = work / name
    command = [sys.executable, "-m", "commbench", "run", "--world-size", "1", "--out", str(folder), *args]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # Own session: on a timeout the spawned rank goes too, instead of spinning on the GPU as an orphan.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        timed_out = True
    with open(out / "cli_runs.log", "a") as log:
        log.write(f"===== {name}: {' '.join(command[1:])}\n{output}\n")
    result: dict[str, Any] = {"command": " ".join(command[1:]), "exit_code": process.returncode}
    if timed_out:
        return {**result, "status": "FAIL", "error": f"timed out after {timeout_s:g} s"}
    rows_path = folder / "results.json"
    if rows_path.exists():
        loaded = json.loads(rows_path.read_text())
        rows = loaded["results"] if isinstance(loaded, dict) and "results" in loaded else loaded
        for row in rows if isinstance(rows, list) else []:
            phase = row.get("phase")
            result[f"{phase}_us"] = row.get("time_us_p50")
            result[f"{phase}_algbw_GBps"] = row.get("algbw_GBps")
            result[f"{phase}_wrong"] = row.get("wrong")
    tail = output.strip().splitlines()
    if process.returncode != 0:
        result["error"] = tail[-1] if tail else f"exit {process.returncode}"
    result["status"] = "ok" if process.returncode == 0 else "FAIL"
    return result


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


def loopback(tokens: int, configs: list[dict[str, Any]], launches: int) -> dict[str, Any]:
    """PE 0 puts deepseek-v3 dispatch rows to itself: verification, then the put kernel's bandwidth."""
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
    }
    wrong_total = 0
    for options in configs:
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
            wrong_total += wrong_dispatch + wrong_combine
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
            entry = {
                **backend.knobs(),
                "dispatch_wrong": wrong_dispatch,
                "combine_wrong": wrong_combine,
                "kernel_us": round(seconds * 1e6, 1),
                "kernel_GBps": round(2 * moved / seconds / 1e9, 1),
            }
        except Exception as exc:  # noqa: BLE001 - one failing config must not hide the others
            traceback.print_exc()
            entry = {
                **options,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            }
        finally:
            backend.close()
        print(f"[gpu_check]   loopback {entry}", flush=True)
        result["configs"].append(entry)
    timed = [c for c in result["configs"] if "kernel_GBps" in c]
    result["wrong_total"] = wrong_total
    if timed:
        result["default"] = timed[0]
        result["best"] = max(timed, key=lambda c: c["kernel_GBps"])
    result["status"] = "ok" if timed and len(timed) == len(configs) and wrong_total == 0 else "FAIL"
    return result


def write_outputs(check: Check, out: Path) -> tuple[list[list[str]], bool]:
    steps = {s["step"]: s for s in check.steps}
    env = steps.get("environment", {})
    ceiling = steps.get("copy ceiling", {}).get("copy_GBps")
    loop = steps.get("loopback put kernel", {})
    table: list[list[str]] = [["check", "status", "figure"]]
    table.append(["environment", env.get("status", "-"), f"{env.get('device')} torch {env.get('torch')}"])
    table.append(
        ["copy ceiling", steps.get("copy ceiling", {}).get("status", "-"), f"{ceiling} GB/s (read+write)"]
    )
    for name in ("nccl world 1", "nvshmem world 1", "nvshmem vdev2d world 1"):
        s = steps.get(name, {})
        figure = (
            f"dispatch {s.get('dispatch_us')} us #wrong {s.get('dispatch_wrong')}; "
            f"combine {s.get('combine_us')} us #wrong {s.get('combine_wrong')}"
        )
        if not s:
            figure = "not run"
        elif "error" in s:
            figure = s["error"][:80]
        table.append([name, s.get("status", "-"), figure])
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
    verification = loop.get("wrong_total") == 0 and all(
        steps.get(n, {}).get("status") == "ok" for n in ("nccl world 1", "nvshmem world 1")
    )
    table.append(
        ["verification", "ok" if verification else "FAIL", "#wrong 0 everywhere" if verification else "-"]
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
        "total_seconds": round(time.monotonic() - check.started, 1),
    }
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    with open(out / "gpu_check.csv", "w", newline="") as handle:
        csv.writer(handle).writerows(table)
    lines = [
        f"## {env.get('date_utc')}: {env.get('device')} (gpu_check)",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), Triton {env.get('triton')}, "
        f"NVSHMEM {env.get('nvshmem')}, NCCL {env.get('nccl')}, {env.get('sms')} SMs.",
        "",
        "| check | status | figure |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in table[1:]],
        "",
    ]
    (out / "measurements.md").write_text("\n".join(lines))
    ok = all(s["status"] in ("ok", "SKIP") for s in check.steps) and verification
    return table, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank of the CLI runs")
    parser.add_argument(
        "--loopback-tokens", type=int, default=16384, help="tokens of the loopback kernel check"
    )
    parser.add_argument("--launches", type=int, default=50, help="back-to-back put kernels timed per config")
    parser.add_argument("--quick", action="store_true", help="one loopback config, no vdev2d run")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli_runs.log").unlink(missing_ok=True)
    sys.path.insert(0, str(REPO))
    # One GPU, one host: NVSHMEM needs no network transport, and its unique-id bootstrap may use loopback.
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")

    import torch

    if torch.cuda.device_count() < 1:
        print("gpu_check: no CUDA device on this machine; run it where a GPU is lent", file=sys.stderr)
        (out / "gpu_check.json").write_text(json.dumps({"status": "no GPU"}))
        return 2
    work = Path(tempfile.mkdtemp(prefix="commbench-gpu-check-"))  # CLI report folders (many files)
    check = Check(out)
    check.step("environment", environment)
    check.step("copy ceiling", copy_ceiling)
    # --timeout also bounds the NVSHMEM signal waits: a broken kernel fails in 30 s instead of spinning.
    timing = ["--tokens", str(args.tokens), "--warmup", "5", "--iters", "20", "--timeout", "30"]
    common = ["--model", "deepseek-v3", *timing]

    def budget(limit: float) -> float:
        return max(10.0, min(limit, check.remaining(LOOPBACK_RESERVE_S)))

    nccl = [*common, "--backend", "nccl"]
    check.step("nccl world 1", lambda: cli_run(out, work, "nccl", nccl, budget(90)), 30)
    nvshmem = [*common, "--backend", "nvshmem"]
    check.step(
        "nvshmem world 1",
        lambda: cli_run(out, work, "nvshmem", nvshmem, budget(120)),
        30 + LOOPBACK_RESERVE_S,
    )
    if not args.quick:
        # all_to_all_vdev_2d takes <= 16 experts per rank: mixtral-8x22b (8 experts) in selection mode.
        vdev = ["--model", "mixtral-8x22b", *timing, "--backend", "nvshmem", "--send-mode", "selection"]
        vdev += ["--backend-option", "variant=vdev2d"]
        check.step(
            "nvshmem vdev2d world 1",
            lambda: cli_run(out, work, "nvshmem_vdev2d", vdev, budget(90)),
            30 + LOOPBACK_RESERVE_S,
        )
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
    check.step("loopback put kernel", lambda: loopback(args.loopback_tokens, configs, args.launches), 30)
    table, ok = write_outputs(check, out)
    widths = [max(len(str(row[i])) for row in table) for i in range(3)]
    print()
    for row in table:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(f"\nresults in {out} (gpu_check.json, gpu_check.csv, measurements.md, cli_runs.log)")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written: skip interpreter teardown (NVSHMEM finalization with a live process group).
    os._exit(code)
