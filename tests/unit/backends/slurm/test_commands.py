"""The Slurm backend's pure parts: each worker's srun, the options checked before anything starts, squeue's
and sinfo's lines, the queue ahead of a waiting job, and Slurm's job states in CML's words."""

from __future__ import annotations

import pytest

from cmlcluster import ConfigError
from cmlcluster.backends.slurm import commands
from cmlcluster.workers import FAILED, STOPPED, Resources


def test_a_worker_is_a_job_of_one_task_with_its_cores_memory_and_gpus():
    options = commands.job_options(partition="gpu", account="proj", time_limit="2:00:00", signal_before_end=120)
    argv = commands.srun_argv(
        "srun", "cmlcluster-s1-w1", "cmlcluster session=s1 host=h pid=7", Resources(1.5, 2, 2), options,
        "/opt/py", ["/opt/py", "-m", "cmlcluster.agent"],
    )  # fmt: skip
    assert argv[0] == "srun"
    assert {"--nodes=1", "--ntasks=1", "--cpus-per-task=2", "--mem=2048M", "--gres=gpu:2"} <= set(argv)
    assert {"--partition=gpu", "--account=proj", "--time=2:00:00", "--signal=USR1@120", "--export=ALL"} <= set(argv)
    assert "--job-name=cmlcluster-s1-w1" in argv and "--comment=cmlcluster session=s1 host=h pid=7" in argv
    assert argv[argv.index("/opt/py") :] == ["/opt/py", "-m", commands.TASK, "--", "/opt/py", "-m", "cmlcluster.agent"]
    no_gpu = commands.srun_argv("srun", "n", "c", Resources(1, 1), commands.job_options(), "py", ["py"])
    assert not any(a.startswith(("--gres", "--gpus", "--partition", "--time", "--signal")) for a in no_gpu)
    per_node = commands.srun_argv(
        "srun", "n", "c", Resources(1, 1, 1), commands.job_options(gpus="gpus-per-node"), "py", []
    )
    assert "--gpus-per-node=1" in per_node


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"partition": "gpu; rm -rf"}, "partition="),
        ({"account": 3}, "account="),
        ({"time_limit": "2 hours"}, "time_limit='2 hours'"),
        ({"time_limit": True}, "time_limit=True"),
        ({"signal_before_end": -1}, "signal_before_end=-1"),
        ({"gpus": "cuda"}, "gpus='cuda'"),
        ({"extra": "--constraint=a100"}, "extra="),
        ({"extra": ["-C a100"]}, "extra="),
    ],
)
def test_a_bad_option_is_refused_with_its_value_and_the_fix(keywords, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        commands.job_options(**keywords)


def test_time_limits_in_sbatchs_formats_pass():
    for limit in (30, "30", "2:00:00", "1-00:00:00", "1-2", "UNLIMITED"):
        assert commands.job_options(time_limit=limit).time_limit == str(limit)


def test_squeue_lines_and_the_jobs_ahead_of_a_waiting_one():
    text = "\n".join(
        [
            "11|cmlcluster-s1-w1|RUNNING|None|n1|debug|100|cmlcluster session=s1 host=h pid=7",
            "12|other|PENDING|Priority|(null)|debug|200|",
            "13|cmlcluster-s1-w2|PENDING|Resources|(null)|debug|100|cmlcluster session=s1 host=h pid=7",
            "10|older|PENDING|Priority|(null)|debug|100|",
            "14|later|PENDING|Priority|(null)|debug|100|",
            "9|elsewhere|PENDING|Priority|(null)|gpu|900|",
            "not a line",
        ]
    )
    queue = commands.parse_squeue(text)
    assert [j.job_id for j in queue] == ["11", "12", "13", "10", "14", "9"]
    ours = queue[2]
    assert commands.jobs_ahead(ours, queue) == 2  # 12 (higher priority) and 10 (as high, earlier); not 14, not 9
    assert commands.waiting_reason(ours, 2) == "Slurm job 13 PENDING (Resources), 2 jobs ahead in partition debug"
    assert commands.waiting_reason(queue[0], 0) == "Slurm job 11 RUNNING"


def test_a_jobs_comment_marks_its_session():
    comment = commands.job_comment("s1", "login1", 4242)
    assert commands.parse_comment(comment) == {"session": "s1", "host": "login1", "pid": "4242"}
    assert commands.parse_comment("someone else's") == {} and commands.parse_comment("cmlcluster session=s1") == {}


def test_slurms_end_states_in_cmls_words():
    assert commands.ENDED_AS["CANCELLED"] == STOPPED and commands.ENDED_AS["PREEMPTED"] == STOPPED
    for state in ("TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "FAILED", "BOOT_FAIL"):
        assert commands.ENDED_AS[state] == FAILED
    assert "COMPLETED" not in commands.ENDED_AS  # its exit code says it


def test_a_worker_that_fits_no_node_is_refused_before_anything_starts():
    nodes = commands.parse_sinfo("n1|4|8000|gpu:2(S:0)|debug*\nn2|2|4000|(null)|debug*\nn3|64|512000|(null)|big\n")
    first = nodes[0]
    assert (first.name, first.cpus, first.memory_mb, first.gpus, first.partition) == ("n1", 4, 8000, 2, "debug")
    commands.check_fits(Resources(4, 7, 2), nodes, "debug")
    commands.check_fits(Resources(3, 1), nodes, "")
    with pytest.raises(ConfigError, match=r"fits no node of partition 'debug' \(the largest, n1: 4 cores"):
        commands.check_fits(Resources(1, 1, 3), nodes, "debug")
    with pytest.raises(ConfigError, match=r"partition='gpu': this Slurm cluster has no such partition"):
        commands.check_fits(Resources(1, 1), nodes, "gpu")


def test_the_controllers_address_from_scontrol():
    assert commands.controller_host("ClusterName = c\nSlurmctldHost[0] = ctl(10.0.0.2)\n") == "10.0.0.2"
    assert commands.controller_host("SlurmctldHost[0]       = head1\n") == "head1"
    with pytest.raises(ConfigError, match="no SlurmctldHost"):
        commands.controller_host("")


def test_inside_an_allocation_a_worker_is_a_step_of_it_with_its_own_cores_memory_and_gpus():
    argv = commands.step_argv(
        "srun", "12", "cmlcluster-s1-w1", Resources(1, 0.25, 1), commands.job_options(), "py", ["py", "-m", "agent"]
    )
    assert argv[:3] == ["srun", "--jobid=12", "--overlap"]
    assert {"--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--mem=256M", "--gres=gpu:1"} <= set(argv)
    assert not any(a.startswith(("--comment", "--partition", "--time")) for a in argv)  # the allocation's


def test_inside_an_allocation_its_own_settings_are_refused_and_outside_one_steps_are(monkeypatch):
    from cmlcluster.backends.slurm.backend import SlurmBackend

    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "1500")
    backend = SlurmBackend()
    assert backend.allocation == "12"
    assert "SLURM_MEM_PER_NODE" not in backend.slurm_env  # never a step's default through the notebook's job
    assert SlurmBackend(within_allocation=False).allocation == ""
    with pytest.raises(ConfigError, match=r"partition, time_limit: inside allocation 12 these are the allocation's"):
        SlurmBackend(partition="gpu", time_limit=30)
    monkeypatch.delenv("SLURM_JOB_ID")
    assert SlurmBackend().allocation == ""
    with pytest.raises(ConfigError, match=r"within_allocation=True: this process runs in no Slurm allocation"):
        SlurmBackend(within_allocation=True)


def test_a_launch_is_one_allocation_of_a_task_per_worker_and_each_worker_a_step_of_it():
    options = commands.job_options(partition="gpu", time_limit=30, signal_before_end=60, extra=["--constraint=a100"])
    name = commands.gang_name("s1", "s1-0")
    argv = commands.salloc_argv("salloc", name, "cmlcluster session=s1 host=h pid=7", 4, Resources(3, 10, 2), options)
    assert argv[:2] == ["salloc", "--no-shell"] and "--job-name=cmlcluster-s1-gang-s1-0" in argv
    # Per task, so that Slurm may pack tasks on a node or spread them: a node's memory grows with its tasks.
    assert {"--ntasks=4", "--cpus-per-task=3", "--mem-per-cpu=3414M", "--gpus-per-task=2"} <= set(argv)
    assert {"--partition=gpu", "--time=30", "--signal=USR1@60", "--constraint=a100"} <= set(argv)
    assert commands.SUBMITTED.search("salloc: Pending job allocation 41").group(1) == "41"
    assert commands.GRANTED.search("salloc: Granted job allocation 41").group(1) == "41"
    assert commands.SUBMITTED.search("salloc: Granted job allocation 41") and not commands.GRANTED.search(
        "salloc: Pending job allocation 41"
    )
    # Its workers' steps take a task's share each (no --overlap), the site's extra options were the allocation's.
    step = commands.step_argv("srun", "41", "n", Resources(3, 10, 2), options, "py", ["py"], gang=True)
    assert step[:2] == ["srun", "--jobid=41"] and "--overlap" not in step and "--constraint=a100" not in step
    assert {"--cpus-per-task=3", "--mem=10240M", "--gres=gpu:2"} <= set(step)


def test_a_gang_that_the_whole_partition_could_never_hold_is_refused_before_anything_starts():
    nodes = commands.parse_sinfo("n1|4|8000|gpu:2(S:0)|debug*\nn2|4|8000|gpu:2(S:0)|debug*\nn3|64|512000|(null)|big\n")
    commands.check_gang_fits(4, Resources(2, 3), nodes, "debug")  # two a node
    with pytest.raises(ConfigError, match=r"5 workers .* the whole of partition 'debug' holds at most 4 of them"):
        commands.check_gang_fits(5, Resources(2, 3), nodes, "debug")
    with pytest.raises(ConfigError, match=r"holds at most 2 of them: launch fewer, ask for less, or give gang=False"):
        commands.check_gang_fits(3, Resources(1, 1, 2), nodes, "debug")  # GPUs: one a node
    commands.check_gang_fits(32, Resources(2, 1), nodes, "big")
    # Memory: one a debug node, 64 on the big one (its cores), over every partition where none is given.
    with pytest.raises(ConfigError, match=r"the whole of the cluster holds at most 66 of them"):
        commands.check_gang_fits(67, Resources(1, 7), nodes, "")
