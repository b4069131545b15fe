"""In a real Jupyter kernel: interrupting a wait, restarting and shutting the kernel down."""

from __future__ import annotations

import json
import time

import psutil
import pytest
from jupyter_client.manager import KernelManager

pytestmark = pytest.mark.integration

LAUNCH = """
import json, os
import cmlcluster as cdsw
ws = cdsw.launch_workers(2, cpu=1, memory=1)
cdsw.await_workers(ws, wait_for_completion=False, timeout_seconds=60)
print(json.dumps(cdsw.client()[:].apply_sync(os.getpid)))
"""


@pytest.fixture
def kernel():
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


def run(kc, code: str, timeout: float = 120) -> tuple[dict, str]:
    out = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    return reply["content"], "".join(out)


def worker_pids(kc) -> list[int]:
    content, out = run(kc, LAUNCH)
    assert content["status"] == "ok", out
    pids = json.loads(out.strip().splitlines()[-1])
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    return pids


def test_interrupt_stops_the_wait_and_the_session_goes_on(kernel):
    km, kc = kernel
    worker_pids(kc)
    kc.execute("cdsw.await_workers(ws, wait_for_completion=True, timeout_seconds=0)")  # idle workers never finish
    time.sleep(2)
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    content, out = run(kc, "print(sorted(w['status'] for w in cdsw.list_workers()))")
    assert content["status"] == "ok", out
    assert out.strip() == "['running', 'running']"


def test_kernel_restart_stops_workers(kernel, wait_gone):
    km, kc = kernel
    pids = worker_pids(kc)
    km.restart_kernel(now=False)
    assert wait_gone(pids, within=30) == []


def test_kernel_shutdown_stops_workers(kernel, wait_gone):
    km, kc = kernel
    pids = worker_pids(kc)
    km.shutdown_kernel(now=False)
    assert wait_gone(pids, within=30) == []
