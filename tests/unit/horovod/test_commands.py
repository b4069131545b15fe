"""The pure Horovod builders: horovodrun and mpirun argv, hostfiles, ssh config, known_hosts."""

from __future__ import annotations

import shlex

import pytest

from cmlcluster.errors import ConfigError
from cmlcluster.horovod import commands
from cmlcluster.ssh.config import known_hosts_text, ssh_config_text
from cmlcluster.ssh.keys import new_ed25519


def test_horovodrun_argv_for_several_layouts():
    assert commands.horovodrun_argv(2, [("10.0.0.2", 1), ("10.0.0.3", 1)], ["python", "train.py"]) == [
        "horovodrun", "-np", "2", "-H", "10.0.0.2:1,10.0.0.3:1", "-p", "2222", "python", "train.py",
    ]  # fmt: skip
    argv = commands.horovodrun_argv(
        6,
        [("10.0.0.2", 4), ("10.0.0.3", 4)],
        ["/venv/bin/python", "train.py", "--epochs", "3"],
        ssh_port=2022,
        identity_file="/s/id_ed25519",
        start_timeout=90,
        network_interfaces=["eth0", "eth1"],
        horovodrun=["/venv/bin/python", "-m", "cmlcluster.horovod.driver"],
    )
    assert argv == [
        "/venv/bin/python", "-m", "cmlcluster.horovod.driver",
        "-np", "6", "-H", "10.0.0.2:4,10.0.0.3:4", "-p", "2022", "-i", "/s/id_ed25519",
        "--start-timeout", "90", "--network-interfaces", "eth0,eth1",
        "/venv/bin/python", "train.py", "--epochs", "3",
    ]  # fmt: skip
    # Local ranks: no ssh port at all.
    assert commands.horovodrun_argv(2, [("localhost", 2)], ["python", "t.py"], ssh_port=None) == [
        "horovodrun", "-np", "2", "-H", "localhost:2", "python", "t.py",
    ]  # fmt: skip


def test_mpirun_argv_uses_the_workers_ssh_port_and_nics():
    argv = commands.mpirun_argv(
        4,
        [("10.0.0.2", 2), ("10.0.0.3", 2)],
        ["python", "train.py"],
        identity_file="/s/id",
        known_hosts="/s/known_hosts",
        network_interfaces=["eth0"],
    )
    assert argv[:5] == ["mpirun", "-np", "4", "-H", "10.0.0.2:2,10.0.0.3:2"]
    rsh = argv[argv.index("plm_rsh_args") + 1]
    assert shlex.split(rsh) == [
        "-p", "2222", "-i", "/s/id", "-o", "StrictHostKeyChecking=yes", "-o", "UserKnownHostsFile=/s/known_hosts",
    ]  # fmt: skip
    assert argv[argv.index("btl_tcp_if_include") + 1] == "eth0"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-x"] == ["PATH", "LD_LIBRARY_PATH", "PYTHONPATH"]
    assert argv[-2:] == ["python", "train.py"]


def test_hostfile_ssh_config_and_known_hosts_text():
    assert commands.hostfile_text([("10.0.0.2", 4), ("10.0.0.3", 2)]) == "10.0.0.2 slots=4\n10.0.0.3 slots=2\n"
    config = ssh_config_text({"10.0.0.2": "alice"}, 2222, "/s/id_ed25519", "/s/known_hosts")
    assert config.splitlines() == [
        "Host 10.0.0.2",
        "    Port 2222",
        "    User alice",
        "    IdentityFile /s/id_ed25519",
        "    IdentitiesOnly yes",
        "    UserKnownHostsFile /s/known_hosts",
        "    StrictHostKeyChecking yes",
        "    PasswordAuthentication no",
        "    BatchMode yes",
    ]
    key = new_ed25519()[1].split()[1]  # known_hosts takes real keys only (test_ssh_hardening)
    known = known_hosts_text({"10.0.0.2": f"ssh-ed25519 {key} worker-comment"}, 2222)
    assert known == f"[10.0.0.2]:2222 ssh-ed25519 {key}\n"
    assert known_hosts_text({"h": f"ssh-ed25519 {key}"}, 22) == f"h ssh-ed25519 {key}\n"


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: commands.horovodrun_argv(3, [("a", 1), ("b", 1)], ["python"]), "np=3: the hosts have 2 slots"),
        (lambda: commands.horovodrun_argv(0, [("a", 1)], ["python"]), "np=0"),
        (lambda: commands.horovodrun_argv(1, [], ["python"]), "hosts=\\[\\]"),
        (lambda: commands.horovodrun_argv(1, [("a", 0)], ["python"]), "slots=0"),
        (lambda: commands.horovodrun_argv(1, [("a", 1), ("a", 1)], ["python"]), "listed twice"),
        (lambda: commands.horovodrun_argv(1, [("a b", 1)], ["python"]), "host 'a b'"),
        (lambda: commands.horovodrun_argv(1, [("a", 1)], []), "command=\\[\\]"),
        (lambda: commands.horovodrun_argv(1, [("a", 1)], ["p"], ssh_port=0), "ssh_port=0"),
        (lambda: commands.horovodrun_argv(1, [("a", 1)], ["p"], start_timeout=0), "start_timeout=0"),
        (lambda: known_hosts_text({"a": "not a key"}, 22), "not an OpenSSH public key"),
        (lambda: ssh_config_text({"a": "bad user"}, 22, "/k", "/kh"), "user 'bad user'"),
    ],
)
def test_bad_input_names_the_value(call, names):
    with pytest.raises(ConfigError, match=names):
        call()


def test_session_keys_are_fresh_ed25519_keys_paramiko_reads(tmp_path):
    import paramiko

    from cmlcluster.ssh.keys import SessionSSH

    first, second = SessionSSH.create(str(tmp_path)), SessionSSH.create(str(tmp_path))
    try:
        key = paramiko.Ed25519Key.from_private_key_file(first.identity_file)
        assert first.public_key.split()[:2] == [key.get_name(), key.get_base64()]
        assert first.public_key != second.public_key
        assert oct((tmp_path / first.identity_file).stat().st_mode & 0o777) == "0o600"
        wrapper = (tmp_path / first.ssh_wrapper_dir / "ssh").read_text()
        assert "StrictHostKeyChecking=yes" in wrapper and first.config in wrapper
    finally:
        first.close()
        second.close()
    assert list(tmp_path.iterdir()) == []


def test_run_horovod_refuses_bad_input_before_anything_starts(tmp_path):
    from cmlcluster import Session
    from cmlcluster.backends.fake import FakeBackend
    from cmlcluster.horovod import run_horovod

    script = tmp_path / "train.py"
    script.write_text("")
    with Session(FakeBackend(), echo=False) as s:
        for kwargs, names in [
            ({"np": 3, "workers": 1}, "np=3: 1 workers with 1 slots each hold 1 processes"),
            ({"np": 0}, "np=0"),
            ({"slots": 0}, "slots=0"),
            ({"workers": -1}, "workers=-1"),
        ]:
            with pytest.raises(ConfigError, match=names):
                run_horovod(str(script), session=s, **kwargs)
        with pytest.raises(ConfigError, match=r"script='missing\.py': no such file"):
            run_horovod("missing.py", session=s)
        assert s.list_workers() == []
