"""The agent's app forwarder (apps/forward.py), with real sockets: it relays a worker's own address to its
app on 127.0.0.1, both ways, passes each side's close on, closes a connection while no app listens,
and listens on the worker's address only. 127.0.0.2 stands for the worker's own address (Linux routes
all of 127/8 to the loopback)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from cmlcluster import wire
from cmlcluster.apps import forward as app_forward
from cmlcluster.apps import ports as app_ports

WORKER = "127.0.0.2"


class App:
    """A listener on `host` standing for a worker's web app: the connections it accepted, in order."""

    def __init__(self, host="127.0.0.1"):
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(10)
        self.port = self.listener.getsockname()[1]

    def accept(self):
        connection, _ = self.listener.accept()
        connection.settimeout(10)
        return connection

    def close(self):
        self.listener.close()


@pytest.fixture
def said():
    return []


@contextlib.contextmanager
def forwarding(app_port, said, address=WORKER):
    forwarder = app_forward.start({"CDSW_IP_ADDRESS": address, "CDSW_APP_PORT": str(app_port)}, "0", said.append)
    assert forwarder is not None, said
    try:
        yield forwarder
    finally:
        forwarder.stop()
        forwarder.thread.join(10)
        assert not forwarder.thread.is_alive()


def connect(port, host=WORKER):
    client = socket.create_connection((host, port), timeout=10)
    client.settimeout(10)
    return client


def read_all(sock):
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("app_host", ["127.0.0.1", "0.0.0.0"])  # an app on every address is reached too
def test_bytes_go_both_ways_and_each_sides_close_reaches_the_other(said, app_host):
    app = App(app_host)
    request, reply = os.urandom(3 << 20), os.urandom(5 << 20)  # more than any buffer holds: backpressure
    try:
        with forwarding(app.port, said) as forwarder:
            client = connect(forwarder.port)
            served = app.accept()
            sender = threading.Thread(target=client.sendall, args=(request,))
            sender.start()
            received = b""
            while len(received) < len(request):
                received += served.recv(1 << 16)
            sender.join(10)
            assert received == request
            served.sendall(reply)
            served.close()  # the app closes: the client reads its reply, then the end
            assert read_all(client) == reply
            client.close()

            # The client closes first: the app reads the end of its data.
            client = connect(forwarder.port)
            served = app.accept()
            client.sendall(b"GET / HTTP/1.0\r\n\r\n")
            client.close()
            assert read_all(served) == b"GET / HTTP/1.0\r\n\r\n"
            served.close()
    finally:
        app.close()
    assert said == []


def test_a_half_close_is_passed_on_and_the_reply_still_comes_back(said):
    app = App()
    try:
        with forwarding(app.port, said) as forwarder:
            client = connect(forwarder.port)
            served = app.accept()
            client.sendall(b"question")
            client.shutdown(socket.SHUT_WR)  # done asking, still listening
            assert read_all(served) == b"question"
            served.sendall(b"answer")
            served.close()
            assert read_all(client) == b"answer"
            client.close()
    finally:
        app.close()


def test_while_no_app_listens_a_connection_is_closed_and_the_forwarder_serves_on(said):
    app = App()
    port = app.port
    app.close()  # nobody listens on the app's port now
    with forwarding(port, said) as forwarder:
        client = connect(forwarder.port)
        with contextlib.suppress(ConnectionResetError):
            assert client.recv(1) == b""  # closed at once, not held open
        client.close()
        # The app comes up on its port afterwards: the next connection reaches it.
        with socket.create_server(("127.0.0.1", port)) as listener:
            listener.settimeout(10)
            client = connect(forwarder.port)
            served, _ = listener.accept()
            client.sendall(b"late")
            assert served.recv(4) == b"late"
            served.close()
            client.close()
    assert said == []


def test_it_listens_on_the_workers_address_only_and_not_after_it_stopped(said):
    app = App()
    try:
        with forwarding(app.port, said) as forwarder:
            port = forwarder.port
            for elsewhere in ("127.0.0.1", "127.0.0.3"):
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((elsewhere, port), timeout=10)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((WORKER, port), timeout=10)
    finally:
        app.close()


def test_a_stop_before_it_listens_ends_its_thread_quietly(said, monkeypatch):
    # As when a worker is stopped as its agent starts the forwarder (seen in CI: "Event loop stopped before
    # Future completed", raised on its thread).
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    listener = socket.create_server((WORKER, 0))
    forwarder = app_forward.Forwarder(listener, 9, said.append)
    forwarder.stop()  # before its loop runs: the loop stops under the start of its server
    forwarder.start()
    assert forwarder.thread is not None
    forwarder.thread.join(10)
    assert not forwarder.thread.is_alive() and raised == [] and listener.fileno() == -1


def test_what_it_cannot_do_is_said_and_the_worker_runs_on(said):
    assert app_forward.start({"CDSW_IP_ADDRESS": WORKER, "CDSW_APP_PORT": "8100"}, "", said.append) is None
    assert said == []  # no port: nothing to do (local workers)
    # No address: never every address of the worker.
    assert app_forward.start({"CDSW_APP_PORT": "8100"}, "8101", said.append) is None
    assert "CDSW_IP_ADDRESS is not set" in said[-1]
    assert app_forward.start({"CDSW_IP_ADDRESS": WORKER, "CDSW_APP_PORT": "x"}, "8101", said.append) is None
    assert "127.0.0.1:x" in said[-1]
    with socket.create_server((WORKER, 0)) as taken:
        port = taken.getsockname()[1]
        env = {"CDSW_IP_ADDRESS": WORKER, "CDSW_APP_PORT": "8100"}
        assert app_forward.start(env, str(port), said.append) is None
        assert f"cannot forward {WORKER}:{port} to 127.0.0.1:8100" in said[-1]


def test_the_ports_a_worker_gets_and_the_one_its_app_url_names():
    own = app_ports.pick(own_address=True, session_host=False)  # containers, pods
    assert own == (8100, 8090, 8080, app_ports.FORWARD_FIXED)
    env = app_ports.environment(own)
    assert env[wire.APP_FORWARD_PORT_ENV] == str(app_ports.FORWARD_FIXED) and env["CDSW_APP_PORT"] == "8100"
    assert app_ports.worker_app_url("10.0.0.7", own, {}) == f"http://10.0.0.7:{app_ports.FORWARD_FIXED}/"
    shared = app_ports.pick(own_address=False, session_host=False)  # SSH hosts: four drawn ports
    assert len(set(shared)) == 4 and app_ports.browser_port(shared) == shared[3]
    local = app_ports.pick(own_address=False, session_host=True)  # this machine's loopback: no forwarder
    assert len(set(local)) == 3 and wire.APP_FORWARD_PORT_ENV not in app_ports.environment(local)
    assert app_ports.worker_app_url("127.0.0.1", local, {}) == f"http://127.0.0.1:{local[0]}/"


# Another user's listener on the app's port (on an SSH host the port was drawn free on the session's
# machine, not the host's): run by uid 65534 with the system's Python, which another uid can run (the
# .venv may be private to this one). It prints its port, then, at each line it reads, how many
# connections it has been handed since.
STRANGER = """
import socket, sys
host = sys.argv[1]
family = socket.AF_INET6 if ":" in host else socket.AF_INET
server = socket.create_server((host, 0), family=family, dualstack_ipv6=family == socket.AF_INET6)
server.setblocking(False)
print(server.getsockname()[1], flush=True)
for _ in sys.stdin:
    handed = 0
    while True:
        try:
            server.accept()[0].close()
        except BlockingIOError:
            break
        handed += 1
    print(handed, flush=True)
"""


@contextlib.contextmanager
def strangers_listener(host):
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("another uid's listener needs root and setpriv to make (the suite runs as root)")
    system_python = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    stranger = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", system_python, "-I", "-c", STRANGER, host],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def handed():
            stranger.stdin.write("\n")
            stranger.stdin.flush()
            return int(stranger.stdout.readline())

        yield int(stranger.stdout.readline()), handed
    finally:
        stranger.stdin.close()
        stranger.wait(10)


@pytest.mark.parametrize("stranger_host", ["127.0.0.1", "0.0.0.0", "::"])  # its loopback, or every address
def test_another_users_listener_on_the_apps_port_is_never_relayed_to_and_ours_is(said, stranger_host):
    with strangers_listener(stranger_host) as (port, handed), forwarding(port, said) as forwarder:
        for _ in range(2):
            client = connect(forwarder.port)
            with contextlib.suppress(ConnectionResetError):
                assert client.recv(1) == b""  # closed unrelayed
            client.close()
        assert handed() == 0
        assert len(said) == 1  # said once
        assert f"127.0.0.1:{port} (its CDSW_APP_PORT) is listened on by another user's process (uid 65534)" in said[0]
    # Our own app on the same port, once the stranger has gone: relayed.
    with forwarding(port, said) as forwarder, socket.create_server(("127.0.0.1", port)) as listener:
        listener.settimeout(10)
        client = connect(forwarder.port)
        served, _ = listener.accept()
        client.sendall(b"ours")
        assert served.recv(4) == b"ours"
        served.close()
        client.close()
    assert len(said) == 1
