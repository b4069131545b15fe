"""Elastic horovodrun, pure parts: its argv (checked against horovod's own parser), the host list its
discovery script prints and how that list is rewritten, and the driver's probes of what it wraps."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from cmlcluster.errors import ConfigError
from cmlcluster.horovod import commands
from cmlcluster.horovod.elastic import DiscoveryFile

HOSTS = [("10.0.0.2", 2), ("10.0.0.3", 2)]


def elastic_argv(script="/s/hosts/discover_hosts.sh", reset_limit=None):
    elastic = commands.ElasticArgs(script, commands.elastic_min_np(4, HOSTS), 4, reset_limit=reset_limit)
    return commands.horovodrun_argv(4, HOSTS, ["python", "train.py"], network_interfaces=["eth0"], elastic=elastic)


def test_an_elastic_argv_has_the_discovery_script_instead_of_hosts():
    argv = elastic_argv(reset_limit=2)
    assert "-H" not in argv and "10.0.0.2:2" not in " ".join(argv)
    assert argv[argv.index("--host-discovery-script") + 1] == "/s/hosts/discover_hosts.sh"
    assert argv[argv.index("--min-np") + 1 : argv.index("--min-np") + 4] == ["2", "--max-np", "4"]  # all but a host
    assert argv[argv.index("--blacklist-cooldown-range") + 1 :][:2] == ["1", "10"]
    assert argv[argv.index("--gloo-timeout-seconds") + 1] == str(commands.ELASTIC_GLOO_TIMEOUT)
    assert argv[argv.index("--reset-limit") + 1] == "2"
    assert argv[argv.index("--network-interfaces") + 1] == "eth0"
    assert "--reset-limit" not in elastic_argv()
    # horovod runs the script through a shell: an odd path is quoted, once.
    odd = elastic_argv(script="/s/my hosts/discover.sh")
    assert odd[odd.index("--host-discovery-script") + 1] == "'/s/my hosts/discover.sh'"


def test_horovod_0_28_parses_the_elastic_argv_as_meant():
    launch = pytest.importorskip("horovod.runner.launch")
    import sys

    argv = elastic_argv(reset_limit=2)
    saved = sys.argv
    sys.argv = ["horovodrun", *argv[1:]]
    try:
        args = launch.parse_args()
    finally:
        sys.argv = saved
    assert launch._is_elastic(args)
    assert (args.num_proc, args.min_num_proc, args.max_num_proc) == (4, 2, 4)
    assert args.host_discovery_script == "/s/hosts/discover_hosts.sh" and args.hosts is None
    assert args.cooldown_range == [1, 10] and args.reset_limit == 2 and args.nics == {"eth0"}
    assert args.gloo_timeout_seconds == commands.ELASTIC_GLOO_TIMEOUT
    assert args.command == ["python", "train.py"]


def test_local_pseudo_hosts_and_min_np():
    assert commands.local_pseudo_hosts(2) == [("localhost", 1), ("127.0.0.1", 1)]
    assert commands.local_pseudo_hosts(5) == [("localhost", 3), ("127.0.0.1", 2)]
    assert commands.elastic_min_np(5, commands.local_pseudo_hosts(5)) == 2
    with pytest.raises(ConfigError, match="2 or more processes"):
        commands.local_pseudo_hosts(1)


def test_the_discovery_script_prints_the_list_and_rewrites_are_atomic(tmp_path):
    found = DiscoveryFile(parent=str(tmp_path))
    try:
        assert os.stat(found.script).st_mode & 0o777 == 0o700
        assert os.stat(found.path).st_mode & 0o777 == 0o600
        assert subprocess.run(found.script, capture_output=True, text=True, check=True).stdout == ""
        found.set(HOSTS)
        assert subprocess.run(found.script, capture_output=True, text=True, check=True).stdout == (
            "10.0.0.2:2\n10.0.0.3:2\n"
        )
        # A reader never sees a partial list while it is rewritten (a temporary file, then os.replace).
        lists = [HOSTS, [("10.0.0.2", 2)], [("10.0.0.2", 2), ("10.0.0.9", 2)]]
        texts = {commands.discovery_text(hosts) for hosts in lists}
        stop = threading.Event()

        def rewrite():
            i = 0
            while not stop.is_set():
                found.set(lists[i % len(lists)])
                i += 1

        writer = threading.Thread(target=rewrite)
        writer.start()
        try:
            seen = {open(found.path).read() for _ in range(3000)}
        finally:
            stop.set()
            writer.join()
        assert seen <= texts and len(seen) > 1
        assert sorted(os.listdir(found.folder)) == ["discover_hosts.sh", "hosts"]  # no temporary file left
    finally:
        found.close()
    assert not os.path.exists(found.folder)


def test_the_driver_finds_what_it_wraps_in_this_horovod():
    pytest.importorskip("horovod.runner.gloo_run")
    from cmlcluster import probes
    from cmlcluster.horovod import driver

    assert probes.missing(driver._checks()) == []
