"""Real Hugging Face Accelerate on the run skeleton: an Accelerate training script (its Accelerator,
prepare, backward, gather) on two workers, local processes and Docker containers with their own
addresses; Accelerate's own launch arguments reaching its processes; a worker killed mid-run replaced
(max_restarts, as for torch); %accelerate in a real IPython shell; bad arguments refused up front."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest
from harness.fixtures import on
from harness.processes import agent_pid, processes_running, wait_until

from cmlcluster import ConfigError, Session, run_accelerate
from cmlcluster.events import OutputLine

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "worker_scripts" / "accelerate_train.py"


def check_training(result, processes: int, n_hosts: int, epochs: int) -> None:
    assert result.ok, result.message
    assert sorted(result.output) == list(range(processes))
    texts = {rank: "\n".join(lines) for rank, lines in result.output.items()}
    hosts = {re.search(rf"process {rank} of {processes} on (\S+) DistributedType.MULTI_CPU", text).group(1)
             for rank, text in texts.items()}  # fmt: skip
    assert len(hosts) == n_hosts
    gathered = re.findall(r"epoch \d+ loss ([\d.]+) from (\d+) processes", texts[0])
    assert len(gathered) >= epochs and {n for _, n in gathered} == {str(processes)}  # gather() from every process
    assert float(gathered[-1][0]) < float(gathered[0][0]) / 5, gathered
    assert len(set(re.findall(r"parameters (\w+)", "\n".join(texts.values())))) == 1  # every process the same


# Containers with their own addresses in the default run; local workers run every other Accelerate test here.
@pytest.mark.parametrize("backend", on("docker"), indirect=True)
def test_accelerate_training_on_two_workers(session, backend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_accelerate(str(EXAMPLE), ["--epochs", "6"], num_machines=2, session=session, echo=False)
    check_training(result, processes=2, n_hosts=1 if backend == "local" else 2, epochs=6)
    assert result.master.split(":")[0] == result.hosts[0]  # the main process's address: machine 0's worker


def test_launch_arguments_reach_accelerates_processes_and_processes_per_machine():
    with Session("local", echo=False) as session:
        result = run_accelerate(
            str(EXAMPLE),
            ["--epochs", "2"],
            num_machines=2,
            num_processes=4,
            launch_args=["--mixed_precision", "bf16"],
            session=session,
            echo=False,
        )
    assert result.ok, result.message
    assert sorted(result.output) == [0, 1, 2, 3] and result.world_size == 4
    assert all("precision bf16" in lines[0] for lines in result.output.values())


# Accelerate's elastic runs are torchrun's (accelerate launch --max_restarts): the replacement of a lost worker is
# test_torch_elastic's in the default run; this one in the matrix tier.
@pytest.mark.matrix
def test_a_worker_killed_mid_run_is_replaced():
    with Session("local", echo=False) as session:
        killed: list[str] = []

        def on_event(event) -> None:  # machine 1's worker, once the main process has trained an epoch
            if isinstance(event, OutputLine) and "epoch 1 loss" in event.text and not killed:
                killed.append(session.list_workers()[1]["id"])
                pid = wait_until(lambda: agent_pid(killed[0]), 30, "the agent")
                threading.Thread(target=os.kill, args=(pid, signal.SIGKILL), daemon=True).start()

        session.subscribe(on_event)
        args = ["--epochs", "8", "--epoch-seconds", "0.5"]
        result = run_accelerate(str(EXAMPLE), args, num_machines=2, max_restarts=1, session=session, echo=False)
        assert result.ok, result.message
        assert killed and result.restarts == 1
        assert result.master.startswith(f"{session.controller_ip}:")  # the session hosts the rendezvous
    assert "epoch 7 loss" in "\n".join(result.output[0])
    wait_until(lambda: not processes_running(EXAMPLE), 10, "no process left")


def test_accelerate_magic_in_a_real_ipython_shell(shell, capsys):
    result = shell.run_line_magic("accelerate", f"--num-machines 2 --launch-args '--mixed_precision no' {EXAMPLE}")
    check_training(result, processes=2, n_hosts=1, epochs=5)
    assert "[rank 1] process 1 of 2" in capsys.readouterr().out  # live, rank by rank


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="--num_machines is the run's shape"):
        run_accelerate(str(EXAMPLE), launch_args=["--num_machines", "3"])
    with pytest.raises(ConfigError, match="DeepSpeed"):
        run_accelerate(str(EXAMPLE), launch_args=["--use_deepspeed"])
    with pytest.raises(ConfigError, match="num_processes=3 on num_machines=2"):
        run_accelerate(str(EXAMPLE), num_machines=2, num_processes=3)
    with pytest.raises(ConfigError, match="give the path of an Accelerate script"):
        run_accelerate(print)
