"""The slurm backend on a machine that reaches Slurm only over SSH: its options checked before anything
starts, and every Slurm command run on the login node through the one ssh command line (ssh/client.py)."""

from __future__ import annotations

import pytest

from cmlcluster import ConfigError
from cmlcluster.backends.slurm.backend import SlurmBackend


def test_every_slurm_command_runs_on_the_login_node_with_its_host_key_pinned(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "12")  # this machine's own allocation, if any, is not the cluster's
    key, known = tmp_path / "id", tmp_path / "known_hosts"
    key.write_text("k")
    known.write_text("")
    backend = SlurmBackend(
        login="alice@login1.hpc.example", identity=str(key), known_hosts=str(known), slurm_conf="/etc/slurm/x.conf"
    )
    assert backend.allocation == "" and backend.login == "login1.hpc.example"
    argv = backend._where(["squeue", "-h", "--me"])
    assert argv[0] == "ssh" and "StrictHostKeyChecking=yes" in argv and "BatchMode=yes" in argv
    assert argv[argv.index("-l") + 1] == "alice" and argv[argv.index("-i") + 1] == str(key)
    assert f'UserKnownHostsFile="{known}"' in argv
    assert argv[-3:] == [
        "login1.hpc.example",
        "--",
        "'exec' 'env' 'SLURM_CONF=/etc/slurm/x.conf' 'squeue' '-h' '--me'",  # a path of the login node's
    ]
    assert "SLURM_CONF" not in backend.slurm_env  # nothing of Slurm's here


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"login": "alice@login1; rm -rf ~"}, "login='alice@login1; rm -rf ~': give the login node as 'host'"),
        ({"login": "-oProxyCommand=x"}, "login='-oProxyCommand=x'"),
        ({"login": "h", "login_port": 0}, "login_port=0"),
        ({"login": "h", "ssh_options": "ProxyJump=b"}, "ssh_options='ProxyJump=b'"),
        ({"login": "h", "within_allocation": True}, "login='h' and within_allocation=True"),
        ({"identity": "~/.ssh/id_ed25519"}, "identity: these are for login=; give login='host'"),
        ({"trust_on_first_use": True}, "trust_on_first_use: these are for login="),
    ],
)
def test_login_options_are_checked_before_anything_starts(keywords, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("?", r"\?").replace("$", r"\$")):
        SlurmBackend(**keywords)
