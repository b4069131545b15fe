"""The tests' Slurm cluster itself (tests/harness/slurm.py): a real Slurm 22.05 controller and two slurmd
containers come up with this host as the submit host, run a job step across both, and leave nothing."""

from __future__ import annotations

import os

import docker
import pytest
from harness.slurm import SLURM_LABEL, slurm_installed, start_slurm

pytestmark = pytest.mark.integration


NO_SLURM = "Slurm is not installed (scripts/install.sh dev installs slurmctld, slurmd, slurm-client, munge)"


@pytest.mark.skipif(not slurm_installed(), reason=NO_SLURM)
def test_a_two_node_cluster_runs_a_step_on_both_nodes_and_close_removes_it():
    with start_slurm(nodes=2) as cluster:
        result = cluster.run("srun", "-N2", "hostname", timeout=60)
        assert result.returncode == 0, result.stderr + cluster.logs()
        hostnames = result.stdout.split()
        assert sorted(hostnames) == sorted(n.name for n in cluster.nodes)
        assert len(set(hostnames)) == 2
        run_id = cluster.controller._container.labels[SLURM_LABEL]
        folder = cluster.folder
        munged = cluster._munged
    client = docker.from_env()
    try:
        assert client.containers.list(all=True, filters={"label": f"{SLURM_LABEL}={run_id}"}) == []
        assert client.networks.list(filters={"label": f"{SLURM_LABEL}={run_id}"}) == []
    finally:
        client.close()
    assert munged.poll() is not None
    assert not os.path.exists(folder)
