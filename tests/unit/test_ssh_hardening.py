"""SSH done narrowly: host entries that cannot become ssh options, a worker's sshd that admits one user on
one address and forwards nothing, host keys trusted on first use kept out of the user's own known_hosts,
and a Horovod run's env= handed to ranks in a file rather than on a command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cmlcluster.backends.ssh import SSHBackend, parse_hosts
from cmlcluster.errors import ConfigError
from cmlcluster.horovod import commands
from cmlcluster.ssh import sshd
from cmlcluster.ssh.config import ssh_config_text, sshd_config_text

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
