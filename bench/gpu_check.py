"""The GPU paths end to end on a machine with a real NVIDIA GPU, local backend: run it there.

    python bench/gpu_check.py [--epochs 3]

a. what the machine has: `nvidia-smi -L`, torch.cuda.device_count() in this (the session's) process;
b. local workers: one with nvidia_gpu=1 (its CUDA_VISIBLE_DEVICES, device count and name, a matmul on
   cuda), forked from the template and started on its own; the GPU free again for the next launch as
   soon as await_workers has returned; one with nvidia_gpu=0 (sees no GPU: CUDA_VISIBLE_DEVICES="");
   more GPUs than the machine has refused before anything starts (not even the controller);
c. run_torch with nvidia_gpu=1: worker_scripts/torch_ddp_train.py (DDP, NCCL chosen by itself) and a
   function (a tiny DDP model on cuda, its loss per step, a value back from rank 0).

Each check prints PASS or FAIL (INFO lines only report); the exit code is 1 if any failed. Needs
cmlcluster's requirements and torch with CUDA; no Docker, no network. With no GPU it fails at a.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DDP_SCRIPT = str(ROOT / "worker_scripts" / "torch_ddp_train.py")
MARK = "gpucheck:"
# What a worker sees: its GPUs, what torch makes of them, its cgroup's memory limit and peak.
DESCRIBE = f"""
import json, os
record = {{"cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}}
import torch
record["count"] = torch.cuda.device_count()
record["available"] = torch.cuda.is_available()
if record["count"]:
    record["name"] = torch.cuda.get_device_name(0)
    a = torch.randn(2048, 2048, device="cuda")
    b = a @ a.T
    torch.cuda.synchronize()
    # trace(a a^T) is the sum of a's squares
    record["matmul_ratio"] = float(b.trace() / (a * a).sum())
    record["matmul_device"] = str(b.device)
try:
    cgroup = open("/proc/self/cgroup").read().strip().splitlines()[-1].split(":", 2)[2]
    for key in ("memory.max", "memory.peak"):
        path = os.path.join("/sys/fs/cgroup", cgroup.lstrip("/"), key)
        if os.path.exists(path):
            record[key] = open(path).read().strip()
except OSError:
    pass
print({MARK!r} + json.dumps(record), flush=True)
"""

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'PASS' if ok else 'FAIL'}: {name}{f' -- {detail}' if detail else ''}", flush=True)
    if not ok:
        failures.append(name)
    return ok


def info(text: str) -> None:
    print(f"INFO: {text}", flush=True)


def run_and_show(what: str, *args: Any, **kwargs: Any) -> Any:
    """run_torch(*args, nvidia_gpu=1, ...) with its output shown and its ok checked; None if it raised."""
    from cmlcluster import run_torch

    t0 = time.monotonic()
    try:
        result = run_torch(*args, nvidia_gpu=1, cpu=4, memory=8, echo=False, **kwargs)
    except Exception:
        check(f"run_torch({what}, nvidia_gpu=1) ran", False, traceback.format_exc())
        return None
    info(f"run_torch({what}): {result!r} in {time.monotonic() - t0:.1f} s; hosts {result.hosts}")
    for rank, lines in result.output.items():
        for line in lines:
            print(f"    [rank {rank}] {line}", flush=True)
    check(f"run_torch({what}, nvidia_gpu=1): result.ok", result.ok, result.message)
    return result


def described(session, worker: dict) -> dict:
    session.drain()
    for line in session.output(worker["id"]).splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    return {}


def run_one(session, label: str, nvidia_gpu: int, memory: float = 4) -> dict:
    """Launch one worker that describes what it sees; wait for it; its description ({} if it failed)."""
    workers = session.launch_workers(1, cpu=2, memory=memory, nvidia_gpu=nvidia_gpu, code=DESCRIBE)
    result = session.await_workers(workers, timeout_seconds=180)
    if not check(f"{label}: the worker succeeded", not result["failures"], json.dumps(result["failures"])[:3000]):
        return {}
    record = described(session, workers[0])
    info(f"{label}: worker {workers[0]['id']} saw {json.dumps(record)}")
    return record


def wait_free(backend, want: int, seconds: float = 15) -> float:
    t0 = time.monotonic()
    while len(backend.gpus.free) < want and time.monotonic() - t0 < seconds:
        time.sleep(0.02)
    return time.monotonic() - t0


# --- a -----------------------------------------------------------------------------------------------


def machine() -> int:
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        smi = subprocess.CompletedProcess(["nvidia-smi", "-L"], 127, "", str(e))
    for line in (smi.stdout + smi.stderr).splitlines():
        info(f"nvidia-smi -L: {line}")
    import torch

    count = torch.cuda.device_count()
    info(f"torch {torch.__version__} (CUDA {torch.version.cuda}) in the session's process: device_count={count}")
    info(f"the session's CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    for name in ("ipyparallel", "ipykernel", "IPython", "zmq", "tornado", "jupyter_client", "cloudpickle", "psutil"):
        try:
            module = importlib.import_module(name)
            info(f"{name} {getattr(module, '__version__', '?')} from {os.path.dirname(module.__file__ or '')}")
        except ImportError as e:
            check(f"{name} imports", False, str(e))
    check(
        "the machine has a GPU (nvidia-smi and torch agree)",
        smi.returncode == 0 and count >= 1,
        f"nvidia-smi rc={smi.returncode}, torch.cuda.device_count()={count}",
    )
    return count


# --- b -----------------------------------------------------------------------------------------------


def workers(count: int) -> None:
    from cmlcluster import ConfigError, Session, run_torch
    from cmlcluster.backends.local import LocalBackend

    # Too many GPUs, on a fresh session: refused before anything starts (not even the controller).
    with Session("local", echo=False) as s:
        gpus = s.backend.gpus.all
        info(f"the local backend hands out GPUs {gpus}")
        check("the local backend found every GPU", len(gpus) == count, f"{gpus} for {count} GPUs")
        for label, call in (
            ("launch_workers(1, nvidia_gpu=all+1)", lambda: s.launch_workers(1, cpu=1, memory=1, nvidia_gpu=count + 1)),
            (
                "launch_workers(2 * all, nvidia_gpu=1)",
                lambda: s.launch_workers(2 * count, cpu=1, memory=1, nvidia_gpu=1),
            ),
            ("run_torch(nvidia_gpu=all+1)", lambda: run_torch(DDP_SCRIPT, nvidia_gpu=count + 1, session=s, echo=False)),
            (
                "run_torch(nproc_per_node=2, nvidia_gpu=1)",
                lambda: run_torch(DDP_SCRIPT, nproc_per_node=2, nvidia_gpu=1, session=s, echo=False),
            ),
        ):
            try:
                call()
                check(f"{label} is refused", False, "it was accepted")
            except ConfigError as e:
                check(f"{label} is refused with a ConfigError", True, str(e))
        check(
            "nothing started for the refused launches",
            s.list_workers() == [] and s.client is None,
            f"workers={s.list_workers()}, controller started={s.client is not None}",
        )

    with Session("local", echo=False) as s:
        backend = s.backend
        gpu = run_one(s, "nvidia_gpu=1 (forked from the template)", 1)
        # The worker's program ended and await_workers returned: its GPU must be free for the next launch.
        free_now = backend.gpus.free
        try:
            again = s.launch_workers(1, cpu=2, memory=4, nvidia_gpu=1, code=DESCRIBE)
            relaunch_error = ""
        except ConfigError as e:
            again, relaunch_error = [], str(e)
        waited = wait_free(backend, len(backend.gpus.all)) if relaunch_error else 0.0
        check(
            "its GPU can be launched on again as soon as await_workers returned",
            not relaunch_error,
            f"free GPUs right after await_workers: {free_now}; refused: {relaunch_error}; free {waited:.2f} s later"
            if relaunch_error
            else f"free right after: {free_now}",
        )
        if again:
            result = s.await_workers(again, timeout_seconds=180)
            check("the relaunched GPU worker succeeded", not result["failures"], json.dumps(result["failures"])[:2000])
            info(f"relaunched GPU worker saw {json.dumps(described(s, again[0]))}")
            wait_free(backend, len(backend.gpus.all))
        if gpu:
            check("nvidia_gpu=1: CUDA_VISIBLE_DEVICES is one GPU id", gpu["cvd"] in backend.gpus.all, repr(gpu["cvd"]))
            check("nvidia_gpu=1: torch.cuda.device_count() == 1", gpu["count"] == 1, str(gpu["count"]))
            check(
                "nvidia_gpu=1: a matmul ran on cuda",
                abs(gpu.get("matmul_ratio", 0) - 1) < 1e-3 and gpu.get("matmul_device") == "cuda:0",
                f"{gpu.get('name')}: ratio {gpu.get('matmul_ratio')}",
            )
        none = run_one(s, "nvidia_gpu=0", 0)
        if none:
            check("nvidia_gpu=0: CUDA_VISIBLE_DEVICES is empty", none["cvd"] == "", repr(none["cvd"]))
            check("nvidia_gpu=0: torch sees no GPU", none["count"] == 0 and not none["available"], str(none["count"]))
        # Report only: a GPU worker at memory=1 (GB, the README's examples), where cgroups apply the limit.
        small = s.launch_workers(1, cpu=1, memory=1, nvidia_gpu=1, code=DESCRIBE)
        result = s.await_workers(small, timeout_seconds=180)
        seen = described(s, small[0]) if not result["failures"] else result["failures"][0].get("message", "")[:1500]
        info(f"nvidia_gpu=1 at memory=1: {'succeeded' if not result['failures'] else 'FAILED'}: {seen}")
        wait_free(backend, len(backend.gpus.all))
        # One GPU held by a running worker: a second GPU launch beyond what is free is refused.
        held = s.launch_workers(count, cpu=1, memory=1, nvidia_gpu=1)
        s.await_workers(held, wait_for_completion=False, timeout_seconds=120)
        try:
            s.launch_workers(1, cpu=1, memory=1, nvidia_gpu=1)
            check("a GPU launch while every GPU is held is refused", False, "it was accepted")
        except ConfigError as e:
            check("a GPU launch while every GPU is held is refused", "0 are free" in str(e), str(e))
        try:
            run_torch(DDP_SCRIPT, nvidia_gpu=1, session=s, echo=False)
            check("run_torch(nvidia_gpu=1) while every GPU is held is refused", False, "it was accepted")
        except ConfigError as e:
            check("run_torch(nvidia_gpu=1) while every GPU is held is refused", True, str(e))
        time.sleep(1)
        states = [w["status"] for w in s.list_workers() if w["id"] in {h["id"] for h in held}]
        check(
            "the refused run_torch left the session's other workers running", states == ["running"] * count, str(states)
        )
        s.stop_workers(*held)
        check("stopped workers' GPUs are free again", backend.gpus.free == backend.gpus.all, str(backend.gpus.free))
        template_log = Path(s.session_dir or "/nonexistent") / "workers" / "template-0.log"
        info(f"template log: {template_log.read_text()[-2000:]!r}" if template_log.exists() else "no template log")

        torch_runs(s, count)

    with Session(LocalBackend(fork=False), echo=False) as s:
        own = run_one(s, "nvidia_gpu=1 (started on its own, fork=False)", 1)
        if own:
            check(
                "fork=False, nvidia_gpu=1: one GPU, a matmul on cuda",
                own["count"] == 1 and abs(own.get("matmul_ratio", 0) - 1) < 1e-3,
                json.dumps(own),
            )


# --- c -----------------------------------------------------------------------------------------------


def tiny_ddp(steps: int) -> dict:
    """Run on every rank by run_torch: a tiny model under DDP on this process's GPU, its loss each step."""
    import os

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from cmlcluster.pytorch import init_process_group

    init_process_group()
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device), device_ids=[local_rank]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(256, 16, device=device)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step + 1} loss {losses[-1]:.6f}", flush=True)
    value = {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "env_backend": os.environ.get("CMLCLUSTER_DIST_BACKEND"),
        "device": torch.cuda.get_device_name(device),
        "param_device": str(next(model.parameters()).device),
        "losses": losses,
    }
    dist.destroy_process_group()
    return value if rank == 0 else {}


def torch_runs(s, count: int) -> None:

    backend = s.backend
    args = argparse.Namespace(**ARGS)
    result = run_and_show("torch_ddp_train.py", DDP_SCRIPT, ["--epochs", str(args.epochs)], nnodes=1, session=s)
    if result is None:
        return
    lines = result.output.get(0, [])
    check("the DDP script ran on cuda:0 with NCCL", any("(cuda:0, nccl)" in x for x in lines), str(lines[:2]))
    check(
        f"the DDP script reported epoch {args.epochs}'s loss",
        any(x.startswith(f"epoch {args.epochs} loss ") for x in lines),
    )
    check("the GPU is free again after run_torch", backend.gpus.free == backend.gpus.all, str(backend.gpus.free))

    result = run_and_show("function", tiny_ddp, [args.steps], session=s)
    if result is None:
        return
    value = result.value or {}
    info(f"rank 0's value: {json.dumps(value)}")
    losses = value.get("losses", [])
    check(
        "the function's DDP ran on NCCL, one process, on cuda:0",
        value.get("backend") == "nccl"
        and value.get("env_backend") == "nccl"
        and value.get("world_size") == 1
        and value.get("param_device") == "cuda:0",
        json.dumps({k: v for k, v in value.items() if k != "losses"}),
    )
    check("its loss went down", len(losses) == args.steps and losses[-1] < losses[0], str(losses))
    check(
        "the GPU is free again after run_torch(function)", backend.gpus.free == backend.gpus.all, str(backend.gpus.free)
    )


ARGS: dict = {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="torch_ddp_train.py's epochs")
    parser.add_argument("--steps", type=int, default=5, help="the function's DDP steps")
    ARGS.update(vars(parser.parse_args()))
    t0 = time.monotonic()
    count = machine()
    if count:
        try:
            workers(count)
        except Exception:
            check("the worker checks ran to the end", False, traceback.format_exc())
    print(
        f"{'FAIL' if failures else 'PASS'}: gpu_check, {len(failures)} failed, {time.monotonic() - t0:.1f} s"
        + "".join(f"\n  failed: {name}" for name in failures),
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
