"""The pure parts of a PyTorch run: processes per node, the process-group backend, torchrun's argv
(static and elastic), rank labels (across an elastic run's rounds too), and torchrun's failures as
the session gets them (from torch's own ChildFailedError)."""

from __future__ import annotations

import json

import pytest

from cmlcluster import ConfigError
from cmlcluster.pytorch import commands
from cmlcluster.pytorch.launch import failures_of
from cmlcluster.runs.nodes import check_script_args, parse_rank_line


def test_processes_per_node_follow_the_gpus_unless_given():
    assert commands.nproc_for("auto", 0) == 1
    assert commands.nproc_for("auto", 4) == 4
    assert commands.nproc_for(3, 0) == 3
    assert commands.nproc_for(2, 4) == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=f"nproc_per_node={bad!r}"):
            commands.nproc_for(bad, 0)
    with pytest.raises(ConfigError, match="needs a GPU of its own"):
        commands.nproc_for(3, 2)


def test_nccl_on_gpus_gloo_on_cpus_unless_named():
    assert commands.dist_backend_for(None, 0) == "gloo"
    assert commands.dist_backend_for(None, 1) == "nccl"
    assert commands.dist_backend_for("gloo", 2) == "gloo"
    with pytest.raises(ConfigError, match="needs GPUs"):
        commands.dist_backend_for("nccl", 0)
    with pytest.raises(ConfigError, match="'tcp': give one of gloo, nccl"):
        commands.dist_backend_for("tcp", 0)


def test_threads_share_out_the_workers_cores():
    assert commands.threads_per_process(4, 2) == 2
    assert commands.threads_per_process(1, 4) == 1
    assert commands.threads_per_process(0.5, 1) == 1


def test_torchrun_argv_is_a_static_rendezvous_at_worker_0():
    argv = commands.torchrun_args(
        nnodes=3,
        node_rank=2,
        nproc_per_node=4,
        master_addr="10.0.0.2",
        master_port=41234,
        join_timeout=90,
        log_dir="/tmp/x/logs",
        entry=["/opt/cmlcluster/pytorch/rank.py", "train.py", "--lr", "0.1"],
    )
    options = dict(zip(argv[:-4:2], argv[1:-4:2], strict=True))
    assert options == {
        "--nnodes": "3",
        "--node-rank": "2",
        "--nproc-per-node": "4",
        "--master-addr": "10.0.0.2",
        "--master-port": "41234",
        "--rdzv-conf": "timeout=90",
        "--max-restarts": "0",
        "--tee": "3",
        "--log-dir": "/tmp/x/logs",
    }
    assert argv[-4:] == ["/opt/cmlcluster/pytorch/rank.py", "train.py", "--lr", "0.1"]
    # torchrun's own parser reads it as meant.
    from torch.distributed.run import parse_args

    parsed = parse_args(argv)
    assert (parsed.nnodes, parsed.node_rank, parsed.nproc_per_node) == ("3", 2, "4")
    assert (parsed.master_addr, parsed.master_port, parsed.rdzv_backend) == ("10.0.0.2", 41234, "static")
    assert not parsed.module and parsed.training_script == "/opt/cmlcluster/pytorch/rank.py"
    assert parsed.training_script_args == ["train.py", "--lr", "0.1"]


def test_elastic_torchrun_argv_joins_the_sessions_store_as_a_client_and_waits_for_every_node(monkeypatch):
    argv = commands.elastic_torchrun_args(
        nnodes=3,
        nproc_per_node=2,
        endpoint="10.0.0.1:41234",
        local_addr="10.0.0.7",
        max_restarts=2,
        join_timeout=90,
        log_dir="/tmp/x/logs",
        entry=["/opt/cmlcluster/pytorch/rank.py", "train.py", "--lr", "0.1"],
    )
    run_id = f"cmlcluster-{'ab' * 16}"
    env = commands.elastic_env(run_id, "cd" * 32)
    assert not any(run_id in a or "cd" * 32 in a or "rdzv-id" in a or "rdzv_id" in a for a in argv)  # ps shows argv
    # torchrun's own parser and its config, as torchrun builds them (it sets OMP_NUM_THREADS when unset).
    from torch.distributed.run import config_from_args, parse_args

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config, _, args = config_from_args(parse_args(argv))
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (3, 3, 2, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("cmlcluster", "10.0.0.1:41234", run_id)
    assert config.local_addr == "10.0.0.7"  # MASTER_ADDR when this node is rank 0's, not its hostname
    assert config.rdzv_configs["is_host"] == "false"  # nodes come and go; the store stays in the session
    assert (config.rdzv_configs["join_timeout"], config.rdzv_configs["keep_alive_interval"]) == ("90", "1")
    assert args == ["-u", "/opt/cmlcluster/pytorch/rank.py", "train.py", "--lr", "0.1"]


def test_teed_lines_get_their_global_rank():
    teed = commands.TeedLines(node_rank=2, nproc_per_node=4)
    assert teed.feed("[default1]:loss 0.5") == [(9, "loss 0.5")]
    assert teed.feed("[default0]:") == [(8, "")]
    warning = "W1122 torch/distributed/run.py:874] warning"
    assert teed.feed(warning) == [(None, warning)]
    assert teed.flush() == []
    assert parse_rank_line("[rank 9] loss 0.5") == (9, "loss 0.5")
    assert parse_rank_line("[rank 9]loss") is None
    assert parse_rank_line("epoch 3") is None


def test_a_line_torchrun_read_in_parts_is_put_back_together():
    # torchrun's tail thread puts its header before each part it read: seen in CI, an unbuffered print's
    # text and newline arrived as "[default1]:script finished[default1]:".
    teed = commands.TeedLines(node_rank=0, nproc_per_node=2)
    assert teed.feed("[default1]:script finished[default1]:") == [(1, "script finished")]
    # Parts of two processes' lines interleave; each line ends at its own newline.
    assert teed.feed("[default1]:epo[default0]:loss 0.5") == [(0, "loss 0.5")]
    assert teed.feed("[default1]:ch 3") == [(1, "epoch 3")]
    assert teed.feed("[default0]:no newline yet[default1]:done") == [(1, "done")]
    assert teed.flush() == [(0, "no newline yet")]


def test_teed_lines_follow_each_process_s_rank_marker_across_an_elastic_run_s_rounds():
    teed = commands.TeedLines(node_rank=None, nproc_per_node=2)  # an elastic node: no rank of its own
    assert teed.feed("[default1]:@cmlcluster-rank 3 1 1 0") == []  # the marker is not output
    assert teed.feed("[default0]:@cmlcluster-rank 2 0 1 0") == []
    # Local rank 1's line is cut off by the restart (torchrun's tail thread read half of it).
    assert teed.feed("[default1]:epoch 1 lo[default0]:epoch 1 loss 0.5") == [(2, "epoch 1 loss 0.5")]
    assert teed.feed("W1122 torchrun restarts the workers") == [(None, "W1122 torchrun restarts the workers")]
    # Round 2: node 0 was lost and this node's processes come back as ranks 0 and 1. The cut line keeps
    # its old rank, and the marker is still found behind it.
    assert teed.feed("[default1]:@cmlcluster-rank 1 1 0 1") == [(3, "epoch 1 lo")]
    assert teed.feed("[default0]:@cmlcluster-rank 0 0 0 1") == []
    assert teed.feed("[default0]:resumed after epoch 1") == [(0, "resumed after epoch 1")]
    assert teed.feed("[default0]:epo[default1]:epoch 2") == [(1, "epoch 2")]
    assert teed.flush() == [(0, "epo")]
    # A static node's markers say what its numbering says already.
    static = commands.TeedLines(node_rank=1, nproc_per_node=2)
    assert static.feed("[default1]:@cmlcluster-rank 3 1 1 0") == [] and static.feed("[default1]:x") == [(3, "x")]


def test_script_arguments_are_strings():
    assert check_script_args(("--epochs", "3")) == ["--epochs", "3"]
    with pytest.raises(ConfigError, match="list of strings"):
        check_script_args("--epochs 3")
    with pytest.raises(ConfigError, match="list of strings"):
        check_script_args(["--epochs", 3])


def test_failures_come_back_first_failure_first_with_the_traceback(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "ValueError: bad shard",
                    "extraInfo": {"py_callstack": "Traceback ...\nValueError: bad shard\n", "timestamp": "100"},
                }
            }
        )
    )
    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=str(tmp_path / "none.json"))
    raised = ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(error_file))
    records = failures_of(ChildFailedError("train.py", {5: killed, 4: raised}))
    assert [r["rank"] for r in records] == [4, 5]  # the error file's time (100) comes before the kill's (now)
    assert records[0] == {
        "rank": 4,
        "local_rank": 0,
        "exit_code": 1,
        "pid": 10,
        "message": "ValueError: bad shard",
        "traceback": "Traceback ...\nValueError: bad shard\n",
        "timestamp": 100,
    }
    assert records[1]["message"] == "Signal 9 (SIGKILL) received by PID 11" and records[1]["traceback"] == ""
