"""Real Horovod: %horovod in a real IPython shell on two Docker containers, two SSH hosts and two pods
of the stand-in Kubernetes cluster (sshd on port 2222 in a worker per host), and on local processes;
scripts and cells shipped to hosts that do not see them; failing ranks; hosts whose sshd is down; keys
and host keys that must not pass."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from harness.fixtures import DOCKER_TEST_IMAGE, kube_backend, ssh_backend
from harness.horovod_scripts import RANK

import cmlcluster
from cmlcluster import CmlClusterError, Session
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.events import OutputLine
from cmlcluster.horovod import run_horovod
from cmlcluster.ssh.keys import SessionSSH, new_ed25519
from cmlcluster.ssh.preflight import Login, check_logins


def check_hosts(ips, port, identity, known_hosts):
    check_logins([Login(ip, port, "root") for ip in ips], identity, known_hosts, what="Horovod hosts")


pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "worker_scripts" / "horovod_keras_train.py"


def docker_backend(tmp_path_factory):
    shared = str(tmp_path_factory.getbasetemp())
    return DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, volumes={shared: shared})


def check_allreduce(result, n_hosts):
    assert result.ok, result.message
    assert sorted(result.output) == [0, 1]
    outputs = ["\n".join(result.output[rank]) for rank in (0, 1)]
    sizes = [re.search(r"rank (\d) of size (\d) on host (\S+)", text) for text in outputs]
    assert [(m.group(1), m.group(2)) for m in sizes] == [("0", "2"), ("1", "2")]
    assert len({m.group(3) for m in sizes}) == n_hosts
    checksums = [re.search(r"weights checksum (\S+)", text).group(1) for text in outputs]
    assert checksums[0] == checksums[1]  # every step applied the same averaged gradients
    losses = [re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups() for text in outputs]
    assert all(float(last) < float(first) for first, last in losses)


def horovod_backend(name, request, tmp_path_factory):
    if name == "docker":
        return docker_backend(tmp_path_factory)
    if name == "docker as a uid the image does not name":  # sshd through libnss_wrapper, no capabilities
        # mount_cwd=False: the checkout, the tests' working folder, may be private to root (a mktemp -d clone).
        return DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, user="4321:4321", mount_cwd=False)
    if name == "ssh":
        return ssh_backend(request.getfixturevalue("ssh_hosts"))
    if name == "kubernetes":
        return kube_backend(request.getfixturevalue("kube"))
    return name


# SSH hosts in the default run; Docker (as root, and as a uid the image does not name) and pods in the matrix
# tier: to horovodrun they are hosts with sshd on their own IPs too. In the default run Horovod reaches Docker
# workers over SSH in test_horovod_elastic, test_faults and the failing rank below, and a worker's sshd runs as
# a uid /etc/passwd does not name in test_secrets.
@pytest.mark.parametrize(
    "backend_name",
    [
        pytest.param("docker", marks=pytest.mark.matrix),
        pytest.param("docker as a uid the image does not name", marks=pytest.mark.matrix),
        "ssh",
        pytest.param("kubernetes", marks=pytest.mark.matrix),
    ],
)
def test_horovod_magic_on_two_hosts_over_ssh(backend_name, shell, request, tmp_path_factory, capsys):
    # As a new user does: a script in the system's temp folder, which no worker sees.
    folder = tempfile.mkdtemp(prefix="hvd-script-")
    try:
        script = Path(folder) / "train.py"
        script.write_text(EXAMPLE.read_text())
        cmlcluster.use_backend(horovod_backend(backend_name, request, tmp_path_factory))
        result = shell.run_line_magic("horovod", f"-np 2 {script} --epochs 2")
    finally:
        shutil.rmtree(folder)
    check_allreduce(result, n_hosts=2)
    # Shipped: every rank ran a copy in its worker's folder, found by name.
    assert result.argv[-4:] == ["cmlcluster.horovod.rank", "train.py", "--epochs", "2"]
    assert len({h for h, _ in result.hosts}) == 2 and {s for _, s in result.hosts} == {1}
    assert result.argv[result.argv.index("-p") + 1] == "2222"
    assert result.argv[result.argv.index("-H") + 1] == ",".join(f"{h}:1" for h, _ in result.hosts)
    # Live, rank-prefixed output in the notebook.
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 of size 2" in out and "[rank 1] rank 1 of size 2" in out
    # Torn down: workers stopped, the session's key and files gone.
    assert {w["status"] for w in cmlcluster.list_workers()} == {"stopped"}
    identity = result.argv[result.argv.index("-i") + 1]
    assert not Path(identity).exists() and not Path(identity).parent.exists()


# On a host that sees none of the session's files the cell is shipped as a script is (above): SSH in the
# matrix tier.
# The cell magic on local workers runs as the README shows it, in the default run (test_readme_snippets.py).
@pytest.mark.parametrize("backend_name", [pytest.param(b, marks=pytest.mark.matrix) for b in ("local", "ssh")])
def test_horovod_cell_magic(backend_name, shell, request, tmp_path_factory):
    cmlcluster.use_backend(horovod_backend(backend_name, request, tmp_path_factory))
    result = shell.run_cell_magic(
        "horovod",
        "-np 2",
        EXAMPLE.read_text().replace("options = parser.parse_args()", "options = parser.parse_args([])"),
    )
    if backend_name == "local":
        check_allreduce(result, n_hosts=1)
        assert "-p" not in result.argv and result.hosts == [("localhost", 2)]
    else:  # the cell travelled to two hosts that see none of the session's files
        check_allreduce(result, n_hosts=2)
        assert result.argv[-1] == "horovod_cell.py"
    assert not Path(result.argv[-1]).parent.exists() or result.argv[-1] == "horovod_cell.py"


FAILING = f"""{RANK}
import sys, time
print(f"rank {{rank}} started", flush=True)
if rank == 1:
    print("rank 1: the data shard is corrupt", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(600)
"""


def test_a_failing_rank_is_named_the_other_stopped_and_workers_torn_down(tmp_path, tmp_path_factory):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    with Session(docker_backend(tmp_path_factory), echo=False) as session:
        events = []
        session.subscribe(events.append)
        result = run_horovod(str(script), np=2, session=session, echo=False)
        assert not result.ok and result.failed_rank == 1
        # Its ranks' lines reach the session's subscribers, echo or not (as torchrun's do).
        said = {(e.source, e.text) for e in events if isinstance(e, OutputLine)}
        assert ("rank 1", "rank 1: the data shard is corrupt") in said, sorted(said)  # rank 0 may be cut short
        assert result.rank_exit_codes[1] == 3
        assert "rank 1 exited with code 3" in result.message
        assert "the data shard is corrupt" in result.message
        assert result.duration < 300  # rank 0 (sleeping 600 s) was stopped, not waited for
        assert {w["status"] for w in session.list_workers()} == {"stopped"}


def test_sshd_down_wrong_key_and_wrong_host_key_are_refused_before_horovodrun(tmp_path, tmp_path_factory):
    with Session(docker_backend(tmp_path_factory), echo=False) as session:
        workers = session.launch_workers(2, cpu=0.5, memory=1)
        up = session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)["workers"]
        ips = [w["ip_address"] for w in up]
        ssh = SessionSSH.create(str(tmp_path))
        started = session.call_each([(w["id"], "cmlcluster.ssh.sshd:start", (ssh.public_key, 2222)) for w in up])
        host_keys = [s["host_key"] for s in started]
        assert {s["user"] for s in started} == {"root"}
        users = dict.fromkeys(ips, "root")
        ssh.pin(dict(zip(ips, host_keys, strict=True)), 2222, users)
        check_hosts(ips, 2222, ssh.identity_file, ssh.known_hosts)  # both fine

        # Plain ssh works with the session's config; the wrapper horovodrun uses keeps checking host keys.
        wrapper = f"{ssh.ssh_wrapper_dir}/ssh"
        ran = subprocess.run([wrapper, "-o", "StrictHostKeyChecking=no", ips[0], "hostname"], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        assert ran.stdout.strip() == f"worker-{up[0]['id']}", ran.stderr

        # A key that is not the session's is refused: key-only, only that key.
        other = tmp_path / "other_key"
        other.write_text(new_ed25519()[0])
        other.chmod(0o600)
        with pytest.raises(CmlClusterError, match=r"(?s)2 of 2 Horovod hosts.*SSH refused: Authentication failed"):
            check_hosts(ips, 2222, str(other), ssh.known_hosts)

        # A host presenting another host key than the pinned one is refused, by paramiko and by ssh,
        # even when asked (as horovodrun asks) not to check.
        impostor = tmp_path / "known_hosts_impostor"
        impostor.write_text(f"[{ips[0]}]:2222 {new_ed25519()[1]}\n[{ips[1]}]:2222 {host_keys[1]}\n")
        with pytest.raises(
            CmlClusterError, match=rf"(?s)1 of 2 .*\n  root@{ips[0]}:2222: its host key is not the one pinned"
        ):
            check_hosts(ips, 2222, ssh.identity_file, str(impostor))
        ssh.pin({ips[0]: new_ed25519()[1], ips[1]: host_keys[1]}, 2222, users)
        ran = subprocess.run([wrapper, "-o", "StrictHostKeyChecking=no", ips[0], "true"], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        assert ran.returncode != 0 and "HOST IDENTIFICATION HAS CHANGED" in ran.stderr
        ssh.pin(dict(zip(ips, host_keys, strict=True)), 2222, users)

        # Passwords are not even offered.
        import paramiko

        transport = paramiko.Transport((ips[0], 2222))
        transport.start_client(timeout=10)
        with pytest.raises(paramiko.BadAuthenticationType) as refused:
            transport.auth_none("root")
        assert refused.value.allowed_types == ["publickey"]
        transport.close()

        # sshd down on one host: named, with its reason, before anything runs.
        session.call(up[1]["id"], "cmlcluster.ssh.sshd:stop")
        with pytest.raises(CmlClusterError, match=rf"(?s)1 of 2 Horovod hosts.*\n  root@{ips[1]}:2222: cannot connect"):
            check_hosts(ips, 2222, ssh.identity_file, ssh.known_hosts)
        ssh.close()
