"""Real JAX on the run skeleton: a script written for Kubeflow's JAX runtime (a plain
jax.distributed.initialize()) trains with a psum across two workers on local processes and Docker
containers (each with its own address); a function's value from process 0; a failing process named
with its traceback and every worker stopped; %jaxrun and %%jaxrun in a real IPython shell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness.fixtures import on

from cmlcluster import ConfigError, JaxError, Session, run_jax

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "worker_scripts" / "jax_psum_train.py"


def check_training(result, processes: int, n_hosts: int) -> None:
    assert result.ok, result.message
    assert sorted(result.output) == list(range(processes))
    texts = {process: "\n".join(lines) for process, lines in result.output.items()}
    hosts = set()
    for process, text in texts.items():
        placed = re.search(rf"process {process} of {processes} on (\S+) devices (\d+) env (.*)", text)
        assert placed, text
        hosts.add(placed.group(1))
        assert f"'JAX_PROCESS_ID': '{process}'" in placed.group(3)  # Kubeflow's variables, as its runtime sets
        total, expected = re.search(r"psum of process ids (\d+) expected (\d+)", text).groups()
        assert total == expected  # the collective across processes is right on every one
    assert len(hosts) == n_hosts
    digests = {re.search(r"parameters (\w+)", text).group(1) for text in texts.values()}
    assert len(digests) == 1  # every process applied the same averaged gradients
    losses = [float(loss) for loss in re.findall(r"step \d+ loss ([\d.]+)", texts[0])]
    assert losses[-1] < losses[0] / 100, losses


# Containers with their own addresses in the default run; local workers run every other JAX test here.
@pytest.mark.parametrize("backend", on("docker"), indirect=True)
def test_psum_training_across_two_workers(session, backend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_jax(str(EXAMPLE), ["--steps", "30"], nnodes=2, session=session, echo=False)
    check_training(result, processes=2, n_hosts=1 if backend == "local" else 2)
    host, port = result.master.rsplit(":", 1)
    assert host == result.hosts[0] and int(port) > 0  # the coordinator, on process 0's worker


def test_a_function_returns_process_0s_value():
    def total(scale):
        import jax
        import jax.numpy as jnp

        jax.distributed.initialize()
        psum = jax.pmap(lambda x: jax.lax.psum(x, "p"), axis_name="p")
        value = psum(jnp.full((jax.local_device_count(),), float(jax.process_index() + 1)))[0]
        return {"sum": float(value) * scale, "process": jax.process_index(), "count": jax.process_count()}

    with Session("local", echo=False) as session:
        result = run_jax(total, (10,), nnodes=2, session=session, echo=False)
    assert result.ok, result.message
    assert result.value["process"] == 0 and result.value["count"] == 2
    assert result.value["sum"] == 30.0  # (1 + 2) x 10: the psum across both processes


def test_a_failing_process_is_named_and_every_worker_stopped():
    with Session("local", echo=False) as session:
        result = run_jax(str(EXAMPLE), ["--fail-process", "1"], nnodes=2, session=session, echo=False)
        assert not result.ok
        assert result.failed_rank == 1
        assert "RuntimeError: process 1 failed on purpose at step 5" in result.failure.message
        assert "jax_psum_train.py" in result.failure.traceback  # the user's frames, as python would show them
        assert all(w["status"] != "running" for w in session.list_workers())
        with pytest.raises(JaxError, match="process 0 failed on purpose"):
            run_jax(str(EXAMPLE), ["--fail-process", "0"], nnodes=2, session=session, echo=False, check=True)


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="nnodes=0"):
        run_jax(str(EXAMPLE), nnodes=0)
    with pytest.raises(ConfigError, match="kwargs= is for a function"):
        run_jax(str(EXAMPLE), kwargs={"a": 1})
    with pytest.raises(ConfigError, match="start_timeout=-1"):
        run_jax(str(EXAMPLE), start_timeout=-1)


def test_jaxrun_magics_in_a_real_ipython_shell(shell, capsys):
    result = shell.run_line_magic("jaxrun", f"--nnodes 2 {EXAMPLE} --steps 20")
    assert result.ok, result.message
    assert "[rank 1] process 1 of 2" in capsys.readouterr().out  # live, process by process
    cell = "\n".join(
        [
            "import jax",
            "jax.distributed.initialize()",
            "print('hello from', jax.process_index(), 'of', jax.process_count())",
        ]
    )
    result = shell.run_cell_magic("jaxrun", "--nnodes 2", cell)
    assert result.ok, result.message
    assert result.output == {0: ["hello from 0 of 2"], 1: ["hello from 1 of 2"]}
    with pytest.raises(ConfigError, match="not elastic"):
        shell.run_line_magic("jaxrun", f"--max-restarts 1 {EXAMPLE}")
