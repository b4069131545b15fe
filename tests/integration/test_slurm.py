"""The slurm backend against a real Slurm 22.05 cluster (tests/harness/slurm.py: a controller and two
slurmd containers, this host the submit host, or a login node reached over SSH): a launch is one job that
Slurm places whole by its workers' cores, memory and GPUs, one that does not fit waits with Slurm's reason,
a job cancelled from outside is "stopped", and nothing of a session stays in Slurm's queue."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness.processes import running, wait_until
from harness.slurm import slurm_installed

from cmlcluster import ConfigError, Session
from cmlcluster.backends.slurm import commands
from cmlcluster.backends.slurm.backend import SlurmBackend
from cmlcluster.wire import CONNECTION_ENV

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not slurm_installed(), reason="Slurm is not installed (scripts/install.sh dev)"),
]


@pytest.fixture
def slurm(slurm_cluster):
    return slurm_cluster  # the run's (harness/fixtures.py): a controller and two nodes of 2 cores and 2 GPUs


def session_jobs(cluster, session) -> list[str]:
    """The lines squeue shows for the session's jobs, in any state but ended."""
    listed = cluster.run("squeue", "-h", "-o", "%j %T", check=True).stdout.splitlines()
    return [line for line in listed if line.startswith(f"cmlcluster-{session.id}-")]


def up(session, workers, timeout=60):
    ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=timeout)
    assert ready["failures"] == [], ready["failures"]
    return ready["workers"]


def test_a_launch_is_one_gang_job_slurm_places_whole_or_not_at_all_and_says_why_it_waits(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        [first] = up(session, session.launch_workers(1, cpu=2, memory=0.5))  # a job of its own, a node taken
        assert first["ip_address"] in {n.ip for n in slurm.nodes}
        assert session.call(first, "os:getenv", "CUDA_VISIBLE_DEVICES") == ""  # no GPU asked for
        # Two whole-node workers: one node is free, but the launch waits for both (jobs of their own would
        # have started one of them, to wait for the other with a half-started distributed job).
        pair = session.launch_workers(2, cpu=2, memory=0.5)
        late = session.await_workers(pair, wait_for_completion=False, timeout_seconds=6)
        assert [f["status"] for f in late["failures"]] == ["timedout", "timedout"]
        assert all("PENDING (Resources)" in f["message"] for f in late["failures"]), late["failures"]
        queued = [w for w in session.list_workers() if w["id"] != first["id"]]
        assert {w["status"] for w in queued} == {"scheduling"}
        assert all(w["message"].startswith("Slurm job ") and "PENDING (Resources)" in w["message"] for w in queued)
        session.stop_workers(first)
        # Its place is free now: Slurm starts the pair, a node each, one job, each worker a step of it.
        both = up(session, pair)
        assert {w["ip_address"] for w in both} == {n.ip for n in slurm.nodes}
        [gang_job] = {session.call(w, "os:getenv", "SLURM_JOB_ID") for w in both}
        steps = {session.call(w, "os:getenv", "SLURM_STEP_ID") for w in both}
        assert len(steps) == 2, steps
        assert session_jobs(slurm, session) == [f"cmlcluster-{session.id}-gang-{both[0]['id']} RUNNING"]

        # One of them stopped: the other runs on in the gang's job; the last one's end cancels the job.
        session.stop_workers(both[0])
        assert session.call(both[1], "os:getenv", "SLURM_JOB_ID") == gang_job
        assert len(session_jobs(slurm, session)) == 1
        session.stop_workers(both[1])
        wait_until(lambda: session_jobs(slurm, session) == [], timeout=10)

        # The gang's job cancelled from outside: each of its workers is stopped, with Slurm's words.
        again = up(session, session.launch_workers(2, cpu=1, memory=0.25))
        [job_id] = {session.call(w, "os:getenv", "SLURM_JOB_ID") for w in again}
        slurm.run("scancel", job_id, check=True)
        ids = {w["id"] for w in again}
        wait_until(lambda: {w["status"] for w in session.list_workers() if w["id"] in ids} == {"stopped"}, timeout=30)
        for w in session.list_workers():
            if w["id"] in ids:
                assert f"Slurm ended its job {job_id}: CANCELLED" in w["message"], w


def test_a_gang_that_could_never_run_is_refused_before_anything_starts_and_slurms_refusal_is_told(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        # Each worker fits a node, but three whole nodes do not exist: the gang would wait for ever.
        with pytest.raises(ConfigError, match=r"holds at most 2 of them: launch fewer, .* or give gang=False"):
            session.launch_workers(3, cpu=2, memory=0.5)
        assert session.list_workers() == [] and session_jobs(slurm, session) == []
        # With gang=False they are jobs of their own: two run, the third waits for a place.
    with Session(SlurmBackend(slurm_conf=slurm.conf, gang=False), echo=False) as session:
        session.launch_workers(3, cpu=2, memory=0.5)

        def statuses():
            return sorted(w["status"] for w in session.list_workers())

        wait_until(lambda: statuses() == ["running", "running", "scheduling"], timeout=60, what="two running")
        running = [w for w in session.list_workers() if w["status"] == "running"]
        assert len({session.call(w, "os:getenv", "SLURM_JOB_ID") for w in running}) == 2
    # What Slurm itself refuses (a node feature it does not know, here) fails the launch's workers in its words.
    with Session(SlurmBackend(slurm_conf=slurm.conf, extra=["--constraint=nosuchfeature"]), echo=False) as session:
        launched = session.launch_workers(2, cpu=1, memory=0.25)
        assert [w["status"] for w in launched] == ["failed"] * 2, launched
        assert all("Slurm did not grant" in w["message"] and "feature" in w["message"] for w in launched), launched
        assert session.list_workers() == [] and session_jobs(slurm, session) == []


def test_a_job_cancelled_outside_is_stopped_and_a_gpu_worker_sees_its_own_gpu(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        [worker] = up(session, session.launch_workers(1, cpu=1, memory=0.5, nvidia_gpu=1))
        assert session.call(worker, "os:getenv", "CUDA_VISIBLE_DEVICES") == "0"
        job_id = session.call(worker, "os:getenv", "SLURM_JOB_ID")
        assert slurm.run("scancel", job_id, check=True).returncode == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            [now] = session.list_workers()
            if now["status"] != "running":
                break
            time.sleep(0.2)
        assert now["status"] == "stopped", now
        assert f"Slurm ended its job {job_id}: CANCELLED" in now["message"], now["message"]
        assert session_jobs(slurm, session) == []


AGENT = ["-m", "cmlcluster.agent"]


def node_agent_pid(worker_id: str) -> int | None:
    """The pid of a worker's agent on its node (a node container's process, seen from here); not its srun
    here nor its launcher there (task.py), whose command lines and environments name the agent too."""
    for process in running("cmlcluster.agent"):
        try:
            environ, argv = process.environ(), process.cmdline()
        except psutil.Error:
            continue
        if environ.get("CDSW_ENGINE_ID") == worker_id and "SLURM_JOB_ID" in environ and argv[1:3] == AGENT:
            return process.pid
    return None


def test_a_worker_whose_agent_dies_on_its_node_fails_with_its_exit_code(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        [worker] = up(session, session.launch_workers(1, cpu=1, memory=0.5))
        os.kill(wait_until(lambda: node_agent_pid(worker["id"]), 30, "its agent"), signal.SIGKILL)
        done = session.await_workers([worker], timeout_seconds=30)
        [failed] = done["failures"]
        assert failed["status"] == "failed" and failed["exit_code"] == -9, failed
        assert "CANCELLED" not in failed["message"], failed["message"]


def test_a_program_runs_on_a_node_and_its_output_comes_home(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        code = "import socket; print('hello from', socket.gethostname())"
        workers = session.launch_workers(1, cpu=1, memory=0.5, code=code)
        done = session.await_workers(workers, wait_for_completion=True, timeout_seconds=60)
        assert done["failures"] == [], done["failures"]
        said = session.output(workers[0])
        assert any(f"hello from {n.name}" in said for n in slurm.nodes), said
    assert session_jobs(slurm, session) == []


SESSION_SCRIPT = """
import json, sys, time
from cmlcluster import Session
from cmlcluster.backends.slurm.backend import SlurmBackend
options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
session = Session(SlurmBackend(slurm_conf=sys.argv[1], **options), echo=False)
workers = session.launch_workers(2, cpu=1, memory=0.5)
ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
assert not ready["failures"], ready["failures"]
print(session.id, flush=True)
time.sleep(600)
"""


def test_a_killed_session_leaves_no_job_and_no_srun(slurm, tmp_path):
    script = tmp_path / "session.py"
    script.write_text(SESSION_SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), slurm.conf], stdout=subprocess.PIPE, text=True)
    try:
        session_id = process.stdout.readline().strip()
        assert session_id, "the session did not start its workers"
        prefix = f"cmlcluster-{session_id}-"
        assert [j for j in queued(slurm) if j.startswith(prefix)] == [f"{prefix}gang-{session_id}-0"]  # the launch's
        process.kill()  # as a kernel killed outright: no close(), no atexit
        process.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and ([j for j in queued(slurm) if j.startswith(prefix)] or mine(prefix)):
            time.sleep(0.2)
        assert [j for j in queued(slurm) if j.startswith(prefix)] == []
        assert mine(prefix) == []  # its srun processes here
    finally:
        if process.poll() is None:
            process.kill()


def test_cleanup_cancels_exactly_the_jobs_of_sessions_whose_process_is_gone(slurm):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, host = gone.stdout.strip(), socket.gethostname()
    jobs = {
        "cmlcluster-deadsession-w0": commands.job_comment("deadsession", host, int(dead_pid)),
        "cmlcluster-livesession-w0": commands.job_comment("livesession", host, os.getpid()),
        "cmlcluster-elsewhere-w0": commands.job_comment("elsewhere", "another-host", int(dead_pid)),
        "someones-job": "",
    }
    for name, comment in jobs.items():
        submit = ["sbatch", "--parsable", f"--job-name={name}", "--mem=50", "--wrap", "sleep 300"]
        slurm.run(*submit, *([f"--comment={comment}"] if comment else []), check=True)
    try:
        would = SlurmBackend.cleanup(True, {"slurm_conf": slurm.conf})  # dry run: says, cancels nothing
        assert len(would) == 1 and "cmlcluster-deadsession-w0" in queued(slurm)
        ended = SlurmBackend.cleanup(False, {"slurm_conf": slurm.conf})
        assert len(ended) == 1 and "(cmlcluster-deadsession-w0)" in ended[0]
        deadline = time.monotonic() + 10
        while "cmlcluster-deadsession-w0" in queued(slurm) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(queued(slurm)) >= {"cmlcluster-livesession-w0", "cmlcluster-elsewhere-w0", "someones-job"}
        assert "cmlcluster-deadsession-w0" not in queued(slurm)
    finally:
        for name in jobs:
            slurm.run("scancel", f"--name={name}")


def queued(cluster) -> list[str]:
    """The names of the jobs in Slurm's queue (pending or running)."""
    return cluster.run("squeue", "-h", "-o", "%j", check=True).stdout.split()


def mine(marker: str) -> list[int]:
    """Processes of this machine whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_run_torch_trains_across_two_slurm_nodes_and_its_checkpoint_comes_home(slurm, tmp_path, monkeypatch):
    from cmlcluster import run_torch

    monkeypatch.chdir(tmp_path)
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        result = run_torch(
            str(TORCH_EXAMPLE),
            ["--epochs", "2", "--checkpoint-dir", "checkpoints"],  # in each worker's own folder on its node
            nnodes=2,
            nproc_per_node=1,
            cpu=2,  # a whole node each
            memory=1,
            session=session,
            echo=False,
            collect="checkpoints",  # no file system is shared with the nodes: it comes home through the agent
        )
        assert result.ok, result.message
        assert sorted(result.hosts) == sorted(n.ip for n in slurm.nodes)
        assert result.master.split(":")[0] in result.hosts
        assert (tmp_path / "checkpoints" / "snapshot.pt").exists()
        assert session_jobs(slurm, session) == []


TORCH_EXAMPLE = Path(__file__).resolve().parents[2] / "worker_scripts" / "torch_ddp_train.py"


@pytest.mark.matrix  # frameworks across Slurm nodes in the default run: run_torch, above
def test_a_tensorflow_cluster_and_horovod_run_across_slurm_nodes(slurm, monkeypatch):
    import warnings

    from cmlcluster import SharedMachineWarning, run_cluster, run_horovod

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedMachineWarning)
        spec, address = run_cluster(n_workers=1, n_ps=1, cpu=2, memory=1, session=session)
        hosts = {a.split(":")[0] for tasks in spec.values() for a in tasks}
        assert hosts == {n.ip for n in slurm.nodes} and address == f"grpc://{spec['worker'][0]}"
        session.stop_workers()
        # Horovod's sshd on port 2222 in each worker's job: a whole node each, so no two share the port.
        result = run_horovod(
            "worker_scripts/horovod_keras_train.py", ["--epochs", "1"], np=2, workers=2, cpu=2, memory=1,
            session=session, echo=False,
        )  # fmt: skip
        assert result.ok, result.message
        assert sorted(h for h, _ in result.hosts) == sorted(n.ip for n in slurm.nodes)
        assert session_jobs(slurm, session) == []


@pytest.mark.matrix  # frameworks across Slurm nodes in the default run: run_torch, above
def test_an_elastic_torch_run_replaces_a_job_killed_on_its_node_and_trains_on(slurm, monkeypatch, tmp_path):
    from test_torch_elastic import ARGS, EPOCHS, Killer

    from cmlcluster import run_torch

    class NodeKiller(Killer):
        def kill(self, worker_id: str) -> None:  # kill -9 of the worker's agent on its node
            os.kill(wait_until(lambda: node_agent_pid(worker_id), 30, f"worker {worker_id}'s agent"), signal.SIGKILL)

    monkeypatch.chdir(tmp_path)
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        killer = NodeKiller(session, [lambda workers: workers[1]])
        result = run_torch(
            str(TORCH_EXAMPLE), ARGS, nnodes=2, max_restarts=1, cpu=2, memory=1, session=session, echo=False
        )
        assert result.ok, result.message
        assert result.restarts == 1 and killer.replaced == 1
        assert [w["status"] for w in session.list_workers()] == ["stopped", "failed", "stopped"]
        assert session_jobs(slurm, session) == []
    text = "\n".join(result.output[0])
    assert re.search(r"resumed after epoch \d+ from rank \d's snapshot", text) and f"epoch {EPOCHS} loss" in text


@pytest.mark.matrix  # frameworks across Slurm nodes in the default run: run_torch, above
def test_jax_and_accelerate_train_across_two_slurm_nodes(slurm, monkeypatch, tmp_path):
    from test_accelerate import EXAMPLE as ACCELERATE_EXAMPLE
    from test_accelerate import check_training as check_accelerate
    from test_jax import EXAMPLE as JAX_EXAMPLE
    from test_jax import check_training as check_jax

    from cmlcluster import run_accelerate, run_jax

    monkeypatch.chdir(tmp_path)
    whole_nodes = {"cpu": 2, "memory": 1}  # one worker a node: two addresses
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        jax = run_jax(str(JAX_EXAMPLE), ["--steps", "30"], nnodes=2, session=session, echo=False, **whole_nodes)
        check_jax(jax, processes=2, n_hosts=2)
        accelerate = run_accelerate(
            str(ACCELERATE_EXAMPLE), ["--epochs", "6"], num_machines=2, session=session, echo=False, **whole_nodes
        )
        check_accelerate(accelerate, processes=2, n_hosts=2, epochs=6)
        assert sorted(accelerate.hosts) == sorted(n.ip for n in slurm.nodes)
        assert session_jobs(slurm, session) == []


ALLOCATION_SCRIPT = """
import json, os, socket
from cmlcluster import ConfigError, Session
from cmlcluster.backends.slurm.backend import SlurmBackend

backend = SlurmBackend()  # inside the allocation this script runs in: SLURM_JOB_ID says so
with Session(backend, echo=False) as session:
    workers = session.launch_workers(2, cpu=1, memory=0.25)
    ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
    found = {
        "allocation": backend.allocation,
        "failures": [f.get("message") for f in ready["failures"]],
        "ips": [w["ip_address"] for w in ready["workers"]],
        "jobs": [session.call(w, "os:getenv", "SLURM_JOB_ID") for w in ready["workers"]],
        "steps": [session.call(w, "os:getenv", "SLURM_STEP_ID") for w in ready["workers"]],
        "session": socket.gethostname(),
    }
    session.stop_workers()
    found["after"] = [w["status"] for w in session.list_workers()]
print("RESULT " + json.dumps(found), flush=True)
"""


def test_a_notebook_inside_an_allocation_runs_its_workers_as_steps_of_it(slurm):
    script = os.path.join(slurm.folder, "notebook.py")  # the nodes see the cluster's folder
    with open(script, "w") as f:
        f.write(ALLOCATION_SCRIPT)
    output = os.path.join(slurm.folder, "notebook-%j.out")
    submitted = slurm.run(
        "sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "--mem=1500",
        f"--output={output}", "--wrap", f"{sys.executable} {script}", check=True,
    )  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job in slurm.run("squeue", "-h", "-o", "%i", check=True).stdout.split():
        time.sleep(0.5)
    with open(output.replace("%j", job)) as f:
        said = f.read()
    results = [line for line in said.splitlines() if line.startswith("RESULT ")]
    assert results, said
    found = json.loads(results[-1].removeprefix("RESULT "))
    assert found["allocation"] == job and found["failures"] == [], found
    assert found["jobs"] == [job, job]  # steps of the notebook's own job, not jobs of their own
    assert len(set(found["steps"])) == 2 and set(found["ips"]) <= {n.ip for n in slurm.nodes}
    assert found["after"] == ["stopped", "stopped"]


def test_a_worker_is_warned_before_its_time_limit_so_that_it_can_checkpoint(slurm):
    code = """
import signal, time
warned = []
signal.signal(signal.SIGUSR1, lambda *_: warned.append(time.monotonic()))
deadline = time.monotonic() + 120
while not warned and time.monotonic() < deadline:
    time.sleep(0.1)
print("warned, checkpointing" if warned else "never warned", flush=True)
"""
    # A minute's limit, warned 55 s before it (Slurm checks time limits about every 30 s, and may warn early).
    backend = SlurmBackend(slurm_conf=slurm.conf, time_limit=1, signal_before_end=55)
    with Session(backend, echo=False) as session:
        workers = session.launch_workers(1, cpu=1, memory=0.25, code=code)
        done = session.await_workers(workers, wait_for_completion=True, timeout_seconds=90)
        assert done["failures"] == [], done["failures"]
        assert "warned, checkpointing" in session.output(workers[0])


def test_gpu_workers_get_gpus_of_their_own_and_one_more_waits_for_a_gpu(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        both = up(session, session.launch_workers(2, cpu=1, memory=0.25, nvidia_gpu=2))  # a node's 2 GPUs each
        assert {w["ip_address"] for w in both} == {n.ip for n in slurm.nodes}
        assert [session.call(w, "os:getenv", "CUDA_VISIBLE_DEVICES") for w in both] == ["0,1", "0,1"]
        # A core is free on each node, no GPU is: it waits for one.
        late = session.await_workers(
            session.launch_workers(1, cpu=1, memory=0.25, nvidia_gpu=1), wait_for_completion=False, timeout_seconds=5
        )
        assert "PENDING (Resources)" in late["failures"][0]["message"], late["failures"][0]["message"]
        session.stop_workers()
        assert session_jobs(slurm, session) == []
        # Four workers of one GPU, one gang job: a GPU id each, the two on a node told apart.
        four = up(session, session.launch_workers(4, cpu=0.5, memory=0.25, nvidia_gpu=1))
        seen: dict[str, set[str]] = {}
        for w in four:
            seen.setdefault(w["ip_address"], set()).add(session.call(w, "os:getenv", "CUDA_VISIBLE_DEVICES"))
        assert seen == {n.ip: {"0", "1"} for n in slurm.nodes}, seen
        session.stop_workers()
        assert session_jobs(slurm, session) == []


LOGIN_USER_LINE = "alice:x:1000:1000:alice:/tmp:/bin/sh"  # the test hosts' user: Slurm runs her tasks as her


def test_a_notebook_that_reaches_slurm_only_over_ssh_runs_its_workers_through_a_login_node(slurm, tmp_path):
    from harness.sshhosts import start_hosts

    # This process's Slurm out of the backend's reach: ssh alone on its PATH.
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "ssh").symlink_to(shutil.which("ssh"))
    os.chmod(slurm.folder, 0o755)  # the login node's user reads slurm.conf there and talks to munged
    for member in [slurm.controller, *slurm.nodes]:  # the controller signs her steps' credentials
        member.exec("sh", "-c", f"grep -q '^alice:' /etc/passwd || echo '{LOGIN_USER_LINE}' >> /etc/passwd")
    with start_hosts(1, network=slurm.network, volumes=[f"{slurm.folder}:{slurm.folder}:ro"]) as hosts:
        [login] = hosts.hosts
        with mock_path(str(bare)):  # what the backend runs Slurm's commands and ssh with
            backend = SlurmBackend(
                slurm_conf=slurm.conf,
                login=f"{hosts.user}@{login.ip}",
                identity=hosts.identity_file,
                known_hosts=hosts.known_hosts,
            )
        with Session(backend, echo=False) as session:
            code = "import os, socket; print('on', socket.gethostname(), 'as', os.getuid(), os.environ['SLURM_JOB_ID'])"
            workers = session.launch_workers(2, cpu=1, memory=0.25, code=code)
            done = session.await_workers(workers, wait_for_completion=True, timeout_seconds=60)
            assert done["failures"] == [], [f["message"] for f in done["failures"]]
            said = [session.output(w).strip() for w in workers]
            assert all(re.fullmatch(r"on slurm-\w+-n\d as 1000 \d+", line) for line in said), said
            assert len({line.split()[-1] for line in said}) == 1  # one gang job, submitted as alice there
            # A worker that keeps running is stopped through the login node, its job cancelled.
            [worker] = up(session, session.launch_workers(1, cpu=1, memory=0.25))
            owners = slurm.run("squeue", "-h", "-o", "%j %U", check=True).stdout.split("\n")
            assert f"cmlcluster-{session.id}-{worker['id']} 1000" in owners, owners  # alice's
            # The worker's connection (its keys) went over ssh's input, never on a command line there.
            connection = session._supervisor.control.agent_env()[CONNECTION_ENV]
            listed = login.processes()
            assert any("srun" in line for line in listed) and not [p for p in listed if connection in p]
            session.stop_workers(worker)
            assert session_jobs(slurm, session) == []

        # A session killed outright: its connections end, and with them, on the login node, its jobs.
        script = tmp_path / "session.py"
        script.write_text(SESSION_SCRIPT)
        options = {"login": f"{hosts.user}@{login.ip}", "identity": hosts.identity_file}
        options["known_hosts"] = hosts.known_hosts
        argv = [sys.executable, str(script), slurm.conf, json.dumps(options)]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            prefix = f"cmlcluster-{process.stdout.readline().strip()}-"
            assert len(prefix) > len("cmlcluster--") and [j for j in queued(slurm) if j.startswith(prefix)]
            process.kill()
            process.wait()
            wait_until(lambda: not [j for j in queued(slurm) if j.startswith(prefix)], timeout=15, what="no job")
            wait_until(lambda: not mine(login.ip), timeout=15, what="no ssh here")  # ssh's command lines name it
            assert not [p for p in login.processes() if "srun" in p or "cmlcluster" in p]
        finally:
            if process.poll() is None:
                process.kill()


@contextlib.contextmanager
def mock_path(folder):
    saved = os.environ["PATH"]
    os.environ["PATH"] = folder
    try:
        yield
    finally:
        os.environ["PATH"] = saved
