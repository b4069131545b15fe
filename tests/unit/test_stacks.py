"""X-ray (cmlcluster/stacks): a worker's gather on real processes (faulthandler dumps through the hook a rank
runner arms, py-spy, what is left alone), and the report's grouping, odd ones out and collectives; the
session's side on the fake backend. Real ranks across real workers: tests/integration/test_xray.py."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from cmlcluster import Session
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.stacks import XRay, gather
from cmlcluster.stacks.report import ProcessStacks
from cmlcluster.wire import PY_SPY_ENV

# A rank as its runner starts it: the hook armed, then the script's code. It says when it waits.
RANK = textwrap.dedent(
    """
    import os, sys, time
    from cmlcluster.stacks import hook
    hook.arm()
    def wait_here():
        print("waiting", flush=True)
        time.sleep(60)
    if len(sys.argv) > 1 and sys.argv[1] == "fork":
        if os.fork() == 0:  # a child (a data loader's): same dump file, same environment
            wait_here()
    wait_here()
    """
)


@pytest.fixture
def start():
    """start(code, *args, env=, count=): a Python process running `code`, once it (and its `count` - 1
    forked children) said "waiting"; all of them killed at the test's end."""
    started = []

    def start(code: str, *args: str, env: dict[str, str] | None = None, count: int = 1) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        started.append(process)
        for _ in range(count):
            assert process.stdout.readline() == "waiting\n"
        return process

    yield start
    for process in started:
        for pid in family(process):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()


@pytest.fixture
def no_py_spy(monkeypatch):
    """As where py-spy is missing: only the dumps the ranks armed are read."""
    monkeypatch.setattr(gather.shutil, "which", lambda name: None)
    monkeypatch.setattr(gather, "_beside_python", lambda name: None)


def test_a_rank_is_read_through_its_dump_even_where_py_spy_is_installed(start):
    rank = start(RANK, env={"JAX_PROCESS_ID": "0"})
    [record] = gathered(rank)
    assert record["via"] == "faulthandler" and record["label"]["kind"] == "jax"


def test_a_stopped_rank_is_named_with_why_neither_way_read_it(start, monkeypatch):
    # Its dump's signal waits for it to run again; py-spy is asked next, and cannot read it either.
    monkeypatch.setattr(gather, "DUMP_SECONDS", 0.3)
    rank = start(RANK, env={"RANK": "1", "LOCAL_RANK": "1"})
    os.kill(rank.pid, signal.SIGSTOP)
    try:
        [record] = gathered(rank)
    finally:
        os.kill(rank.pid, signal.SIGCONT)
    assert record["threads"] == []
    assert record["error"].startswith("no faulthandler dump within 0.3 s (is it stopped?); py-spy: "), record
    assert "\n" not in record["error"]  # py-spy's first line, not its backtrace


def test_a_process_whose_environment_turns_py_spy_off_and_armed_nothing_is_named_not_read(start):
    plain = start("import time; print('waiting', flush=True); time.sleep(60)", env={PY_SPY_ENV: "0"})
    [record] = gathered(plain)
    assert record["threads"] == []
    assert record["error"] == (
        "it armed no faulthandler dump (cmlcluster did not start it as a rank); "
        f"py-spy is turned off for it ({PY_SPY_ENV}=0)"
    )


def gathered(process: subprocess.Popen[str]) -> list[dict]:
    return [p for p in gather.below(time.monotonic() + gather.GATHER_SECONDS) if p["pid"] in family(process)]


def family(process: subprocess.Popen[str]) -> set[int]:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        return {process.pid, *(c.pid for c in psutil.Process(process.pid).children(recursive=True))}
    return set()


def test_a_rank_that_armed_the_hook_is_read_through_its_dump_and_lives_on(no_py_spy, start):
    rank = start(RANK, env={"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4"})
    [record] = gathered(rank)
    assert record["via"] == "faulthandler" and record["error"] is None
    assert record["label"] == {"kind": "torch", "rank": 2, "size": 4, "local_rank": 0, "backend": None}
    main = record["threads"][0]
    assert main["name"] == "MainThread"
    assert [f[2] for f in main["frames"]] == ["<module>", "wait_here"]  # outermost first
    assert rank.poll() is None  # the dump's signal is caught: the rank runs on
    again = gathered(rank)  # a second X-ray reads only the new dump
    assert [f[2] for f in again[0]["threads"][0]["frames"]] == ["<module>", "wait_here"]


def test_a_rank_and_its_forked_child_share_a_dump_file_and_both_are_read(no_py_spy, start):
    rank = start(RANK, "fork", env={"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_GLOO": "1"}, count=2)
    records = gathered(rank)
    assert len(records) == 2 and all(r["via"] == "faulthandler" for r in records)
    assert all([f[2] for f in r["threads"][0]["frames"]][-1] == "wait_here" for r in records)
    parent, child = sorted(records, key=lambda r: r["pid"] != rank.pid)
    assert parent["label"]["rank"] == 1 and parent["label"]["backend"] == "gloo"
    assert child["label"]["helper_of"] == rank.pid  # the rank's child, not a second rank 1


def test_a_process_that_armed_nothing_is_never_sent_the_signal(no_py_spy, start):
    plain = start("import time; print('waiting', flush=True); time.sleep(60)")
    [record] = gathered(plain)
    assert record["threads"] == [] and "armed no faulthandler dump" in record["error"]
    time.sleep(0.2)
    assert plain.poll() is None  # the real-time signal would have killed it


def test_py_spy_reads_a_process_that_armed_nothing(start):
    if gather.shutil.which("py-spy") is None and gather._beside_python("py-spy") is None:
        pytest.fail("py-spy is missing: scripts/install.sh dev installs it (the xray extra)")
    plain = start("import time\ndef here():\n    print('waiting', flush=True); time.sleep(60)\nhere()")
    [record] = gathered(plain)
    assert record["via"] == "py-spy", record["error"]
    assert record["threads"][0]["name"] == "MainThread"
    assert record["threads"][0]["frames"][-1][2] == "here"


def test_faulthandler_s_text_is_read_outermost_first_with_the_main_thread_named():
    def inner(f):
        faulthandler.dump_traceback(f, all_threads=True)

    with tempfile.TemporaryFile("w+") as f:
        inner(f)
        f.seek(0)
        threads = gather.faulthandler_threads(f.read())
    main = threads[0]
    assert (
        main["frames"][-1][2] == "inner" and main["frames"][-1][3] == "faulthandler.dump_traceback(f, all_threads=True)"
    )
    assert main["frames"][-2][2] == "test_faulthandler_s_text_is_read_outermost_first_with_the_main_thread_named"


@pytest.mark.parametrize(
    "env, label",
    [
        ({"JAX_PROCESS_ID": "3", "JAX_NUM_PROCESSES": "4"}, {"kind": "jax", "rank": 3, "size": 4}),
        ({"TF_CONFIG": '{"cluster": {}, "task": {"type": "ps", "index": 1}}'}, {"kind": "tensorflow", "task": "ps:1"}),
        ({"RANK": "0"}, {}),  # RANK alone is no torchrun rank's (many programs set it)
        ({"TF_CONFIG": "not json"}, {}),
    ],
)
def test_what_a_process_is_comes_from_its_launcher_s_variables(env, label):
    got = gather.label_of(env)
    assert {k: v for k, v in got.items() if v is not None} == label


# ---------------------------------------------------------------- the report


C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def unit(rank, *functions, worker="w0", task=None, file="train.py", backend=None, innermost=None):
    """A unit's stacks as its worker's gather sends them: its main thread in `functions` (each at a line
    of `file`), then `innermost` ([file, line, function, source]) where given."""
    frames = [[file, 10 + i, f, f"{f}()"] for i, f in enumerate(functions)] + ([innermost] if innermost else [])
    label = {"rank": rank, "kind": "torch" if rank is not None else "tensorflow" if task else None, "task": task}
    data = {"pid": 100 + (rank or 0), "label": {**label, "backend": backend}, "via": "py-spy"}
    return ProcessStacks.from_wire(worker, {**data, "threads": [{"name": "MainThread", "frames": frames}]})


def barrier(rank, worker="w0"):
    return unit(rank, "<module>", "main", worker=worker, innermost=[C10D, 4159, "barrier", "work.wait()"])


def test_the_odd_rank_out_is_named_with_its_line_and_the_others_with_their_collective():
    ranks = [barrier(0), barrier(1), unit(2, "<module>", "main", "load_batch", worker="w1"), barrier(3, "w1")]
    xray = XRay(ranks, {"w2": "it is succeeded"}, 0.42)
    assert [u.rank for u in xray.odd_ones_out()] == [2]
    assert xray.rank(2).main.innermost_users.where == "train.py:12"
    text = str(xray)
    assert text.splitlines()[:5] == [
        "X-ray of 4 ranks on 3 workers in 0.4 s (py-spy)",
        "  ranks 0-1, 3: wait in torch.distributed.barrier, at train.py:11 in main: main()",
        "  odd one out:",
        "    rank 2 (w1, pid 102): at train.py:12 in load_batch: load_batch()",
        "  w2: no answer (it is succeeded)",
    ]
    assert "<b>ranks 0-1, 3</b>" in xray.html() and "color:#c62828'><b>rank 2</b>" in xray.html()
    with pytest.raises(KeyError, match=r"rank 7 is not among this X-ray's ranks \(ranks seen: 0, 1, 2, 3\)"):
        xray.rank(7)


def test_without_a_majority_the_ones_not_waiting_for_their_peers_are_the_odd_ones():
    xray = XRay([barrier(0), unit(1, "<module>", "main", "sleep")], {}, 0.1)
    assert [u.rank for u in xray.odd_ones_out()] == [1]
    # Two ranks each somewhere of their own, neither waiting: nobody is singled out.
    assert XRay([unit(0, "a"), unit(1, "b")], {}, 0.1).odd_ones_out() == []


def test_tensorflow_tasks_are_compared_with_tasks_of_their_type_only():
    ps = unit(None, "<module>", "join", task="ps:0")
    workers = [unit(None, "<module>", "step", task=f"worker:{i}", worker=f"w{i + 1}") for i in range(2)]
    stuck = unit(None, "<module>", "sleep", task="worker:2", worker="w3")
    xray = XRay([ps, *workers, stuck], {}, 0.1)
    assert [u.task for u in xray.odd_ones_out()] == ["worker:2"]  # the lone parameter server is no odd one


@pytest.mark.parametrize(
    "file, function, backend, collective",
    [
        ("/x/site-packages/horovod/torch/mpi_ops.py", "synchronize", "gloo", "Horovod synchronize over Gloo"),
        ("/x/site-packages/torch/distributed/distributed_c10d.py", "all_reduce", None, "torch.distributed.all_reduce"),
        (
            "/x/site-packages/tensorflow/python/client/session.py",
            "_call_tf_sessionrun",
            None,
            "TensorFlow's runtime (gRPC), in _call_tf_sessionrun",
        ),
        ("/x/site-packages/torch/nn/modules/module.py", "forward", None, None),
    ],
)
def test_the_collective_a_rank_waits_in_is_named_from_its_innermost_frames(file, function, backend, collective):
    stacks = unit(0, "<module>", "main", function, file=file, backend=backend)
    assert stacks.collective == collective


# ---------------------------------------------------------------- the session's side


def test_the_session_asks_running_workers_and_says_why_others_gave_nothing():
    answers = {
        0: {
            "processes": [
                {
                    "pid": 5,
                    "label": {},
                    "via": "agent",
                    "threads": [{"name": "MainThread", "frames": [["<worker code>", 3, "train", "step()"]]}],
                }
            ],
            "seconds": 0.01,
        },
    }

    def answer(engine_id, target, args):
        if engine_id == 1:
            raise RuntimeError("its agent could not gather its stacks: boom")
        return answers[engine_id]

    backend = FakeBackend([FakeWorker(run_time=60), FakeWorker(run_time=60), FakeWorker(run_time=0)])
    with Session(backend, echo=False) as s:
        backend.control.responder = answer
        workers = s.launch_workers(3, cpu=1, memory=1, code="train()")
        s.await_workers(workers[2:], timeout_seconds=10)
        s.await_workers(workers[:2], wait_for_completion=False, timeout_seconds=10)
        xray = s.xray(*workers)
        assert [u.name for u in xray.units] == ["w0"]
        assert xray.unanswered == {"w1": "its agent could not gather its stacks: boom", "w2": "it is succeeded"}
        assert "w0: at <worker code>:3 in train: step()" in str(xray)
        # From another thread, as the widget's button asks: the answer comes to a callback.
        got = []
        s.xray_soon(got.append)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(got[0], XRay) and [u.name for u in got[0].units] == ["w0"]
        assert set(got[0].unanswered) == {"w1"}  # the session's unfinished workers only


def test_the_agents_sampler_inside_psutil_is_machinery_not_a_program(monkeypatch):
    # The sampler thread (cmlcluster.usage) caught inside psutil read as the worker's own program: an X-ray of a
    # torch node showed a unit of no rank beside its ranks. A user's frames before psutil still count.
    import psutil

    import cmlcluster.usage

    sampler = [[threading.__file__, 1, "run"], [cmlcluster.usage.__file__, 1, "sample"], [psutil.__file__, 1, "cpu"]]
    assert gather.users_part(sampler) == []
    mine = [[threading.__file__, 1, "run"], ["/home/me/train.py", 3, "watch"], [psutil.__file__, 1, "cpu"]]
    assert gather.users_part(mine) == mine[1:]
