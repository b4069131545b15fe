"""In a real Jupyter kernel: interrupting a wait, restarting and shutting the kernel down."""

from __future__ import annotations

import contextlib
import json
import queue
import time

import psutil
import pytest
from harness.fixtures import DOCKER_TEST_IMAGE
from harness.kernels import running_kernel
from harness.processes import agents as all_agents
from harness.processes import running

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
    with running_kernel() as started:
        yield started


def test_a_test_kernels_channels_are_unix_sockets_of_its_own(kernel):
    """What keeps other tests' stray clients off its iopub (tests/harness/kernels.py). Its one TCP listener is
    ipykernel's pipe for its subprocesses' output, which drops a message that lacks the pipe's random id."""
    km, _ = kernel
    with open(km.connection_file) as f:
        info = json.load(f)
    channels = [info[f"{name}_port"] for name in ("shell", "iopub", "stdin", "control", "hb")]
    sockets = {c.laddr for c in psutil.Process(km.provisioner.pid).net_connections("unix") if c.laddr}
    assert info["transport"] == "ipc" and {f"{info['ip']}-{port}" for port in channels} <= sockets


def run(kc, code: str, timeout: float = 120) -> tuple[dict, str]:
    out = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    # After a cell ends in an error, ipykernel aborts the execute requests that reach it before
    # its own "stop aborting" marker does (kernelbase._abort_queues): a cell sent the moment the
    # error reply arrives can come back "aborted" without running. Jupyter's Run would send it again.
    for _ in range(10):
        reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        if reply["content"]["status"] != "aborted":
            break
        time.sleep(0.1)
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
    # Stopped here: the fixture kills the kernel, whose idle workers would then wait out their 10 s of silence.
    assert run(kc, "cdsw.stop_workers()")[0]["status"] == "ok"


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


# The tests read the workers' output from the cell's stream: the session shows itself as text there.
AS_TEXT = "import sys\nsys.modules['ipywidgets'] = None  # unimportable: text output, not the widget\n"

RUN_CLUSTER_FOREVER = (
    AS_TEXT
    + """
import pathlib, tempfile
import cmlcluster as cdsw
script = pathlib.Path(tempfile.mkdtemp(dir={shared!r})) / "forever.py"
script.write_text("def run(cluster, server, task_index):\\n    import time\\n    print('training', flush=True)\\n"
                  "    time.sleep(600)\\n")
cdsw.run_cluster(n_workers=2, n_ps=1, cpu=0.5, memory=1, worker_script=str(script))
"""
)

HOROVOD_FOREVER = (
    AS_TEXT
    + """
import pathlib, tempfile
import cmlcluster as cdsw
from cmlcluster.backends.docker.backend import DockerBackend
script = pathlib.Path(tempfile.mkdtemp(dir={shared!r})) / "forever.py"
script.write_text("import time\\nprint('training', flush=True)\\ntime.sleep(600)\\n")  # no collective: no TF
cdsw.use_backend(DockerBackend(image={image!r}, host_python=True, volumes={{{shared!r}: {shared!r}}}))
%load_ext cmlcluster
%horovod -np 2 --cpu 0.5 $script
"""
)


def interrupt_once_training(km, kc, code: str, expected: int) -> tuple[dict, str]:
    """Run `code`; once `expected` processes printed "training", interrupt the kernel.

    Returns the execute reply and everything the cell printed.
    """
    out = []
    msg_id = kc.execute(code)
    deadline = time.monotonic() + 180
    while "".join(out).count("training") < expected:
        assert time.monotonic() < deadline, f"the job never trained: {''.join(out)}"
        with contextlib.suppress(queue.Empty):
            msg = kc.get_iopub_msg(timeout=1)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    with contextlib.suppress(queue.Empty):
        while True:  # what came with it: the message saying what was stopped, the traceback
            msg = kc.get_iopub_msg(timeout=2)
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))
    return reply["content"], "".join(out)


def processes_of(name: str) -> list[int]:
    return [p.pid for p in running(name)]


def test_interrupt_during_run_cluster_stops_the_cluster_and_says_so(kernel, tmp_path, wait_gone):
    km, kc = kernel
    content, out = interrupt_once_training(km, kc, RUN_CLUSTER_FOREVER.format(shared=str(tmp_path)), 2)
    agents = [p.pid for p in all_agents()]
    assert content["ename"] == "KeyboardInterrupt", out
    assert "interrupted; the TensorFlow cluster's 3 workers were stopped" in out
    assert wait_gone(agents, within=15) == []
    content, out = run(kc, "print(sorted(w['status'] for w in cdsw.list_workers()))")
    assert out.strip() == "['stopped', 'stopped', 'stopped']", out


def test_interrupt_during_horovod_stops_horovodrun_ranks_and_workers(kernel, tmp_path_factory, wait_gone):
    km, kc = kernel
    shared = str(tmp_path_factory.getbasetemp())
    code = HOROVOD_FOREVER.format(shared=shared, image=DOCKER_TEST_IMAGE)
    content, out = interrupt_once_training(km, kc, code, 2)
    left = processes_of("forever.py") + processes_of("cmlcluster.horovod.driver")
    assert content["ename"] == "KeyboardInterrupt", out
    assert "interrupted; horovodrun and its ranks were stopped, the workers stopped" in out
    assert wait_gone(left, within=15) == []
    content, out = run(kc, "print(sorted(w['status'] for w in cdsw.list_workers()))")
    assert out.strip() == "['stopped', 'stopped']", out


SLEEPING_WORKERS = """
import cmlcluster as cdsw
ws = cdsw.launch_workers(2, cpu=0.5, memory=0.5, code="import time; time.sleep(600)")
ready = cdsw.await_workers(ws, wait_for_completion=False, timeout_seconds=60)
from cmlcluster.ui.attached import view_of
stop = view_of(cdsw.get_session()).latest.stop_button  # the cell's own view
print(stop.comm.comm_id, *[w["id"] for w in ws], *[cdsw.get_session().worker_pid(w) for w in ws])
"""

BUTTON = "print(stop.disabled, repr(stop.button_style), sorted(w['status'] for w in cdsw.list_workers()))"


def iopub_until_idle(kc, msg_id: str, timeout: float) -> list[dict]:
    """The cell's iopub messages up to its "idle" status (the kernel is then free for the next cell)."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            msg = kc.get_iopub_msg(timeout=1)
            if msg["parent_header"].get("msg_id") == msg_id:
                seen.append(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    return seen
    raise AssertionError(f"the cell never ended: {seen}")


def test_stop_button_clicked_while_await_workers_holds_the_cell_ends_it(kernel, wait_gone):
    _, kc = kernel
    content, out = run(kc, SLEEPING_WORKERS)
    assert content["status"] == "ok", out
    comm_id, first, second, *pids = out.split()
    pids = [int(p) for p in pids]
    msg_id = kc.execute("cdsw.await_workers(ws, wait_for_completion=True)")
    time.sleep(2)  # the cell waits; without the hook a click would queue behind it, for as long as it runs
    # What the browser sends for a click on an ipywidgets Button (the button's comm is its model).
    click = {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
    clicked = time.monotonic()
    kc.shell_channel.send(kc.session.msg("comm_msg", click))
    reply = {"parent_header": {}}
    with contextlib.suppress(queue.Empty):
        reply = kc.get_shell_msg(timeout=15)
    took = time.monotonic() - clicked
    assert reply["parent_header"].get("msg_id") == msg_id, "the cell did not end within 15 s of the click"
    shown = [m["content"] for m in iopub_until_idle(kc, msg_id, 10) if m["msg_type"] == "error"]
    labels = [f"w{worker.rpartition('-')[2]}" for worker in (first, second)]  # as the views name them
    message = f"stopped from the widget: workers {labels[0]}, {labels[1]} stopped"
    assert [(e["ename"], e["evalue"]) for e in shown] == [("StoppedFromWidget", message)]
    assert (reply["content"]["ename"], reply["content"]["evalue"]) == ("StoppedFromWidget", message)
    assert wait_gone(pids, within=0.1) == []  # stopped before the call raised
    assert took < 5, f"{took:.1f} s from the click to the cell's end"
    print(f"click -> workers stopped, cell ended: {took:.2f} s")
    content, out = run(kc, BUTTON)  # the kernel took the next cell; nothing left to stop: grey and disabled
    assert out.strip() == "True '' ['stopped', 'stopped']", out
