"""Results come home (collect=, cmlcluster/collect/paths.py): what workers in folders of their own write under
the paths named is in the session's working folder when each ends, whether it succeeded, failed or was
stopped, as on CML's shared disk; what else they leave there is named in one warning that says collect=.

For real, on SSH hosts (containers standing in for machines, which see none of the session's files:
tests/harness/sshhosts.py), on Docker containers that do not mount the working folder (mount_cwd=False), and on
the stand-in Kubernetes cluster's pods run from a folder off its shared volume (their files come through
their agents: collect/through_agents.py). One session each, three workers at once, to keep the suite short.
On the shared volume, pods write where the session reads, as on CML."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import tempfile
import time

import pytest
from harness.fixtures import DOCKER_TEST_IMAGE, kube_backend, ssh_backend

from cmlcluster import Session
from cmlcluster.backends.docker.backend import DockerBackend

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def program(name: str, code: int | None) -> str:
    """Write outputs/<name>.txt, outputs/shared.txt (a different content per worker) and stray.txt (not
    collected), then exit with `code`, or wait to be stopped (None)."""
    end = "import time\nprint('saved', flush=True)\ntime.sleep(600)" if code is None else f"raise SystemExit({code})"
    return (
        "import os\nos.makedirs('outputs/deep', exist_ok=True)\n"
        f"open('outputs/{name}.txt', 'w').write('made by {name}')\n"
        f"open('outputs/deep/{name}.bin', 'wb').write(bytes(range(256)) * 4)\n"
        f"open('outputs/shared.txt', 'w').write('{name} was here')\n"
        f"open('stray.txt', 'w').write('left by {name}')\n{end}\n"
    )


@pytest.fixture(params=["ssh", "docker", "kube"])
def own_folder_backend(request, tmp_path):
    """Backends whose workers start in a folder of their own, removed when they end; and the folder the
    session runs in (the stand-in's pods see the tests' whole temp folder: one outside it, for them)."""
    if request.param == "ssh":
        yield ssh_backend(request.getfixturevalue("ssh_hosts")), tmp_path
    elif request.param == "docker":
        yield DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, mount_cwd=False), tmp_path
    else:
        with tempfile.TemporaryDirectory() as elsewhere:
            yield kube_backend(request.getfixturevalue("kube")), pathlib.Path(elsewhere)


def test_files_come_home_when_workers_succeed_fail_or_are_stopped(own_folder_backend, monkeypatch, caplog):
    own_folder_backend, tmp_path = own_folder_backend
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "notes.md").write_text("the user's own")
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="cmlcluster"), Session(own_folder_backend, echo=False) as session:
        launch = {"cpu": 0.5, "memory": 0.5, "collect": ["outputs/"]}
        [ok] = session.launch_workers(1, code=program("ok", 0), **launch)
        [failing] = session.launch_workers(1, code=program("failing", 1), **launch)
        [stopped] = session.launch_workers(1, code=program("stopped", None), **launch)
        ended = session.await_workers([ok, failing], timeout_seconds=90)
        assert [w["status"] for w in ended["workers"]] == ["succeeded"]
        assert [(w["status"], w["exit_code"]) for w in ended["failures"]] == [("failed", 1)]
        # Reported ended: their files are here already.
        for name in ("ok", "failing"):
            assert (tmp_path / "outputs" / f"{name}.txt").read_text() == f"made by {name}"
            assert (tmp_path / "outputs" / "deep" / f"{name}.bin").read_bytes() == bytes(range(256)) * 4
        assert session.await_workers([stopped], wait_for_completion=False, timeout_seconds=60)["failures"] == []
        for _ in range(300):
            if "saved" in session.output(stopped):
                break
            time.sleep(0.1)
        [gone] = session.stop_workers(stopped)
        assert gone["status"] == "stopped"
        assert (tmp_path / "outputs" / "stopped.txt").read_text() == "made by stopped"
        # A program stopped midway names what it leaves in its own output: not what comes home.
        [left] = [line for line in session.output(stopped).splitlines() if line.startswith("cmlcluster: ")]
        assert "holds stray.txt (1 file" in left and "collect=['stray.txt']" in left and "outputs" not in left
    print(f"three workers, their files home, in {time.monotonic() - started:.1f} s")

    # Three workers wrote outputs/shared.txt: the last to end keeps the name, the others are beside it.
    ids = {ok["id"]: "ok", failing["id"]: "failing", stopped["id"]: "stopped"}
    shared = {p.name: p.read_text() for p in (tmp_path / "outputs").glob("shared.txt*")}
    assert shared["shared.txt"] == "stopped was here"  # stopped last
    assert {name: text for name, text in shared.items() if name != "shared.txt"} == {
        f"shared.txt.{worker}": f"{ids[worker]} was here" for worker in (ok["id"], failing["id"])
    }
    assert (tmp_path / "outputs" / "notes.md").read_text() == "the user's own"  # not a worker's: untouched
    assert not (tmp_path / "stray.txt").exists()  # not collected
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    both = [m for m in said if "both wrote outputs/shared.txt with different contents" in m]
    assert len(both) == 2, said  # once per pair of workers that met
    # What the ok worker leaves uncollected is named, with collect= as the way to keep it; not its outputs/.
    [left] = [m for m in said if f"worker {ok['id']}'s working folder" in m]
    assert "holds stray.txt (1 file" in left and "collect=['stray.txt']" in left and "outputs" not in left


def test_on_kubernetes_pods_on_the_shared_volume_write_where_the_session_reads(kube, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # on the claim that every pod mounts at the same path
    code = "import os\nos.makedirs('outputs')\nopen('outputs/k.txt', 'w').write('from a pod')\n"
    with Session(kube_backend(kube), echo=False) as session:
        [worker] = session.launch_workers(1, cpu=0.5, memory=0.5, code=code, collect="outputs")
        assert session.await_workers([worker], timeout_seconds=90)["failures"] == []
        assert (tmp_path / "outputs" / "k.txt").read_text() == "from a pod"  # written where the session reads


# A worker's stream made hostile at the worker's end, as another process of the worker's user there could:
# it waits for the worker's files to be set aside (an SSH host's temp folder, a pod agent's) and adds what
# collect=["outputs"] never asks for. On an SSH host that is another worker on the same host (the worker's
# own processes end before its files are set aside); in a pod, a process the worker's program started.
INJECT = """
import os, sys, tempfile, time
worker = {target}
roots = (tempfile.gettempdir(), "/tmp")
aside = {{os.path.join(t, f"cmlcluster-results-{{os.getuid()}}", worker, "files") for t in roots}}
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    for files in aside:
        if os.path.isdir(files):
            for name, text, mode in [
                ("train.py", "print('not yours')", 0o644),
                (".ipython/profile_default/startup/00-x.py", "open('/tmp/pwned', 'w')", 0o644),
                (".git/hooks/post-checkout", "#!/bin/sh\\ntouch /tmp/pwned\\n", 0o755),
            ]:
                os.makedirs(os.path.dirname(os.path.join(files, name)), exist_ok=True)
                with open(os.path.join(files, name), "w") as f:
                    f.write(text)
                os.chmod(os.path.join(files, name), mode)
            sys.exit(0)
    time.sleep(0.001)
sys.exit("never saw " + " or ".join(aside))
"""
# The worker's own program: in its folder, a file the user has at home (outputs/notes.md), a set-id
# script, a file under outputs/link (a link out of the folder at home) and 2,000 empty files.
HOSTILE_PROGRAM = """
import os, subprocess, sys
os.makedirs("outputs/link", exist_ok=True)
os.makedirs("outputs/zz-bulk", exist_ok=True)
open("outputs/notes.md", "w").write("from the worker")
open("outputs/link/x.py", "w").write("through the user's link")
open("outputs/run.sh", "w").write("#!/bin/sh\\n")
os.chmod("outputs/run.sh", 0o4755)
open("outputs/data.csv", "w").write("1,2\\n")
os.chmod("outputs/data.csv", 0o666)
for i in range(2000):
    open(f"outputs/zz-bulk/{i:04}", "w").close()
"""
SPAWN_INJECTOR = f"""
child = subprocess.Popen([sys.executable, "-c", {INJECT.format(target='os.environ["CDSW_ENGINE_ID"]')!r}],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         start_new_session=True)
assert child.stdout.readline() == b"ready\\n"
"""


def test_a_hostile_worker_brings_home_only_what_collect_asks_for(own_folder_backend, monkeypatch, caplog, request):
    own_folder_backend, tmp_path = own_folder_backend
    if own_folder_backend.name == "ssh":  # one host, for the worker beside it
        hosts = request.getfixturevalue("ssh_hosts")
        own_folder_backend = ssh_backend(dataclasses.replace(hosts, hosts=hosts.hosts[:1]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CMLCLUSTER_COLLECT_CAP_FILES", "1000")
    (tmp_path / "train.py").write_text("print('train')")
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "notes.md").write_text("the user's own")
    launch = {"cpu": 0.5, "memory": 0.5, "collect": "outputs"}
    with tempfile.TemporaryDirectory() as outside, caplog.at_level(logging.WARNING, logger="cmlcluster"):
        (tmp_path / "outputs" / "link").symlink_to(outside)  # the user's own link, out of the folder
        with Session(own_folder_backend, echo=False) as session:
            beside = []
            if own_folder_backend.name == "ssh":  # waits for the next worker's files ("<session>-1")
                target = 'os.environ["CDSW_ENGINE_ID"].rpartition("-")[0] + "-1"'
                beside = session.launch_workers(1, code=INJECT.format(target=target), **launch)
                session.await_workers(beside, wait_for_completion=False, timeout_seconds=60)
            spawn = SPAWN_INJECTOR if own_folder_backend.name == "kubernetes" else ""
            [w] = session.launch_workers(1, code=HOSTILE_PROGRAM + spawn, **launch)
            assert session.await_workers([w, *beside], timeout_seconds=90)["failures"] == []
        assert os.listdir(outside) == []  # nothing through the user's link
    top = sorted(p.name for p in tmp_path.iterdir())
    assert top == ["outputs", "train.py"] and (tmp_path / "train.py").read_text() == "print('train')"
    outputs = tmp_path / "outputs"
    assert (outputs / "notes.md").read_text() == "the user's own"
    assert (outputs / f"notes.md.{w['id']}").read_text() == "from the worker"
    assert (outputs / "run.sh").stat().st_mode & 0o7777 == 0o755
    assert (outputs / "data.csv").stat().st_mode & 0o777 == 0o644
    assert 990 <= len(os.listdir(outputs / "zz-bulk")) < 1000
    [said] = [r.getMessage() for r in caplog.records if f"of worker {w['id']}'s collect= files" in r.getMessage()]
    assert "past the 1000-file cap (CMLCLUSTER_COLLECT_CAP_FILES)" in said
    assert "outputs/link/x.py (outputs/link is a link here, and nothing is written through one)" in said
    assert f"outputs/notes.md (the worker's is outputs/notes.md.{w['id']})" in said
    if own_folder_backend.name != "docker":  # Docker copies each collect= path out: no other name comes
        assert "it sent 3 files that collect=['outputs'] does not ask for, dropped: train.py, .git/hooks" in said
