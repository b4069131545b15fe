"""The session network's gateway rule as data: what it refuses, and finding it again in `iptables -S`."""

from __future__ import annotations

import shlex

from cmlcluster.backends.docker import gateway as docker_gateway


def test_the_rule_refuses_what_reaches_the_gateway_through_other_interfaces_from_other_hosts_only():
    words = docker_gateway.rule("cmlcluster-ab12", "172.30.0.1", "br-0123456789ab")
    text = shlex.join(words)
    assert "-d 172.30.0.1/32" in text
    assert "'!' -i br-0123456789ab" in text  # not its own bridge: its own containers still reach it
    assert "-m addrtype '!' --src-type LOCAL" in text  # not the host's own addresses: its processes still do
    assert words[-2:] == ["-j", "REJECT"]  # at once: a dropped connection would wait out its timeout


def test_the_rules_of_a_network_are_found_in_the_listing_and_no_other():
    ours = docker_gateway.rule("cmlcluster-ab12", "172.30.0.1", "br-0123456789ab")
    theirs = docker_gateway.rule("cmlcluster-ab123", "172.31.0.1", "br-ba9876543210")  # a longer name, same start
    listing = "\n".join(
        [
            "-P INPUT ACCEPT",
            "-A INPUT -i lo -j ACCEPT",
            shlex.join(["-A", "INPUT", *theirs]),
            shlex.join(["-A", "INPUT", *ours]),
            shlex.join(["-A", "FORWARD", *ours]),  # another chain: not the session's
        ]
    )
    assert docker_gateway.rules_of(listing, "cmlcluster-ab12") == [ours]
    assert docker_gateway.rules_of(listing, "cmlcluster-ab123") == [theirs]
    assert docker_gateway.rules_of(listing, "cmlcluster-cd34") == []


def test_the_bridge_is_dockers_br_and_the_networks_id_unless_named():
    assert docker_gateway.bridge_name({"Id": "0123456789abcdef", "Options": {}}) == "br-0123456789ab"
    named = {"Id": "0123456789abcdef", "Options": {"com.docker.network.bridge.name": "cml0"}}
    assert docker_gateway.bridge_name(named) == "cml0"


def test_rules_whose_bridge_is_gone_are_stale_and_no_others():
    gone = docker_gateway.rule("cmlcluster-ab12", "172.30.0.1", "br-0123456789ab")
    here = docker_gateway.rule("cmlcluster-cd34", "172.31.0.1", "br-ba9876543210")
    someone_elses = ["-d", "10.0.0.1/32", "!", "-i", "br-0123456789ab", "-j", "DROP"]  # not ours: no comment
    listing = "\n".join(shlex.join(["-A", "INPUT", *words]) for words in (gone, here, someone_elses))
    assert docker_gateway.stale_rules(listing, lambda bridge: bridge == "br-ba9876543210") == [gone]
