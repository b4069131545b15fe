"""What the Horovod rendezvous' admission costs per connection (cmlcluster/horovod/rendezvous.py): whose
socket a local peer's is, asked of the kernel's socket diagnostics against read from /proc/net/tcp.

Gloo's ranks open a connection per rendezvous request and the driver checks each before serving it, so
this is paid per request. Alternates the two ways on the same live loopback connection in this one
process and prints each one's median and their ratio (diagnostics / proc; lower is better), with the
number of TCP sockets on the machine, which the /proc read grows with.

    python bench/rendezvous_admission.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import statistics
import time

from cmlcluster import socket_owners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, peer = server.accept()
            with accepted:
                peer_end = (ipaddress.ip_address(peer[0]), peer[1])
                here = (ipaddress.ip_address("127.0.0.1"), port)
                ways = {
                    "diagnostics": lambda: socket_owners.diag_owner(peer_end, here),
                    "proc": lambda: socket_owners.socket_owner(
                        socket_owners.read_tcp_tables(local_port=peer[1]), peer_end, here
                    ),
                }
                times: dict[str, list[float]] = {name: [] for name in ways}
                for _ in range(args.repeat):
                    for name, way in ways.items():
                        t0 = time.perf_counter()
                        assert way() is not None
                        times[name].append(time.perf_counter() - t0)
    sockets = len(socket_owners.read_tcp_tables())
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:12s} median {median * 1e6:9.0f} us per connection")
    print(f"ratio diagnostics/proc: {medians['diagnostics'] / medians['proc']:.4f} ({sockets} TCP sockets here)")


if __name__ == "__main__":
    main()
