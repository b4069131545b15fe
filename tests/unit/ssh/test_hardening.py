"""SSH done narrowly: host entries that cannot become ssh options, a worker's sshd that admits one user on
one address and forwards nothing, host keys trusted on first use kept out of the user's own known_hosts,
and a Horovod run's env= handed to ranks in a file rather than on a command line."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import types

import pytest

from cmlcluster.backends.ssh.backend import SSHBackend, parse_hosts
from cmlcluster.errors import ConfigError, WorkerError
from cmlcluster.horovod import commands
from cmlcluster.ssh import sshd
from cmlcluster.ssh.config import (
    MAX_WORKER_ADDRESSES,
    SshdAnswer,
    interface_addresses,
    known_hosts_text,
    public_key,
    ssh_config_text,
    sshd_answer,
    sshd_config_text,
)
from cmlcluster.ssh.keys import new_ed25519

BAD_HOSTS = ["-oProxyCommand=touch /tmp/x", "-p2", "a]b", "[a", "a b", "alice@10.0.0.5", "a;b", "$(id)", "a`b`"]


@pytest.mark.parametrize("entry", BAD_HOSTS)
def test_a_host_entry_that_ssh_could_read_as_an_option_or_more_is_refused_naming_it(entry, tmp_path):
    refused = r"(is not a host name or address|write 'host', 'host:slots')"  # the latter: spaces
    with pytest.raises(ConfigError, match=refused) as e:
        parse_hosts([entry])
    assert repr(entry) in str(e.value)
    hostfile = tmp_path / "machinefile"
    hostfile.write_text(f"good slots=2\n{entry} slots=1\n")
    with pytest.raises(ConfigError, match=rf"machinefile: .*{refused}") as e:
        parse_hosts(hostfile=str(hostfile))
    assert entry in str(e.value)


def test_good_host_entries_are_kept():
    hosts = ["10.0.0.5:2", "node-1.example.com", "[fe80::1%eth0]:3", "xn--bcher-kva.example"]
    assert parse_hosts(hosts) == [("10.0.0.5", 2), ("node-1.example.com", 1), ("fe80::1%eth0", 3), (hosts[3], 1)]


@pytest.mark.parametrize("host", ["-oProxyCommand=x", "a[1]", "a b", "a,b", "", None])
def test_horovod_hosts_and_ssh_config_refuse_the_same_entries(host):
    with pytest.raises(ConfigError, match="give an IP address or host name"):
        commands.horovodrun_argv(1, [(host, 1)], ["python", "train.py"])
    with pytest.raises(ConfigError, match="give an IP address or host name"):
        commands.hostfile_text([(host, 1)])
    with pytest.raises(ConfigError, match="give an IP address or host name"):
        ssh_config_text({host: "root"}, 2222, "/k", "/known_hosts")


def test_the_workers_sshd_admits_one_user_on_one_address_and_forwards_nothing():
    text = sshd_config_text("/tmp/s", 2222, "alice", {"CMLCLUSTER_WORKDIR": "/w"}, listen="10.0.0.7")
    options = dict(line.split(" ", 1) for line in text.splitlines())
    assert options["AllowUsers"] == "alice"
    assert options["ListenAddress"] == "10.0.0.7"
    for name in ("AllowTcpForwarding", "AllowStreamLocalForwarding", "X11Forwarding", "AllowAgentForwarding"):
        assert options[name] == "no", name
    assert options["PermitTunnel"] == options["GatewayPorts"] == options["PermitUserEnvironment"] == "no"
    assert options["DisableForwarding"] == "yes"
    assert options["PasswordAuthentication"] == options["KbdInteractiveAuthentication"] == "no"
    assert options["SetEnv"] == '"CMLCLUSTER_WORKDIR=/w"'
    # Without the peers' address (a worker alone cannot tell it), every address; the rest the same.
    assert "ListenAddress" not in sshd_config_text("/tmp/s", 2222, "alice", {})
    with pytest.raises(ConfigError, match="listen='-x'"):
        sshd_config_text("/tmp/s", 2222, "alice", {}, listen="-x")
    with pytest.raises(ConfigError, match="user 'a b'"):
        sshd_config_text("/tmp/s", 2222, "a b", {})


def test_keys_trusted_on_first_use_go_to_cmlclusters_own_file_never_the_users(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    users = home / ".ssh" / "known_hosts"
    users.write_text("10.0.0.9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    argv = SSHBackend(["10.0.0.5"], trust_on_first_use=True).ssh_argv("10.0.0.5", "true")
    ours = home / ".config" / "cmlcluster" / "known_hosts"
    assert f'UserKnownHostsFile="{ours}" ~/.ssh/known_hosts' in argv  # new keys go to the first file only
    assert "StrictHostKeyChecking=accept-new" in argv
    assert oct(ours.stat().st_mode & 0o777) == "0o600" and oct(ours.parent.stat().st_mode & 0o777) == "0o700"
    assert users.read_text() == "10.0.0.9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB\n"
    # Without trust-on-first-use nothing is written anywhere: ssh's own files, checked strictly.
    strict = SSHBackend(["10.0.0.5"]).ssh_argv("10.0.0.5", "true")
    assert "StrictHostKeyChecking=yes" in strict and not any("UserKnownHostsFile" in a for a in strict)
    # A file the user names is used as given; '%' and spaces survive ssh's reading of it.
    odd = tmp_path / "my hosts%d"
    odd.write_text("")
    named = SSHBackend(["10.0.0.5"], known_hosts=str(odd), trust_on_first_use=True).ssh_argv("10.0.0.5", "true")
    assert f'UserKnownHostsFile="{str(odd).replace("%", "%%")}"' in named


def test_a_rank_starts_again_with_the_runs_env_from_its_file_never_its_command_line(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys\n"
        "print(os.environ['CMLC_MARKER'], os.environ.get('PYTHONHASHSEED'), 'CMLCLUSTER_RANK_ENV' in os.environ)\n"
        "print(sys.argv[1:])\n"
    )
    env_file = tmp_path / "env.json"
    sshd.write_env_file(str(env_file), {"CMLC_MARKER": "m4rker", "PYTHONHASHSEED": "7"})
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    assert json.loads(env_file.read_text()) == {"CMLC_MARKER": "m4rker", "PYTHONHASHSEED": "7"}
    env = {**os.environ, "CMLCLUSTER_RANK_ENV": str(env_file)}
    env.pop("CMLC_MARKER", None)
    ran = subprocess.run(
        [sys.executable, "-m", "cmlcluster.horovod.rank", str(script), "--x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["m4rker 7 False", "['--x']"]  # PYTHONHASHSEED: set before Python started
    # A file that is not there is an error that says so, not a rank without its variables.
    env["CMLCLUSTER_RANK_ENV"] = str(tmp_path / "gone.json")
    ran = subprocess.run(
        [sys.executable, "-m", "cmlcluster.horovod.rank", str(script)], env=env, capture_output=True, text=True
    )
    assert ran.returncode == 1 and "env= file" in ran.stderr and "gone.json" in ran.stderr


def test_a_uid_without_a_passwd_entry_and_no_nss_wrapper_is_refused_naming_the_uid_and_the_fix(tmp_path, monkeypatch):
    def unnamed(uid: int):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(sshd.pwd, "getpwuid", unnamed)
    monkeypatch.setattr(sshd, "nss_wrapper", lambda: None)
    with pytest.raises(RuntimeError, match=rf"uid {os.getuid()}, which /etc/passwd does not name.*libnss-wrapper"):
        sshd._user_and_env(str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing written for an sshd that will not start


def test_a_uid_without_a_passwd_entry_is_named_in_sshds_own_passwd_file_read_through_nss_wrapper(tmp_path, monkeypatch):
    monkeypatch.setattr(sshd.pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    monkeypatch.setattr(sshd, "nss_wrapper", lambda: "/usr/lib/x/libnss_wrapper.so")
    user, env = sshd._user_and_env(str(tmp_path))
    assert user == sshd.UNNAMED_USER and env is not None
    assert env["LD_PRELOAD"] == "/usr/lib/x/libnss_wrapper.so"
    passwd = (tmp_path / "passwd").read_text().splitlines()
    assert passwd[-1].startswith(f"{sshd.UNNAMED_USER}:x:{os.getuid()}:{os.getgid()}:")
    assert passwd[:-1] == open("/etc/passwd").read().splitlines()  # everyone else still resolves
    assert env["NSS_WRAPPER_PASSWD"] == str(tmp_path / "passwd")
    assert (tmp_path / "passwd").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- what a worker's sshd answers


def _public_keys() -> dict[str, str]:
    """One real public key line of each host key type sshd offers, as `ssh-keygen -y` writes them."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    openssh = (serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return {
        "ssh-ed25519": new_ed25519(comment="cmlcluster-worker")[1],
        "ecdsa-sha2-nistp256": ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(*openssh).decode(),
        "ssh-rsa": rsa.generate_private_key(65537, 2048).public_key().public_bytes(*openssh).decode(),
    }


def _blob(*parts: bytes) -> str:
    return base64.b64encode(b"".join(struct.pack(">I", len(p)) + p for p in parts)).decode()


def _hostile_keys() -> dict[str, str]:
    good = new_ed25519()[1]
    kind, blob = good.split()[:2]
    raw = base64.b64decode(blob)
    rsa_blob = _blob(b"ssh-rsa", bytes([1, 0, 1]), bytes(64))
    other_curve = _blob(b"ecdsa-sha2-nistp256", b"nistp384", bytes([4]))
    ecdsa = _public_keys()["ecdsa-sha2-nistp256"].split()[1]  # 104 bytes: its last sextet has 2 unused bits
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    loose = ecdsa[:-2] + alphabet[alphabet.index(ecdsa[-2]) ^ 1] + "="  # decodes to the same bytes
    return {
        "a second line for every host": f"{good}\n* {good}",
        "a second line after a carriage return": f"{good}\r\n* {good}",
        "a NUL": f"{good}\0",
        "a type sshd does not offer": f"ssh-dss {blob}",
        "no key at all": "ssh-ed25519",
        "a blob of another type": f"ssh-ed25519 {rsa_blob}",
        "a blob that says ed25519 for an ecdsa key": f"ecdsa-sha2-nistp256 {blob}",
        "a cut blob": f"{kind} {base64.b64encode(raw[:-5]).decode()}",
        "bytes after the blob": f"{kind} {base64.b64encode(raw + b'x').decode()}",
        "a short ed25519 key": f"{kind} {_blob(b'ssh-ed25519', b'k' * 31)}",
        "an ecdsa key on another curve": f"ecdsa-sha2-nistp256 {other_curve}",
        "not base64": f"{kind} {blob[:-4]}!!!!",
        "non-canonical base64": f"ecdsa-sha2-nistp256 {loose}",
        "a pattern instead of a key": "* ssh-ed25519",
    }


@pytest.mark.parametrize("case", list(_hostile_keys()))
def test_known_hosts_takes_one_checked_public_key_per_host_never_a_second_line(case):
    key = _hostile_keys()[case]
    with pytest.raises(ConfigError, match=r"host key of '10\.0\.0\.2' is not an OpenSSH public key: ") as e:
        known_hosts_text({"10.0.0.2": key}, 2222)
    assert "\n" not in str(e.value).partition(": ")[2].split(":", 1)[0]  # the reason, not the hostile text


def test_known_hosts_pins_every_key_type_sshd_offers_without_its_comment():
    for kind, key in _public_keys().items():
        assert public_key(key) == (kind, key.split()[1])
        assert known_hosts_text({"10.0.0.2": key}, 2222) == f"[10.0.0.2]:2222 {kind} {key.split()[1]}\n"


A = ["10.0.0.2"]  # a good answer's addresses


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ({"host_key": "*", "user": "alice", "addresses": A}, "host_key is not an OpenSSH public key"),
        ({"host_key": "GOOD\n* GOOD", "user": "alice", "addresses": A}, "line break"),
        ({"host_key": "GOOD", "user": "alice\nHost *", "addresses": A}, "user is not a login name"),
        ({"host_key": "GOOD", "user": "root@evil", "addresses": A}, "user is not a login name"),
        ({"host_key": "GOOD", "user": "-oProxyCommand=x", "addresses": A}, "user is not a login name"),
        ({"host_key": "GOOD", "user": 0, "addresses": A}, "user is not a login name"),
        ({"host_key": "GOOD", "user": "alice", "addresses": A, "more": 1}, "expected a dict of"),
        (
            {"host_key": "GOOD", "user": "alice"},
            "expected a dict of host_key, user, addresses",
        ),
        (["GOOD", "alice"], "expected a dict of host_key, user, addresses and interface, got list"),
        # The name of its interface toward the session: horovodrun puts it unquoted in a shell command.
        ({"host_key": "GOOD", "user": "alice", "addresses": A, "interface": "eth0;id"}, "interface"),
        ({"host_key": "GOOD", "user": "alice", "addresses": A, "interface": "-eth0"}, "interface"),
        ({"host_key": "GOOD", "user": "alice", "addresses": A, "interface": "e" * 16}, "interface"),
        ({"host_key": "GOOD", "user": "alice", "addresses": A, "interface": "eth 0"}, "interface"),
        ({"host_key": "GOOD", "user": "alice", "addresses": A, "interface": "eth0\n"}, "interface"),
        ({"host_key": "GOOD", "user": "alice", "addresses": A, "interface": ""}, "interface"),
        ({"host_key": "GOOD", "user": "alice", "addresses": A, "interface": 0}, "interface"),
        # The worker's interface addresses: IP addresses only, a bounded list, none loopback or catch-all.
        ({"host_key": "GOOD", "user": "alice", "addresses": "10.0.0.2"}, "addresses: expected a list"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["10.0.0.2", "*"]}, "item 1 is not an IP"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["10.0.0.0/8"]}, "item 0 is not an IP"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["fe80::1%eth0"]}, "item 0 is not an IP"),
        ({"host_key": "GOOD", "user": "alice", "addresses": [" 10.0.0.2"]}, "item 0 is not an IP"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["10.0.0.2\n"]}, "item 0 is not an IP"),
        ({"host_key": "GOOD", "user": "alice", "addresses": [167772162]}, "item 0 is not an IP"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["1" * 100]}, "item 0 is not an IP"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["127.0.0.1"]}, "item 0 is a loopback"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["0.0.0.0"]}, "item 0 is a loopback"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["::"]}, "item 0 is a loopback"),
        ({"host_key": "GOOD", "user": "alice", "addresses": ["224.0.0.1"]}, "item 0 is a loopback"),
        (
            {
                "host_key": "GOOD",
                "user": "alice",
                "addresses": [f"10.0.{i // 256}.{i % 256}" for i in range(257)],
            },
            "addresses: 257 of them, more than 256",
        ),
    ],
)
def test_a_workers_sshd_answer_is_checked_and_a_bad_one_fails_that_worker_by_name(answer, says):
    good = new_ed25519(comment="cmlcluster-worker")[1]
    if isinstance(answer, dict):
        answer = {k: v.replace("GOOD", good) if isinstance(v, str) else v for k, v in answer.items()}
        if "addresses" in answer:  # a good interface, unless the case is about it
            answer = {"interface": "eth0", **answer}
    with pytest.raises(WorkerError, match=r"^worker s1-3: its sshd's answer is refused: ") as e:
        sshd_answer("s1-3", answer)
    assert says in str(e.value) and e.value.worker_id == "s1-3"
    assert "\n" not in str(e.value) and "1111111111" not in str(e.value)  # never the answer's own text
    addresses = ["10.0.0.2", "192.168.50.2", "10.0.0.2", "fe80::1", "2001:DB8::1"]
    answer = {"host_key": good, "user": "alice", "addresses": addresses}
    checked = sshd_answer("s1-3", {**answer, "interface": "ens5"})
    assert checked == SshdAnswer(
        " ".join(good.split()[:2]),
        "alice",
        ("10.0.0.2", "192.168.50.2", "fe80::1", "2001:db8::1"),  # each once, as ipaddress writes it
        "ens5",
    )
    for name in ("eth0", "ib0", "eth0:1", "enp0s31f6", "br-b45386a32c3", "eth0.100"):
        assert sshd_answer("s1-3", {**answer, "interface": name}).interface == name
    empty = {"host_key": good, "user": "alice", "addresses": [], "interface": None}  # no psutil
    assert sshd_answer("s1-3", empty).addresses == () and sshd_answer("s1-3", empty).interface is None


def test_a_workers_sshd_reports_its_own_interface_addresses_but_loopback(monkeypatch):
    import psutil

    def address(family, text):  # as psutil.net_if_addrs lists them (netmask, broadcast, ptp left out)
        return types.SimpleNamespace(family=family, address=text)

    interfaces = {
        "lo": [address(socket.AF_INET, "127.0.0.1"), address(socket.AF_INET6, "::1")],
        "eth0": [address(socket.AF_INET, "10.0.0.2"), address(psutil.AF_LINK, "02:42:0a:00:00:02")],
        "ib0": [address(socket.AF_INET6, "fe80::2%ib0"), address(socket.AF_INET, "192.168.50.2")],
    }
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces)
    reported = sshd.interface_addresses()
    assert reported == ["10.0.0.2", "192.168.50.2", "fe80::2"]  # IPv4 first, the zone dropped
    assert interface_addresses(reported) == tuple(reported)  # what the session takes
    many = {f"veth{i}": [address(socket.AF_INET, f"10.1.{i // 256}.{i % 256}")] for i in range(300)}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: many)
    assert len(sshd.interface_addresses()) == MAX_WORKER_ADDRESSES


def test_a_hostile_sshd_answer_never_reaches_the_sessions_known_hosts(tmp_path):
    from cmlcluster.events import Member
    from cmlcluster.horovod.ssh_cluster import SSHCluster
    from cmlcluster.ssh.keys import SessionSSH

    good = new_ed25519()[1]

    class Workers:  # the session, as far as serve() asks it: each worker's answer to sshd.start
        def call_each(self, calls):
            return [
                {"host_key": good, "user": "alice", "addresses": ["10.0.0.2"], "interface": "eth0"}
                if worker == "s-0"
                else {
                    "host_key": f"{good}\n* {good}",
                    "user": "alice",
                    "addresses": ["10.0.0.3"],
                    "interface": "eth0",
                }
                for worker, _, _ in calls
            ]

    ssh = SessionSSH.create(str(tmp_path))
    try:
        cluster = SSHCluster(session=Workers(), hosts=[], ssh=ssh, job=None)  # type: ignore[arg-type]
        members = [Member("s-0", "host", 0, "10.0.0.2"), Member("s-1", "host", 1, "10.0.0.3")]
        with pytest.raises(WorkerError, match=r"worker s-1: its sshd's answer is refused: host_key .*line break"):
            cluster.serve(members)
        assert not os.path.exists(ssh.known_hosts) and not os.path.exists(ssh.config)
        assert cluster.hosts == []  # no rank is placed on either
    finally:
        ssh.close()


# ---------------------------------------------------------------- sshd's config: one line per setting


def test_setenv_values_that_would_add_a_line_or_end_a_word_are_refused_naming_the_variable():
    for value in ['x"\nAllowUsers root', "a\nb", "a\rb", "a\0b", 'a"b', "a\\b", "a\tb", "a\x85b"]:
        with pytest.raises(ConfigError, match=r"^SetEnv TMPDIR: sshd's config cannot carry a value holding") as e:
            sshd_config_text("/tmp/s", 2222, "alice", {"CMLCLUSTER_WORKDIR": "/w", "TMPDIR": value})
        assert "use a value without it" in str(e.value)
    for name in ["A B", "A=B", "1A", "", 'A"', "A\nAllowUsers root"]:
        with pytest.raises(ConfigError, match=rf"^SetEnv {re.escape(repr(name))}: not a variable name"):
            sshd_config_text("/tmp/s", 2222, "alice", {name: "v"})
    for user in ["alice\nAllowUsers root", "alice@host", "*", "-x", ""]:
        with pytest.raises(ConfigError, match="sshd admits a login name"):
            sshd_config_text("/tmp/s", 2222, user, {})
    with pytest.raises(ConfigError, match="sshd's folder '/tmp/a\\\\nb' \\(in the worker's TMPDIR\\)"):
        sshd_config_text("/tmp/a\nb", 2222, "alice", {})


def test_sshd_config_values_with_spaces_quotes_and_percents_stay_one_word_each():
    text = sshd_config_text("/tmp/my dir%u", 2222, "alice", {"TMPDIR": "/tmp/my dir", "CMLCLUSTER_FILES": "/f it's"})
    assert len(text.splitlines()) == text.count("\n") == 22
    lines = dict(line.split(" ", 1) for line in text.splitlines())
    assert lines["HostKey"] == '"/tmp/my dir%u/host_key"'
    assert lines["AuthorizedKeysFile"] == '"/tmp/my dir%%u/authorized_keys"'  # sshd expands %u there alone
    assert shlex.split(lines["SetEnv"]) == ["TMPDIR=/tmp/my dir", "CMLCLUSTER_FILES=/f it's"]


@pytest.mark.skipif(not os.path.exists("/usr/sbin/sshd") or not shutil.which("setpriv"), reason="no sshd here")
def test_sshd_itself_reads_each_value_as_one_word_on_its_own_line():
    # `sshd -T` prints the settings sshd read. As root it needs /run/sshd, so it runs as nobody
    # (65534) here, in a folder of its own that nobody can reach (in /tmp: the tests' own TMPDIR is
    # private). A space and a '%' in the folder's name.
    folder = tempfile.mkdtemp(prefix="cmlcluster sshd %test-", dir="/tmp" if os.geteuid() == 0 else None)
    try:
        private, _ = new_ed25519()
        env = {"TMPDIR": "/tmp/a b", "CMLCLUSTER_FILES": "/f it's #not a comment", "CUDA_VISIBLE_DEVICES": "0,1"}
        config = sshd_config_text(folder, 2299, "alice", env, listen="127.0.0.1")
        for name, text in (("host_key", private), ("sshd_config", config)):
            with open(os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(text)
        argv = ["/usr/sbin/sshd", "-T", "-f", os.path.join(folder, "sshd_config")]
        if os.geteuid() == 0:
            os.chmod(folder, 0o755)
            for name in ("", "host_key", "sshd_config"):
                os.chown(os.path.join(folder, name), 65534, 65534)
            argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
        ran = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert ran.returncode == 0, ran.stderr
        read = [line.split(" ", 1) for line in ran.stdout.splitlines()]
        assert [v for k, v in read if k == "setenv"] == [f"{k}={v}" for k, v in env.items()]
        assert [v for k, v in read if k == "allowusers"] == ["alice"]
        assert [v for k, v in read if k == "hostkey"] == [f"{folder}/host_key"]
        assert [v for k, v in read if k == "authorizedkeysfile"] == [f"{folder.replace('%', '%%')}/authorized_keys"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- the ssh horovodrun runs


def test_the_ssh_wrapper_and_config_survive_a_space_in_tmpdir(tmp_path, monkeypatch):
    from cmlcluster.ssh.keys import SessionSSH

    # A fake ssh, first on PATH when the wrapper is written: it prints the arguments it was given.
    fake = tmp_path / "fake bin"
    fake.mkdir()
    (fake / "ssh").write_text('#!/bin/sh\nfor a do printf "%s\\n" "$a"; done\n')
    (fake / "ssh").chmod(0o700)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    spaced = tmp_path / "my tmp"
    spaced.mkdir()
    ssh = SessionSSH.create(str(spaced))
    try:
        ssh.pin({"10.0.0.2": new_ed25519()[1]}, 2222, {"10.0.0.2": "alice"})
        wrapper = os.path.join(ssh.ssh_wrapper_dir, "ssh")
        assert f"exec {shlex.quote(str(fake / 'ssh'))} -F {shlex.quote(ssh.config)} " in open(wrapper).read()
        assert subprocess.run(["sh", "-n", wrapper], capture_output=True).returncode == 0
        ran = subprocess.run(
            [wrapper, "-o", "StrictHostKeyChecking=no", "10.0.0.2", "echo hi"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.splitlines() == ["-F", ssh.config, "-o", "StrictHostKeyChecking=yes", "10.0.0.2", "echo hi"]
        config = dict(line.strip().split(" ", 1) for line in open(ssh.config).read().splitlines()[1:])
        assert config["IdentityFile"] == f'"{ssh.identity_file}"'
        assert config["UserKnownHostsFile"] == f'"{ssh.known_hosts}"'
    finally:
        ssh.close()


@pytest.mark.skipif(not shutil.which("ssh"), reason="no ssh here")
def test_ssh_itself_reads_the_sessions_config_from_a_folder_with_a_space(tmp_path):
    from cmlcluster.ssh.keys import SessionSSH

    spaced = tmp_path / "my tmp%d"
    spaced.mkdir()
    ssh = SessionSSH.create(str(spaced))
    try:
        ssh.pin({"10.0.0.2": new_ed25519()[1]}, 2222, {"10.0.0.2": "alice"})
        ran = subprocess.run(["ssh", "-G", "-F", ssh.config, "10.0.0.2"], capture_output=True, text=True, timeout=30)
        assert ran.returncode == 0, ran.stderr
        read = dict(line.split(" ", 1) for line in ran.stdout.splitlines())
        assert read["user"] == "alice" and read["port"] == "2222"
        # One word each. -G shows the known_hosts file expanded ('%%' read as '%'), the identity
        # file as written: ssh expands its '%%' when it opens it.
        assert read["userknownhostsfile"] == ssh.known_hosts
        assert read["identityfile"] == ssh.identity_file.replace("%", "%%")
    finally:
        ssh.close()
