"""Real PyTorch: DDP with run_torch on two workers of two processes each (four ranks on two hosts) on
local processes, Docker containers and SSH hosts; a function's return value; %torchrun and %%torchrun
in a real IPython shell; a failing rank; a worker killed mid-run; Ctrl-C; ports never blocking."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from harness.fixtures import on
from harness.processes import agent_pid, kill_later, processes_running, time_all_gone, wait_until

import cmlcluster
from cmlcluster import ConfigError, Session, run_torch
from cmlcluster.pytorch import TorchError

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "worker_scripts" / "torch_ddp_train.py"


def check_ddp(result, world: int, n_hosts: int, epochs: int) -> None:
    assert result.ok, result.message
    assert sorted(result.output) == list(range(world))
    texts = {rank: "\n".join(lines) for rank, lines in result.output.items()}
    hosts = set()
    for rank, text in texts.items():
        placed = re.search(rf"rank {rank} of {world} on (\S+) \(cpu, gloo\)", text)
        assert placed, text
        hosts.add(placed.group(1))
        expected = world * (world - 1) // 2
        assert f"allreduce {expected} expected {expected}" in text  # the collective is right on every rank
    assert len(hosts) == n_hosts
    digests = {re.search(r"parameters (\w+)", text).group(1) for text in texts.values()}
    assert len(digests) == 1  # every rank applied the same averaged gradients
    losses = [float(loss) for loss in re.findall(r"epoch \d+ loss ([\d.]+)", texts[0])]
    assert len(losses) == epochs and losses[-1] < losses[0] / 5, losses


# Local processes and containers with their own IPs in the default run; SSH hosts and pods in the matrix
# tier: torch's rendezvous across addresses is the containers' case, and %horovod runs on both of those.
# DDP across two machines in the default run: run_torch across two Slurm nodes (test_slurm.py).
@pytest.mark.parametrize("backend", on("local"), indirect=True)
def test_ddp_on_two_workers_of_two_processes(session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    progress = []
    session.subscribe(lambda e: progress.append(e) if isinstance(e, cmlcluster.events.Progress) else None)
    result = run_torch(
        str(EXAMPLE),
        ["--epochs", "4", "--checkpoint-dir", "checkpoints"],  # in each worker's working folder
        nnodes=2,
        nproc_per_node=2,
        cpu=1,
        memory=1,
        session=session,
        echo=False,
        collect="checkpoints",  # from SSH hosts, which do not see this folder (containers and pods mount it)
    )
    one_host = session.backend.name == "local"
    check_ddp(result, world=4, n_hosts=1 if one_host else 2, epochs=4)
    assert result.master.startswith(result.hosts[0] + ":")
    assert [p.name for p in checkpoints.iterdir()] == ["snapshot.pt"]  # rank 0's, here on every backend
    assert torch.load(checkpoints / "snapshot.pt")["EPOCHS_RUN"] == 4
    # Rank 0's reports reached the session as progress, not as output.
    session.drain()
    assert [(p.task, p.step, p.total) for p in progress] == [("rank 0", e, 4) for e in range(1, 5)]
    assert not any("@cmlcluster-progress" in line for lines in result.output.values() for line in lines)
    # The run's workers are stopped, and nothing it started runs on.
    assert {w["status"] for w in session.list_workers()} == {"stopped"}
    wait_until(lambda: not processes_running(EXAMPLE), 5, "no rank left")


def test_a_function_returns_rank_0s_value(tmp_path):
    def allreduce(scale, offset=0):
        import os

        import torch
        import torch.distributed as dist

        from cmlcluster.pytorch import init_process_group

        init_process_group()
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return {"sum": value.item() * scale + offset, "world": int(os.environ["WORLD_SIZE"]), "rank": dist.get_rank()}

    with Session("local", echo=False) as session:
        result = run_torch(allreduce, (10,), kwargs={"offset": 1}, nproc_per_node=3, session=session, echo=False)
    assert result.ok, result.message
    assert result.value == {"sum": 61.0, "world": 3, "rank": 0}


LEAVES_GROUP = """
import atexit
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([1.0])
dist.all_reduce(value)
atexit.register(lambda: print("group at exit:", dist.is_initialized(), flush=True))
"""


def test_a_process_group_left_by_successful_code_is_destroyed_before_exit(tmp_path):
    # Left to interpreter exit, Gloo's threads aborted about one successful run in five (SIGABRT,
    # pytorch/pytorch#190489); atexit handlers run after rank.py's own end, so they see what it did.
    script = tmp_path / "leaves_group.py"
    script.write_text(LEAVES_GROUP)
    with Session("local", echo=False) as session:
        result = run_torch(str(script), nproc_per_node=2, session=session, echo=False)
    assert result.ok, result.message
    assert {rank: lines[-1:] for rank, lines in result.output.items()} == {
        0: ["group at exit: False"],
        1: ["group at exit: False"],
    }


def test_a_run_whose_ranks_finished_is_ok_whatever_their_interpreters_do_at_exit(tmp_path):
    # Gloo's threads abort ranks that finished while their interpreter finalizes (SIGABRT, "terminate
    # called without an active exception"): this script aborts there too, both ways it could.
    script = Path(__file__).parents[1] / "harness" / "aborts_at_exit.py"
    with Session("local", echo=False) as session:
        result = run_torch(str(script), [str(tmp_path / "log")], nproc_per_node=2, session=session, echo=False)
    assert result.ok, result.message
    # What Python's exit does still happened, in its order, and a file left open lost nothing.
    assert result.output == {rank: ["script finished", "thread finished", "atexit handler ran"] for rank in (0, 1)}
    assert [(tmp_path / f"log.{rank}").read_text() for rank in (0, 1)] == ["every line written"] * 2


def test_torchrun_cell_magic_in_a_real_ipython_shell(shell, capsys):
    # The line magic runs as the README shows it (test_readme_snippets.py), the cell magic in JupyterLab too
    # (tests/browser/test_stop_in_browser.py); here, --rank0-only.
    cell = "import torch.distributed as dist\ndist.init_process_group('gloo')\nprint('hello from', dist.get_rank())\n"
    result = shell.run_cell_magic("torchrun", "--nproc-per-node 2 --rank0-only", cell)
    assert result.ok, result.message
    assert result.output == {0: ["hello from 0"]}  # rank 1 ran, but only rank 0 was shown
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "hello from 1" not in out  # live, with its rank


FAILING = """
import sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} started", flush=True)
dist.barrier()
if rank == int(sys.argv[1]):
    print(f"failing at {time.time()}", flush=True)
    raise ValueError(f"the data shard of rank {rank} is corrupt")
dist.barrier()  # the others wait here for the failed rank
time.sleep(600)
"""


@pytest.mark.parametrize("backend_name", ["local", pytest.param("docker", marks=pytest.mark.matrix)])
def test_a_failing_rank_is_named_and_every_other_process_stopped(backend_name, tmp_path_factory, tmp_path):
    from harness.fixtures import backend_for

    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    with Session(backend_for(backend_name, str(tmp_path_factory.getbasetemp())), echo=False) as session:
        ranks_gone = time_all_gone(script)
        result = run_torch(str(script), ["2"], nnodes=2, nproc_per_node=2, session=session, echo=False)
        assert not result.ok
        failure = result.failure
        assert (failure.rank, failure.local_rank, failure.node_rank, failure.exit_code) == (2, 0, 1, 1)
        assert failure.host == result.hosts[1]
        assert failure.message == "ValueError: the data shard of rank 2 is corrupt"
        assert 'failing.py", line 10' in failure.traceback and "rank.py" not in failure.traceback
        assert "rank 2 (local rank 0 on node 1" in result.message and "corrupt" in result.message
        # Every rank was stopped after rank 2 failed: the others wait at a barrier and then sleep 600 s.
        wait_until(lambda: "at" in ranks_gone, 60, "no rank left")
        failed_at = float(re.search(r"failing at ([\d.]+)", "\n".join(result.output[2])).group(1))
        assert failed_at < ranks_gone["at"]
        assert sorted(w["status"] for w in session.list_workers()) == ["stopped", "stopped"]
        with pytest.raises(TorchError, match=r"rank 0 .* corrupt"):
            run_torch(str(script), ["0"], nproc_per_node=2, session=session, echo=False, check=True)


LONG = """
import time
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} training", flush=True)
dist.barrier()
time.sleep(600)
"""


@pytest.mark.parametrize("backend_name", ["local", pytest.param("docker", marks=pytest.mark.matrix)])
def test_a_worker_killed_mid_run_fails_it_and_stops_the_others(backend_name, tmp_path_factory, tmp_path):
    from harness.fixtures import backend_for

    script = tmp_path / "long.py"
    script.write_text(LONG)
    with Session(backend_for(backend_name, str(tmp_path_factory.getbasetemp())), echo=False) as session:
        killed = kill_later(
            lambda: len(processes_running(script)) >= 4,
            lambda: agent_pid(session.list_workers()[1]["id"]),
            "four ranks",
        )
        result = run_torch(str(script), nnodes=2, nproc_per_node=2, session=session, echo=False)
        assert "at" in killed and not result.ok and result.failure is None
        failure = result.worker_failure
        assert failure is not None and failure.exit_code == -9
        assert (failure.member.role, failure.member.index) == ("node", 1)
        assert "node task 1" in result.message and "exit code -9" in result.message
        wait_until(lambda: not processes_running(script), 10, "no rank left")


INTERRUPTED = """
import faulthandler, signal, sys
from cmlcluster import Session, run_torch
faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it waits, should it not end
# As in a terminal. This process may start with SIGINT ignored, and Python then keeps it so: a child
# inherits ignored signals, and the test's process ignores SIGINT and SIGQUIT while a C system() call
# runs in any of its threads (ci17, ci18: SigIgn 0x1001006, "SIG_IGN at start", and no KeyboardInterrupt).
signal.signal(signal.SIGINT, signal.default_int_handler)
with Session("local", echo=False) as session:
    run_torch(sys.argv[1], nnodes=2, nproc_per_node=1, session=session, echo=False)
"""


def test_ctrl_c_stops_every_process_and_the_next_run_is_not_blocked(tmp_path, wait_gone):
    script = tmp_path / "long.py"
    script.write_text(LONG)
    log = tmp_path / "session.log"
    with log.open("wb") as out:
        session = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(script)], stdout=out, stderr=out)
    try:
        ranks = wait_until(lambda: len(found := processes_running(script)) >= 2 and found, what="both ranks")
        session.send_signal(signal.SIGINT)
        try:
            assert session.wait(60) != 0  # a hang guard: it ends in seconds
        except subprocess.TimeoutExpired:
            # How the process stood with SIGINT (2: bit 1 of each mask): pending, blocked, ignored, caught.
            with open(f"/proc/{session.pid}/status") as f:
                fields = ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
                masks = "".join(line for line in f if line.startswith(fields))
            session.send_signal(signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError(
                f"Ctrl-C did not end it; its signal masks:\n{masks}its output and threads:\n{log.read_text()}"
            ) from None
    finally:
        session.kill()
        session.wait()
    assert wait_gone([p.pid for p in ranks], within=10) == []
    # torchrun's default port, taken: no run ever depends on it.
    with socket.socket() as taken:
        taken.bind(("", 29500))
        taken.listen()
        quick = tmp_path / "quick.py"
        quick.write_text("import torch.distributed as d\nd.init_process_group('gloo')\nprint(d.get_world_size())\n")
        result = run_torch(str(quick), nnodes=2, backend="local", echo=False)
    assert result.ok, result.message
    assert result.output == {0: ["2"], 1: ["2"]}


def test_bad_input_is_refused_before_anything_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    cases = [
        (dict(nnodes=0), "nnodes=0"),
        (dict(nproc_per_node=0), "nproc_per_node=0"),
        (dict(nproc_per_node=3, nvidia_gpu=2), "each process of a GPU job needs a GPU"),
        (dict(dist_backend="nccl"), "needs GPUs"),
        (dict(dist_backend="tcp"), "dist_backend='tcp'"),
        (dict(join_timeout=0), "join_timeout=0"),
        (dict(env={"A": 1}), "must be strings"),
        (dict(kwargs={"a": 1}), "kwargs= is for a function"),
        (dict(max_restarts=-1), "max_restarts=-1"),
    ]
    with Session("local", echo=False) as session:
        for options, message in cases:
            with pytest.raises(ConfigError, match=re.escape(message)):
                run_torch(str(script), session=session, echo=False, **options)
        with pytest.raises(ConfigError, match="no such file"):
            run_torch(str(tmp_path / "missing.py"), session=session, echo=False)
        with pytest.raises(ConfigError, match="list of strings"):
            run_torch(str(script), "--epochs 3", session=session, echo=False)
        # An elastic run's rendezvous is hosted here: without torch here, it is refused before anything starts.
        find_spec = importlib.util.find_spec

        def no_torch(name, *args):
            return None if name == "torch" else find_spec(name, *args)

        with mock.patch("importlib.util.find_spec", no_torch), pytest.raises(ConfigError, match="needs PyTorch here"):
            run_torch(str(script), max_restarts=1, session=session, echo=False)
        assert session.list_workers() == []


def test_a_node_that_cannot_reach_the_rendezvous_says_so(tmp_path):
    from cmlcluster.ports import free_ports

    report = tmp_path / "report.json"
    closed = free_ports(1)[0]  # nothing listens there
    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(closed), "x.py"]
    launch = [sys.executable, "-m", "cmlcluster.pytorch.launch", str(report), f"127.0.0.1:{closed}", "1", "--", *argv]
    started = time.monotonic()
    assert subprocess.run(launch, timeout=60).returncode == 1
    assert time.monotonic() - started < 30  # the join timeout (1 s) ended it, not torchrun's own (600 s)
    error = json.loads(report.read_text())["error"]
    assert error.startswith(f"the rendezvous was not reached: 127.0.0.1:{closed} did not accept connections within 1 s")
