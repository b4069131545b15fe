"""The elastic rendezvous' guard, pure parts and a stdlib server: the per-run key's signature, the rows of
/proc/net/tcp and tcp6 read as identd does, who is admitted, and a handler that unpickles what it is sent
(as horovod's elastic one does) refusing an unsigned payload without running it, and taking a signed one."""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn

import pytest

from cmlcluster import socket_owners as owners
from cmlcluster.horovod import rendezvous
from cmlcluster.horovod.rendezvous import SIGNATURE_HEADER, Guard
from cmlcluster.socket_owners import TcpSocket

KEY = bytes(range(32))
IP = ipaddress.ip_address

# /proc/net/tcp: a listener on 127.0.0.1:8080, a client 127.0.0.1:40000 -> 127.0.0.1:8080 of uid 1000, the
# server's end, and the same client after it closed (a timewait row: uid 0, inode 0).
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0 100 0 0 10 0
   1: 0100007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 222 1 0 20 4 30 10 -1
   2: 0100007F:1F90 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 333 1 0 20 4 30 10 -1
   3: 0100007F:9C41 0100007F:1F90 06 00000000:00000000 03:000008B1 00000000     0        0 0 3 0
   4: garbage
"""
# /proc/net/tcp6: an IPv4-mapped client of uid 65534 (127.0.0.1:40002 -> 127.0.0.1:8080), and 10.1.2.3's.
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:9C42 0000000000000000FFFF00000100007F:1F90 01 00000000:00000000 00:00000000 00000000 65534        0 444 1 0
   1: 00000000000000000000000001000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1 0
"""  # noqa: E501 - the kernel's own lines

SERVER = (IP("127.0.0.1"), 8080)


def test_a_signature_covers_the_method_path_and_body_under_the_runs_key():
    sig = rendezvous.signature(KEY, "PUT", "/worker_addresses/h:0", b"body")
    assert rendezvous.verify(KEY, "PUT", "/worker_addresses/h:0", b"body", sig)
    assert not rendezvous.verify(bytes(32), "PUT", "/worker_addresses/h:0", b"body", sig)  # another key
    assert not rendezvous.verify(KEY, "PUT", "/worker_addresses/h:0", b"bodx", sig)
    assert not rendezvous.verify(KEY, "PUT", "/worker_addresses/h:1", b"body", sig)
    assert not rendezvous.verify(KEY, "GET", "/worker_addresses/h:0", b"body", sig)
    for given in (None, "", "00" * 32, sig[:-1], "é" * 64):
        assert not rendezvous.verify(KEY, "PUT", "/worker_addresses/h:0", b"body", given)


def test_a_key_is_32_random_bytes_in_a_0600_file_that_goes_with_the_run(tmp_path):
    assert rendezvous.parse_key(KEY.hex()) == KEY
    with pytest.raises(ValueError):
        rendezvous.parse_key("ab" * 16)
    with pytest.raises(ValueError):
        rendezvous.parse_key("not hex")
    with rendezvous.run_key(str(tmp_path), elastic=False) as static:
        assert static.rank_env == {} and static.driver_env == {}
    with rendezvous.run_key(str(tmp_path), elastic=True) as run:
        path = run.driver_env[rendezvous.KEY_FILE_ENV]
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert rendezvous.read_key_file(path) == run.key
        assert run.rank_env == {rendezvous.KEY_ENV: run.key.hex()}
        assert run.key.hex() not in path
    assert not os.path.exists(path)
    with rendezvous.run_key(str(tmp_path), elastic=True) as other:
        assert other.key != run.key


def test_proc_net_tcp_rows_are_read_in_the_kernels_byte_order():
    rows = owners.parse_tcp_table(TCP) + owners.parse_tcp_table(TCP6)
    assert len(rows) == 6  # the header and the garbage line skipped
    assert rows[0] == TcpSocket((IP("127.0.0.1"), 8080), (IP("0.0.0.0"), 0), 0x0A, 1000, 111)
    assert rows[1].local == (IP("127.0.0.1"), 40000) and rows[1].remote == SERVER
    assert rows[4].local == (IP("127.0.0.1"), 40002) and rows[4].uid == 65534  # IPv4-mapped, unmapped
    assert rows[5].local == (IP("::1"), 22)


def test_the_owner_of_a_peer_socket_is_the_uid_of_its_row_while_a_process_holds_it():
    rows = owners.parse_tcp_table(TCP) + owners.parse_tcp_table(TCP6)
    assert owners.socket_owner(rows, (IP("127.0.0.1"), 40000), SERVER) == 1000
    assert owners.socket_owner(rows, (IP("127.0.0.1"), 40002), SERVER) == 65534
    assert owners.socket_owner(rows, (IP("::ffff:127.0.0.1"), 40002), SERVER) == 65534
    assert owners.socket_owner(rows, (IP("127.0.0.1"), 40001), SERVER) is None  # timewait: uid 0 proves nothing
    assert owners.socket_owner(rows, (IP("127.0.0.1"), 40000), (IP("127.0.0.1"), 8081)) is None


def test_only_the_jobs_hosts_and_this_users_local_sockets_are_admitted():
    owner = owners.socket_owner
    rows = owners.parse_tcp_table(TCP) + owners.parse_tcp_table(TCP6)
    own = frozenset({IP("192.168.1.5")})
    hosts = frozenset({IP("10.0.0.2")})

    def admits(peer, uid=1000, server=SERVER):
        return rendezvous.admits(
            peer, server, uid=uid, own_addresses=own, host_addresses=hosts, owner=lambda p, s: owner(rows, p, s)
        )

    assert admits((IP("127.0.0.1"), 40000))
    assert not admits((IP("127.0.0.1"), 40000), uid=0)  # root is not this session's user either
    assert not admits((IP("127.0.0.1"), 40002))  # uid 65534
    assert not admits((IP("127.0.0.1"), 40001))  # no live socket
    assert not admits((IP("192.168.1.5"), 40000))  # this machine's own address: no row, refused
    assert admits((IP("10.0.0.2"), 5555))
    assert not admits((IP("10.0.0.3"), 5555))
    # A job host that is this machine is still checked by uid.
    assert not rendezvous.admits(
        (IP("127.0.0.1"), 40002), SERVER, uid=1000, own_addresses=own,
        host_addresses=frozenset({IP("127.0.0.1")}), owner=lambda p, s: owner(rows, p, s),
    )  # fmt: skip


def test_the_kernel_names_the_owner_of_a_connections_other_end_as_proc_net_tcp_does():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        here = (IP("127.0.0.1"), port)
        with socket.create_connection(("127.0.0.1", port)) as mine:
            accepted, peer = server.accept()
            with accepted:
                peer_end = (IP(peer[0]), peer[1])
                assert owners.diag_owner(peer_end, here) == os.getuid() == owners.peer_owner(peer_end, here)
                rows = owners.read_tcp_tables(local_port=peer[1])
                assert owners.socket_owner(rows, peer_end, here) == os.getuid()
                assert owners.diag_owner((IP("127.0.0.1"), mine.getsockname()[1] ^ 1), here) is None
        if os.getuid() != 0 or not shutil.which("setpriv"):
            return  # another uid's socket needs root to make (the suite runs as root: scripts/install.sh dev)
        # The system's Python, which another uid can run (the .venv may be private to this one).
        system_python = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
        stranger = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", system_python, "-I", "-c",
             f"import socket, sys; s = socket.create_connection(('127.0.0.1', {port})); sys.stdin.read()"],
            stdin=subprocess.PIPE,
        )  # fmt: skip
        try:
            accepted, peer = server.accept()
            with accepted:
                assert owners.diag_owner((IP(peer[0]), peer[1]), here) == 65534
        finally:
            stranger.communicate(timeout=10)


def test_the_guard_resolves_the_jobs_hosts_as_they_change():
    guard = Guard(None, uid=os.getuid(), own=frozenset())
    guard.set_hosts(["10.0.0.2", "localhost", "no-such-host.invalid"])
    assert IP("10.0.0.2") in guard.hosts and IP("127.0.0.1") in guard.hosts
    guard.set_hosts({"10.0.0.3": 1})
    assert guard.hosts == frozenset({IP("10.0.0.3")})


# -- multi-homed hosts: a rank dials from its address on the interface horovodrun picked ------------


class Accepted:
    """The accepted socket, as verify_request asks it: where the rendezvous listens."""

    def __init__(self, address):
        self.address = address

    def getsockname(self):
        return self.address


def test_a_rank_dialing_the_rendezvous_from_its_hosts_second_address_is_admitted(tmp_path):
    # 10.0.0.2 is the host's -H name (the session reaches it there); horovodrun picked the common NIC
    # on 192.168.50.0/24 (InfiniBand, a second Ethernet), bound the rendezvous on this machine's address
    # there, and the rank dials it from 192.168.50.2.
    listening = Accepted(("192.168.50.1", 8080))
    rank = ("192.168.50.2", 40000)
    before = Guard(None, uid=1000, own=frozenset({IP("192.168.50.1")}))
    before.set_hosts(["10.0.0.2", "10.0.0.3"])
    assert not before.verify_request(listening, rank)  # the -H names alone: refused, the run hung
    path = str(tmp_path / "host_addresses.json")
    rendezvous.write_host_addresses(path, {"10.0.0.2": ["10.0.0.2", "192.168.50.2"], "10.0.0.3": ["192.168.50.3"]})
    guard = Guard(None, uid=1000, own=frozenset({IP("192.168.50.1")}), hosts_file=path)
    guard.set_hosts(["10.0.0.2", "10.0.0.3"])
    assert guard.verify_request(listening, rank)
    assert guard.verify_request(listening, ("192.168.50.3", 40001))
    assert guard.verify_request(listening, ("::ffff:192.168.50.3", 40001))  # an IPv6 socket's view of it
    assert guard.verify_request(Accepted(("10.0.0.1", 8080)), ("10.0.0.2", 40000))  # its -H address still
    assert guard.verify_request(Accepted(("10.0.0.1", 8080)), ("10.0.0.3", 40000))  # resolved from its name
    assert not guard.verify_request(listening, ("192.168.50.9", 40000))  # on that network, no job host's
    # The pure rule, with what the guard now holds.
    assert rendezvous.admits(
        (IP("192.168.50.2"), 40000), (IP("192.168.50.1"), 8080), uid=1000, own_addresses=guard.own,
        host_addresses=guard.hosts, owner=lambda p, s: None,
    )  # fmt: skip
    # A host reporting one of this machine's addresses (or loopback) gets no pass: those are checked by uid.
    rendezvous.write_host_addresses(path, {"10.0.0.2": ["192.168.50.1", "127.0.0.1"]})
    guard.set_hosts(["10.0.0.2"])
    assert not rendezvous.admits(
        (IP("192.168.50.1"), 40000), (IP("192.168.50.1"), 8080), uid=1000, own_addresses=guard.own,
        host_addresses=guard.hosts, owner=lambda p, s: 65534,
    )  # fmt: skip


def test_the_guard_reads_the_hosts_addresses_again_as_hosts_come_and_go(tmp_path, capsys):
    path = str(tmp_path / "host_addresses.json")
    rendezvous.write_host_addresses(path, {"10.0.0.2": ["192.168.50.2"], "10.0.0.3": ["192.168.50.3"]})
    guard = Guard(KEY, uid=1000, own=frozenset(), hosts_file=path)
    guard.set_hosts(["10.0.0.2"])  # a host the file names but discovery no longer lists is not admitted
    assert guard.hosts == {IP("10.0.0.2"), IP("192.168.50.2")}
    # 10.0.0.3 lost, 10.0.0.4 its replacement: the session writes its addresses before discovery lists it.
    rendezvous.write_host_addresses(path, {"10.0.0.2": ["192.168.50.2"], "10.0.0.4": ["192.168.50.4", "fd00::4"]})
    guard.set_hosts(["10.0.0.2", "10.0.0.4"])
    assert guard.hosts == {IP("10.0.0.2"), IP("192.168.50.2"), IP("10.0.0.4"), IP("192.168.50.4"), IP("fd00::4")}
    # A file that cannot be read: the last one read stays, and it is said once.
    with open(path, "w") as f:
        f.write('{"10.0.0.2": "192.168.50.2"')
    guard.set_hosts(["10.0.0.2", "10.0.0.4"])
    os.remove(path)
    guard.set_hosts(["10.0.0.2", "10.0.0.4"])
    assert IP("192.168.50.4") in guard.hosts
    assert capsys.readouterr().err.count("the job's hosts' addresses cannot be read") == 1


def test_the_hosts_addresses_file_is_replaced_whole_0600_and_read_strictly(tmp_path):
    path = str(tmp_path / "host_addresses.json")
    rendezvous.write_host_addresses(path, {"b": ["10.0.0.3", "10.0.0.3"], "a": ("fe80::1", "10.0.0.2")})
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["host_addresses.json"]  # no temporary file left
    assert rendezvous.read_host_addresses(path) == {
        "a": {IP("10.0.0.2"), IP("fe80::1")},
        "b": {IP("10.0.0.3")},
    }
    assert rendezvous.parse_host_addresses('{"a": ["::ffff:10.0.0.2"]}') == {"a": {IP("10.0.0.2")}}  # unmapped
    for text in ("", "[]", '{"a": "10.0.0.2"}', '{"a": [1]}', '{"a": ["10.0.0.0/8"]}', '{"a": ["h.example"]}'):
        with pytest.raises(ValueError):
            rendezvous.parse_host_addresses(text)


def test_the_cluster_writes_each_hosts_addresses_before_discovery_lists_it(tmp_path, monkeypatch):
    from cmlcluster.events import Member
    from cmlcluster.horovod import ssh_cluster
    from cmlcluster.ssh.keys import SessionSSH, new_ed25519

    host_key = new_ed25519()[1]
    reported = {"10.0.0.2": ["10.0.0.2", "192.168.50.2"], "10.0.0.3": ["10.0.0.3", "192.168.50.3"]}

    class Workers:  # the session, as far as serve() asks it: each worker's answer to sshd.start
        def call_each(self, calls):
            return [
                {
                    "host_key": host_key,
                    "user": "alice",
                    "addresses": reported[address],
                    "interface": "eth0",
                }
                for _, _, (_, _, address) in calls
            ]

    class Discovery:  # what horovodrun's discovery would list, checked against the addresses file as it is set
        def __init__(self, path):
            self.path, self.listed = path, []

        def set(self, hosts):
            known = rendezvous.read_host_addresses(self.path)
            assert all(h in known for h, _ in hosts), (hosts, known)
            self.listed = list(hosts)

    monkeypatch.setattr(ssh_cluster, "check_logins", lambda *args, **kwargs: None)  # no sshd to log in to here
    ssh = SessionSSH.create(str(tmp_path))
    try:
        cluster = ssh_cluster.SSHCluster(session=Workers(), hosts=[], ssh=ssh, job=None)  # type: ignore[arg-type]
        cluster.discovery = Discovery(cluster.addresses_file)  # type: ignore[assignment]
        assert cluster.rendezvous_env == {rendezvous.HOSTS_FILE_ENV: os.path.join(ssh.folder, "host_addresses.json")}
        first, second = Member("s-0", "host", 0, "10.0.0.2"), Member("s-1", "host", 1, "10.0.0.3")
        cluster.serve([first, second])
        assert rendezvous.read_host_addresses(cluster.addresses_file) == {
            "10.0.0.2": {IP("10.0.0.2"), IP("192.168.50.2")},
            "10.0.0.3": {IP("10.0.0.3"), IP("192.168.50.3")},
        }
        cluster._lose(second)  # its host leaves both lists
        assert set(rendezvous.read_host_addresses(cluster.addresses_file)) == {"10.0.0.2"}
        reported["10.0.0.4"] = ["10.0.0.4", "192.168.50.4"]
        cluster.serve([Member("s-2", "host", 1, "10.0.0.4")])  # its replacement
        assert rendezvous.read_host_addresses(cluster.addresses_file)["10.0.0.4"] == {
            IP("10.0.0.4"),
            IP("192.168.50.4"),
        }
        assert cluster.discovery.listed == [("10.0.0.2", 1), ("10.0.0.4", 1)]  # type: ignore[attr-defined]
    finally:
        ssh.close()
    assert not os.path.exists(cluster.addresses_file)  # it goes with the session's ssh folder


# -- a server that unpickles what it is sent, as horovod's elastic rendezvous does ------------------


class UnpicklingHandler(BaseHTTPRequestHandler):
    """horovod's KVStoreHandler and ElasticRendezvousHandler, reduced: do_PUT reads the body and
    passes it to _put_value, which unpickles worker_addresses."""

    timeout = 3

    def do_PUT(self):
        _, scope, key = self.path.split("/")
        value = self.rfile.read(int(self.headers["Content-Length"]))
        self._put_value(scope, key, value)
        self.send_status_code(200)

    def do_GET(self):
        _, scope, key = self.path.split("/")
        value = self.server.cache.get(scope, {}).get(key)
        if value is None:
            return self.send_status_code(404)
        self.send_response(200)
        self.send_header("Content-Length", str(len(value)))
        self.end_headers()
        self.wfile.write(value)

    def do_DELETE(self):
        self.send_status_code(200)

    def _put_value(self, scope, key, value):
        if scope == "worker_addresses":
            self.server.decoded.append(pickle.loads(value))  # what horovod does
        self.server.cache.setdefault(scope, {})[key] = value

    def send_status_code(self, code):
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Server(ThreadingMixIn, HTTPServer):
    daemon_threads = True

    def __init__(self, guard):
        super().__init__(("127.0.0.1", 0), UnpicklingHandler)
        self.cache, self.decoded, self.handled = {}, [], 0
        guard.install(self)


class Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@contextlib.contextmanager
def serving(guard):
    server = Server(guard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def request(port, method, path, body=b"", headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_an_unsigned_pickle_is_refused_before_it_is_decoded_and_a_signed_one_is_taken(tmp_path):
    marker = tmp_path / "marker"
    payload = pickle.dumps(Marker(str(marker)))
    with serving(Guard(KEY, uid=os.getuid(), own=frozenset())) as (port, server):
        path = "/worker_addresses/localhost:0"
        assert request(port, "PUT", path, payload)[0] == 403
        forged = rendezvous.signature(bytes(32), "PUT", path, payload)
        assert request(port, "PUT", path, payload, {SIGNATURE_HEADER: forged})[0] == 403
        other_path = rendezvous.signature(KEY, "PUT", "/worker_addresses/localhost:1", payload)
        assert request(port, "PUT", path, payload, {SIGNATURE_HEADER: other_path})[0] == 403
        assert not marker.exists() and server.decoded == []
        # Nothing reads the scope back (it holds each rank's service key), nor deletes from it.
        assert request(port, "GET", path)[0] == 403
        assert request(port, "DELETE", path)[0] == 403
        # A rank's registration, signed by the rank's side.
        put = rendezvous.signed_put(KEY, pickle.dumps)
        put("127.0.0.1", port, "worker_addresses", "localhost:0", ({"lo": [("127.0.0.1", 1)]}, b"k"))
        assert server.decoded == [({"lo": [("127.0.0.1", 1)]}, b"k")]
        # Gloo's own scopes pass as before (bytes, never decoded).
        assert request(port, "PUT", "/global/0", b"gloo")[0] == 200
        assert request(port, "GET", "/global/0") == (200, b"gloo")
    assert not marker.exists()


def test_a_rank_whose_key_differs_is_told_403():
    with serving(Guard(KEY, uid=os.getuid(), own=frozenset())) as (port, server):
        put = rendezvous.signed_put(bytes(32), pickle.dumps)
        with pytest.raises(RuntimeError, match="KVStore server failed"):
            put("127.0.0.1", port, "worker_addresses", "localhost:0", "x")
        assert server.decoded == []


def test_a_connection_from_another_users_socket_is_closed_unread(tmp_path):
    marker = tmp_path / "marker"
    # The guard takes this test's own sockets for another user's: the connection is closed before a byte is read.
    with serving(Guard(None, uid=os.getuid() + 1, own=frozenset())) as (port, server):
        with pytest.raises((ConnectionError, http.client.HTTPException, socket.timeout)):
            request(port, "PUT", "/worker_addresses/localhost:0", pickle.dumps(Marker(str(marker))))
        with pytest.raises((ConnectionError, http.client.HTTPException, socket.timeout)):
            request(port, "GET", "/global/0")
        assert server.cache == {} and server.decoded == []
    assert not marker.exists()


# -- what is wired into horovod --------------------------------------------------------------------


def test_a_rank_finds_what_it_wraps_in_this_horovod_and_signs_its_registration(monkeypatch):
    worker = pytest.importorskip("horovod.runner.elastic.worker")
    from cmlcluster import probes

    assert probes.missing(rendezvous.rank_checks()) == []
    monkeypatch.setattr(worker, "put_data_into_kvstore", worker.put_data_into_kvstore)  # restored after
    rendezvous.sign_worker_registration(KEY)
    assert worker.put_data_into_kvstore.__module__ == rendezvous.__name__


def test_a_horovod_without_a_name_a_rank_wraps_fails_naming_it(monkeypatch):
    worker = pytest.importorskip("horovod.runner.elastic.worker")
    monkeypatch.delattr(worker, "put_data_into_kvstore")
    with pytest.raises(RuntimeError, match=r"no longer has horovod\.runner\.elastic\.worker\.put_data_into_kvstore"):
        rendezvous.sign_worker_registration(KEY)


def test_an_elastic_run_without_a_key_does_not_start():
    pytest.importorskip("horovod.runner.gloo_run")
    from cmlcluster.horovod import driver

    def launch_gloo_elastic(
        command_or_func, exec_command, settings, env, get_common_interfaces, rendezvous, executable
    ):
        raise AssertionError("started")

    launch = driver._elastic_on_server_ip(launch_gloo_elastic, Guard(None, own=frozenset()))
    with pytest.raises(RuntimeError, match=rendezvous.KEY_FILE_ENV):
        launch(["train.py"], None, object(), {}, None, None, "python")


def test_the_driver_admits_the_hosts_horovods_discovery_lists_each_time_it_asks():
    from cmlcluster.horovod import driver

    class Discovery:
        hosts = {"10.0.0.2": 1, "10.0.0.3": 1}

        def find_available_hosts_and_slots(self):
            return dict(self.hosts)

    discovery, guard = Discovery(), Guard(KEY, own=frozenset())
    driver.record_hosts(discovery, guard)
    assert discovery.find_available_hosts_and_slots() == {"10.0.0.2": 1, "10.0.0.3": 1}
    assert guard.hosts == {IP("10.0.0.2"), IP("10.0.0.3")}
    Discovery.hosts = {"10.0.0.2": 1, "10.0.0.4": 1}  # one lost, one replacement
    discovery.find_available_hosts_and_slots()
    assert guard.hosts == {IP("10.0.0.2"), IP("10.0.0.4")}
    assert driver.host_names("localhost:2, 10.0.0.5:1") == ["localhost", "10.0.0.5"]
