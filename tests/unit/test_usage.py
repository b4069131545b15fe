"""What a worker uses (cmlcluster/usage.py): its process tree's CPU and memory measured on real processes,
its memory limit read from cgroup files, its GPUs through a pynvml stand-in (no GPU here: the NVML calls
made are what is checked), and a sample's way into the session's list_workers() and events (fake backend)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from cmlcluster import Session, cgroups, usage, wire
from cmlcluster.__main__ import usage_screen
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.events import GpuUse, ResourceUse

MIB = 1 << 20

# Allocates 200 MiB (written, so resident), then burns CPU until killed.
BURNER = "x = bytearray(b'x' * (200 << 20))\nwhile True:\n    pass\n"


def samples(sampler_root: int, seconds: float, count: int, timeout: float = 30.0) -> list[dict]:
    """`count` samples of the tree under sampler_root, taken every `seconds` by a real Sampler."""
    got: list[dict] = []
    said: list[str] = []
    ready = threading.Event()

    def send(content: dict) -> None:
        got.append(content)
        if len(got) >= count:
            ready.set()

    sampler = usage.Sampler(seconds, send, said.append, root=sampler_root).start()
    try:
        assert ready.wait(timeout), f"{len(got)} samples in {timeout} s; said: {said}"
    finally:
        sampler.stop()
    assert said == []
    return got


def test_a_child_that_burns_cpu_and_holds_memory_shows_in_its_parents_tree():
    # The tree's root is a parent that only waits; its child (a process of the tree) does the work.
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURNER!r}])"]
    )
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        [child] = psutil.Process(parent.pid).children()
        while child.memory_info().rss < 200 * MIB and time.monotonic() < deadline:
            time.sleep(0.05)
        got = samples(parent.pid, 0.5, 3)
    finally:
        # Its tree first: a child whose parent is killed first goes to init where no subreaper takes it
        # (the unit tier alone runs without the run's), and would burn a core until the machine stops.
        for process in [*psutil.Process(parent.pid).children(recursive=True), psutil.Process(parent.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        parent.wait()
    # One core busy (the machine is shared: at least a fifth of it is seen in some sample), the child's
    # 200 MiB counted with the parent's.
    assert max(s["cpu_percent"] for s in got) > 20, got
    assert all(s["memory_bytes"] >= 200 * MIB for s in got), got
    assert all(s["gpus"] == [] for s in got)


def test_cpu_of_a_child_that_ended_and_was_reaped_still_counts():
    # The parent runs a child for about half a second of CPU, reaps it, and waits: the tree's CPU time grows
    # by the child's, though the child is gone when it is measured (its time is in the parent's counters).
    code = (
        "import subprocess, sys, time\n"
        "subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.5: pass'])\n"
        "print('reaped', flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        tree = usage.ProcessTree(psutil, parent.pid)
        before, _ = tree.measure()
        assert parent.stdout.readline() == "reaped\n"
        after, resident = tree.measure()
        assert tree.members() == [parent.pid]  # the child is gone
    finally:
        parent.kill()
        parent.wait()
    assert after - before >= 0.45, (before, after)
    assert resident > 0


def test_the_sampler_period_comes_from_the_environment():
    assert usage.period({}) == wire.DEFAULT_USAGE_SECONDS == 2.0
    assert usage.period({wire.USAGE_SECONDS_ENV: "0.5"}) == 0.5
    for off in ("0", "-1", "nan", "inf", "soon", ""):
        assert usage.period({wire.USAGE_SECONDS_ENV: off}) == 0.0, off
    assert usage.start(lambda c: None, lambda s: None, {wire.USAGE_SECONDS_ENV: "0"}) is None


def test_without_psutil_sampling_stops_with_one_line_and_the_process_runs_on():
    code = textwrap.dedent("""
        import sys, time
        sys.modules["psutil"] = None  # import psutil now fails
        from cmlcluster import usage
        said, sent = [], []
        sampler = usage.Sampler(0.05, sent.append, said.append).start()
        sampler.thread.join(10)
        print(repr((said, sent, sampler.thread.is_alive())))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    said, sent, alive = eval(out.stdout)
    assert said == ["its CPU and memory are not sampled: psutil is missing (pip install psutil)"]
    assert sent == [] and alive is False


# ---------------------------------------------------------------- the memory limit


def cgroup_files(root, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")


def with_own_cgroups(monkeypatch, own: dict[str, str]) -> None:
    monkeypatch.setattr(cgroups, "_own_cgroup", lambda controller: own.get(controller))


def test_the_memory_limit_is_the_lowest_of_the_cgroup_and_those_above_it_v2(tmp_path, monkeypatch):
    with_own_cgroups(monkeypatch, {"": "/user.slice/cmlcluster-s/w-0"})
    cgroup_files(
        tmp_path,
        {
            "user.slice/cmlcluster-s/w-0/memory.max": "max",
            "user.slice/cmlcluster-s/memory.max": str(3 << 30),
            "user.slice/memory.max": str(2 << 30),  # an ancestor's binds too
        },
    )
    assert cgroups.memory_limit(str(tmp_path)) == 2 << 30
    (tmp_path / "user.slice/cmlcluster-s/w-0/memory.max").write_text(f"{1 << 30}\n")
    assert cgroups.memory_limit(str(tmp_path)) == 1 << 30


def test_a_containers_v1_limit_is_read_at_its_mounts_root(tmp_path, monkeypatch):
    # cgroup v1 in a container: /proc/self/cgroup names the host's path, the mount shows the container's cgroup.
    with_own_cgroups(monkeypatch, {"memory": "/docker/0123abcd"})
    cgroup_files(tmp_path, {"memory/memory.limit_in_bytes": str(768 * MIB)})
    assert cgroups.memory_limit(str(tmp_path)) == 768 * MIB


def test_no_limit_is_none(tmp_path, monkeypatch):
    with_own_cgroups(monkeypatch, {"memory": "/", "": "/"})
    assert cgroups.memory_limit(str(tmp_path)) is None  # no files: no cgroups (macOS), or none readable
    cgroup_files(tmp_path, {"memory/memory.limit_in_bytes": "9223372036854771712", "memory.max": "max"})
    assert cgroups.memory_limit(str(tmp_path)) is None


def test_a_real_cgroups_limit_is_read_by_the_process_in_it():
    limits = cgroups.CgroupLimits(f"cmlcluster-test-usage-{os.getpid()}", cpu=1, memory_gb=0.25)
    try:
        if not limits.paths or limits.problem:
            pytest.skip(f"no cgroup of its own here: {limits.problem}")
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; sys.stdin.read(); from cmlcluster import cgroups; print(cgroups.memory_limit())",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        limits.add(child.pid)
        out, _ = child.communicate("go", timeout=60)
        assert int(out) == int(0.25 * 1024**3)
    finally:
        limits.remove()


# ---------------------------------------------------------------- GPUs, through a pynvml stand-in

# A pynvml with devices 0-3 (or those NVIDIA_VISIBLE_DEVICES leaves a container: STAND_IN_COUNT) that
# records each call and its arguments into the file STAND_IN_CALLS names.
PYNVML_STAND_IN = """
import json, os

class NVMLError(Exception):
    pass

_UUIDS = {"GPU-aaaa": 0, "GPU-bbbb": 1, "GPU-cccc": 2, "GPU-dddd": 3, "MIG-eeee": 100}


def _called(name, *args):
    with open(os.environ["STAND_IN_CALLS"], "a") as f:
        f.write(json.dumps([name, *args]) + "\\n")


class _Handle:
    def __init__(self, n):
        self.n = n


class _Memory:
    def __init__(self, n):
        self.total = 80 << 30
        self.used = (n + 1) << 30
        self.free = self.total - self.used


class _Busy:
    def __init__(self, n):
        self.gpu = 10 * (n + 1)
        self.memory = 5


def nvmlInit():
    _called("nvmlInit")


def _count():
    return int(os.environ.get("STAND_IN_COUNT", "4"))


def nvmlDeviceGetCount():
    _called("nvmlDeviceGetCount")
    return _count()


def nvmlDeviceGetHandleByIndex(i):
    _called("nvmlDeviceGetHandleByIndex", i)
    if not 0 <= i < _count():
        raise NVMLError("Invalid Argument")
    return _Handle(i)


def nvmlDeviceGetHandleByUUID(uuid):
    _called("nvmlDeviceGetHandleByUUID", uuid)
    return _Handle(_UUIDS[uuid])


def nvmlDeviceGetIndex(handle):
    _called("nvmlDeviceGetIndex", handle.n)
    if handle.n >= 100:
        raise NVMLError("Not Supported")  # a MIG device has no index of its own
    return handle.n


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle):
    _called("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle.n)
    return _Handle(handle.n - 98)  # GPU 2


def nvmlDeviceGetUtilizationRates(handle):
    _called("nvmlDeviceGetUtilizationRates", handle.n)
    if handle.n >= 100:
        raise NVMLError("Not Supported")
    return _Busy(handle.n)


def nvmlDeviceGetMemoryInfo(handle):
    _called("nvmlDeviceGetMemoryInfo", handle.n)
    return _Memory(handle.n)
"""

# Samples the agent's own tree twice, in a process whose sys.path starts with the stand-in's folder.
SAMPLE_TWICE = """
import json, sys, threading
from cmlcluster import usage
got, said, done = [], [], threading.Event()
def send(content):
    got.append(content)
    if len(got) == 2:
        done.set()
sampler = usage.Sampler(0.05, send, said.append).start()
done.wait(30)
sampler.stop()
print(json.dumps({"samples": got, "said": said}))
"""


def sample_with_stand_in(tmp_path, env: dict[str, str], stand_in: bool = True) -> tuple[list[dict], list, list[str]]:
    folder = tmp_path / "stand_in"
    folder.mkdir(exist_ok=True)
    if stand_in:
        (folder / "pynvml.py").write_text(PYNVML_STAND_IN)
    calls = tmp_path / "calls.jsonl"
    calls.write_text("")
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")}
    base["PYTHONPATH"] = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", SAMPLE_TWICE],
        env={**base, "STAND_IN_CALLS": str(calls), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout)
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    return result["samples"], made, result["said"]


def test_cuda_visible_devices_1_and_3_are_sampled_as_gpus_1_and_3(tmp_path):
    got, calls, said = sample_with_stand_in(tmp_path, {"CUDA_VISIBLE_DEVICES": "1,3"})
    assert said == []
    assert [s["gpus"] for s in got] == [[[1, 20.0, 2 << 30, 80 << 30], [3, 40.0, 4 << 30, 80 << 30]]] * 2
    assert calls[:3] == [["nvmlInit"], ["nvmlDeviceGetHandleByIndex", 1], ["nvmlDeviceGetHandleByIndex", 3]]
    # Only its own GPUs are ever read: handles made once, for 1 and 3; each sample reads those two.
    handles = [c[1] for c in calls if c[0] == "nvmlDeviceGetHandleByIndex"]
    assert handles == [1, 3]
    read = {(c[0], c[1]) for c in calls if c[0] in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates")}
    assert read == {
        ("nvmlDeviceGetMemoryInfo", 1),
        ("nvmlDeviceGetMemoryInfo", 3),
        ("nvmlDeviceGetUtilizationRates", 1),
        ("nvmlDeviceGetUtilizationRates", 3),
    }
    assert [c[0] for c in calls].count("nvmlInit") == 1


def test_gpus_by_uuid_and_a_mig_slice_report_their_host_index(tmp_path):
    got, calls, said = sample_with_stand_in(tmp_path, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb,MIG-eeee"})
    assert said == []
    # The MIG slice: its GPU's index (2), and no utilization of its own (None on the wire, NaN in events).
    assert got[-1]["gpus"] == [[1, 20.0, 2 << 30, 80 << 30], [2, None, 101 << 30, 80 << 30]]
    assert ["nvmlDeviceGetHandleByUUID", "GPU-bbbb"] in calls and ["nvmlDeviceGetHandleByUUID", "MIG-eeee"] in calls
    assert not any(c[0] == "nvmlDeviceGetHandleByIndex" for c in calls)
    [use] = [usage.decode("w", s) for s in got[-1:]]
    assert use is not None and math.isnan(use.gpus[1].utilization_percent)


def test_a_containers_gpus_are_those_its_runtime_gave_by_their_host_index(tmp_path):
    # NVML in the container sees the two devices NVIDIA_VISIBLE_DEVICES gave, numbered 0 and 1 there.
    got, calls, _ = sample_with_stand_in(tmp_path, {"NVIDIA_VISIBLE_DEVICES": "3,2", "STAND_IN_COUNT": "2"})
    assert [g[0] for g in got[-1]["gpus"]] == [2, 3]
    assert sorted(c[1] for c in calls if c[0] == "nvmlDeviceGetHandleByIndex") == [0, 1]


@pytest.mark.parametrize(
    "env",
    [
        {"CUDA_VISIBLE_DEVICES": ""},  # the local backend's "no GPUs"
        {"CUDA_VISIBLE_DEVICES": "-1"},
        {"NVIDIA_VISIBLE_DEVICES": "void"},
        {},
        {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "all"},  # CUDA's list decides
    ],
)
def test_a_worker_given_no_gpus_never_calls_nvml(tmp_path, env):
    got, calls, said = sample_with_stand_in(tmp_path, env)
    assert calls == [] and said == []
    assert all(s["gpus"] == [] for s in got)


def test_gpus_without_pynvml_are_said_once_and_cpu_is_still_sampled(tmp_path):
    sys_path_has_pynvml = subprocess.run([sys.executable, "-c", "import pynvml"], capture_output=True).returncode == 0
    if sys_path_has_pynvml:
        pytest.skip("pynvml is installed here: its absence cannot be shown")
    got, _, said = sample_with_stand_in(tmp_path, {"CUDA_VISIBLE_DEVICES": "0"}, stand_in=False)
    assert said == [
        "its GPUs are not sampled: pynvml is missing; pip install nvidia-ml-py into this Python (in cmlcluster's "
        "clone: bash scripts/install.sh gpu)"
    ]
    assert len(got) == 2 and all(s["gpus"] == [] for s in got)
    # A CUDA image's NVIDIA_VISIBLE_DEVICES=all, GPUs or not: nothing said.
    _, _, said = sample_with_stand_in(tmp_path, {"NVIDIA_VISIBLE_DEVICES": "all"}, stand_in=False)
    assert said == []


def test_given_gpus_reads_the_lists_as_cuda_and_the_runtime_do():
    assert usage.given_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}) == ("cuda", ["1", "3"])
    assert usage.given_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ("cuda", ["0"])  # CUDA stops at -1
    assert usage.given_gpus({"CUDA_VISIBLE_DEVICES": " GPU-ab , 2"}) == ("cuda", ["GPU-ab", "2"])
    assert usage.given_gpus({"NVIDIA_VISIBLE_DEVICES": "all"}) == ("runtime", ["all"])
    assert usage.given_gpus({"NVIDIA_VISIBLE_DEVICES": "none"}) is None


# ---------------------------------------------------------------- into the session


def test_a_sample_round_trips_and_a_bad_one_is_refused():
    content = usage.encode(123.456, 5 * MIB, None, [GpuUse(1, math.nan, 10, 20), GpuUse(3, 50.0, 30, 40)])
    json.dumps(content, allow_nan=False)  # Jupyter's packer refuses NaN
    use = usage.decode("s-0", content)
    assert use is not None
    assert (use.worker_id, use.cpu_percent, use.memory_bytes, use.memory_limit_bytes) == ("s-0", 123.46, 5 * MIB, None)
    assert math.isnan(use.gpus[0].utilization_percent) and use.gpus[1] == GpuUse(3, 50.0, 30, 40)
    assert usage.decode("s-0", {"cpu_percent": "lots"}) is None
    assert usage.decode("s-0", {}) is None


def sample_arrives(session: Session, engine_id: int, sample: dict) -> None:
    """As the control plane hands a sample over: on the session's loop."""

    async def arrive() -> None:
        session._supervisor.control.on_usage(engine_id, sample)

    session._rt.run(arrive())
    session.drain()


def test_samples_become_list_workers_fields_and_events_until_the_worker_ends():
    with Session(FakeBackend([FakeWorker(), FakeWorker()], gpus=["0", "1"]), echo=False) as s:
        seen: list[ResourceUse] = []
        s.subscribe(lambda e: seen.append(e) if isinstance(e, ResourceUse) else None)
        a, b = s.launch_workers(2, cpu=2, memory=4, nvidia_gpu=1)
        s.await_workers([a, b], wait_for_completion=False, timeout_seconds=10)
        sample = {
            "engine": a["engine_id"],
            **usage.encode(150.0, 3 << 30, 4 << 30, [GpuUse(0, 75.0, 1 << 30, 16 << 30)]),
        }
        sample_arrives(s, a["engine_id"], sample)
        listed = {w["id"]: w for w in s.list_workers()}
        assert listed[a["id"]]["cpu_percent"] == 150.0
        assert listed[a["id"]]["memory_bytes"] == 3 << 30 and listed[a["id"]]["memory_limit_bytes"] == 4 << 30
        assert listed[a["id"]]["gpus"] == [
            {"index": 0, "utilization_percent": 75.0, "memory_bytes": 1 << 30, "memory_total_bytes": 16 << 30}
        ]
        # What was asked is CML's, unchanged, beside it.
        assert (listed[a["id"]]["cpu"], listed[a["id"]]["memory"], listed[a["id"]]["nvidia_gpu"]) == (2.0, 4.0, 1)
        assert "cpu_percent" not in listed[b["id"]]  # no sample yet: no usage fields
        [event] = seen
        assert event.worker_id == a["id"] and event.cpu_percent == 150.0
        s.stop_workers(a)
        assert "cpu_percent" not in {w["id"]: w for w in s.list_workers()}[a["id"]]  # an ended worker uses nothing
        sample_arrives(s, a["engine_id"], sample)  # a late sample is dropped
        sample_arrives(s, 99, sample)  # as is one of no worker
        assert len(seen) == 1


def test_the_watch_screen_shows_what_was_asked_and_what_is_used():
    record = {
        "id": "3f2a9c1e8b7d4a60",
        "pid": 4242,
        "backend": "local",
        "started": 100.0,
        "workers": [
            {
                "id": "3f2a9c1e8b7d4a60-0",
                "status": "running",
                "cpu": 2.0,
                "memory": 4.0,
                "nvidia_gpu": 2,
                "usage": {
                    "cpu_percent": 187.4,
                    "memory_bytes": 1536 * MIB,
                    "memory_limit_bytes": 4 << 30,
                    "gpus": [
                        {
                            "index": 1,
                            "utilization_percent": 93.0,
                            "memory_bytes": 3 << 30,
                            "memory_total_bytes": 80 << 30,
                        },
                        {
                            "index": 3,
                            "utilization_percent": math.nan,
                            "memory_bytes": 0,
                            "memory_total_bytes": 80 << 30,
                        },
                    ],
                },
            },
            {"id": "3f2a9c1e8b7d4a60-1", "status": "running", "usage": None},  # no sample yet, and no request kept
            {
                "id": "3f2a9c1e8b7d4a60-2",
                "status": "stopped",
                "usage": {"cpu_percent": 50, "memory_bytes": 1, "memory_limit_bytes": None, "gpus": []},
            },
        ],
    }
    screen = usage_screen([record], 142.0)
    lines = screen.splitlines()
    assert lines[0].startswith("cmlcluster: 1 live session, ")
    assert lines[1] == "session 3f2a9c1e8b7d4a60  pid 4242  local  up 42 s"
    header, busy, fresh, ended = lines[2:]
    assert header.split() == "worker id status cpu memory gpus".split()
    # In the widget's words (ui/model.resource_texts): asked · used, memory against its limit, GPUs averaged.
    assert busy.split(maxsplit=3)[:3] == ["w0", "3f2a9c1e8b7d4a60-0", "running"]
    assert "2 · 187 %" in busy and "1.5 / 4 GiB" in busy and "2 · 93 % · 3 / 160 GiB" in busy
    assert fresh.split()[2:] == ["running", "0", "0", "GiB"]  # no sample yet, and no request kept
    assert ended.split()[2:] == ["stopped", "0", "0", "GiB"]  # what an ended worker uses: nothing shown
    assert all(line == line.rstrip() for line in lines)
    assert usage_screen([], 0.0).startswith("cmlcluster: 0 live sessions, ")


def test_the_watch_lists_live_sessions_without_asking_any_gone_ones_controller(tmp_path, monkeypatch):
    # A gone session's controller may sit on a network that is gone too: asking it takes up to a second,
    # and a refresh that asked many outlived a CI run's Ctrl-C. The watch shows live sessions only.
    from cmlcluster import origin, records
    from cmlcluster.__main__ import _live_records

    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(tmp_path))
    here = origin.this_process().as_strings()
    gone = {**here, "pid": "999999999"}
    for name, where in (("alive", here), ("gone", gone)):
        record = {"id": name, "origin": where, "controller": "10.200.9.1:4000", "workers": []}
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    asked = []
    monkeypatch.setattr(origin, "answers", lambda address, timeout=1.0: asked.append(address) or False)
    assert [r["id"] for r in _live_records()] == ["alive"] and not any(asked)
    assert {r["id"]: r["state"] for r in records.records()} == {"alive": origin.ALIVE, "gone": origin.GONE}
    assert any(asked)  # what `list` and `cleanup` do ask, to tell GONE from ANSWERING
