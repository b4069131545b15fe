"""What each node asks of its launcher: of Accelerate's own launch code, its arguments (the run's shape
is cmlcluster's, the rest the user's) and the environment its multi-GPU launcher gives processes, and
the launch arguments refused before anything starts; of a JAX process, Kubeflow's variables."""

from __future__ import annotations

import pytest

from cmlcluster import ConfigError
from cmlcluster.accelerate.launch import accelerate_env, launch_argv
from cmlcluster.accelerate.run import check_launch_args
from cmlcluster.jax.node import process_env

NODE = {"nnodes": 2, "nproc_per_node": 2, "node_rank": 1, "master_addr": "10.0.0.2", "cpu": True}


def test_the_runs_shape_and_the_users_arguments():
    argv = launch_argv({**NODE, "launch_args": ["--mixed_precision", "bf16"]})
    assert argv[:2] == ["--mixed_precision", "bf16"]
    assert "--dynamo_backend" in argv and argv.count("--mixed_precision") == 1  # the user's, not the default
    shape = dict(zip(argv[-11:-1:2], argv[-10:-1:2], strict=True))
    assert shape == {
        "--num_machines": "2",
        "--num_processes": "4",
        "--machine_rank": "1",
        "--main_process_ip": "10.0.0.2",
        "--main_process_port": "0",
    }
    assert "--multi_gpu" in argv
    assert "--multi_gpu" not in launch_argv({**NODE, "launch_args": ["--use_fsdp"]})  # FSDP has its own mode


def test_accelerates_environment_for_cpu_processes():
    env = accelerate_env({**NODE, "launch_args": ["--mixed_precision", "bf16"]})
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_USE_CPU"] == "true"  # Gloo across machines, no GPUs
    assert not {"MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"} & set(env)
    assert "ACCELERATE_USE_CPU" not in accelerate_env({**NODE, "cpu": False, "launch_args": []})


@pytest.mark.parametrize(
    ("launch_args", "message"),
    [
        (["--num_processes", "8"], "--num_processes is the run's shape"),
        (["--main_process_ip=1.2.3.4"], "--main_process_ip is the run's shape"),
        (["--use_deepspeed"], "DeepSpeed's launcher is not supported"),
        ("--mixed_precision bf16", "give a list of strings"),
    ],
)
def test_launch_arguments_refused(launch_args, message):
    with pytest.raises(ConfigError, match=message):
        check_launch_args(launch_args)


def test_a_jax_process_gets_kubeflows_variables_and_its_coordinator_on_one_address():
    env = process_env(3, 2, "10.0.0.5:1234", cpu=True)
    assert env["JAX_COORDINATOR_ADDRESS"] == env["JAX_COORDINATOR_BIND_ADDRESS"] == "10.0.0.5:1234"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("3", "2")
    assert env["CMLCLUSTER_JAX_CPU_COLLECTIVES"] == "gloo"
    assert "CMLCLUSTER_JAX_CPU_COLLECTIVES" not in process_env(3, 2, "10.0.0.5:1234", cpu=False)
