"""Jupyter kernels for the tests, on unix sockets in a folder of their own, never on TCP ports.

A kernel on TCP binds five ports of 127.0.0.1 that any process here can reach. While the run's two
processes test side by side, a client of another test may still be retrying a port its server has left
(a rank's Gloo pair, a store client): when a kernel takes that port for its iopub socket, the client's
bytes reach it. libzmq reads a peer that does not greet it as ZeroMQ 3 as a ZMTP 1.0 peer, its bytes as
messages (`01 00` is an empty one), and ipykernel 7's iopub thread reads the first byte of each
subscription message it gets without looking at its length: an IndexError, logged into the running
cell's output (ci41, the Horovod notebook's training cell). A unix socket in a folder of the test's own
is reached by nothing else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager


@contextlib.contextmanager
def kernel_manager(**options) -> Iterator[KernelManager]:
    """A python3 kernel's manager (not started), its sockets and connection file in a folder of its own,
    removed afterwards. The folder is short: a unix socket's path has at most 107 bytes."""
    folder = tempfile.mkdtemp(prefix="kernel-")
    try:
        yield KernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=os.path.join(folder, "k"),  # the sockets: k-<n>
            connection_file=os.path.join(folder, "kernel.json"),  # not in the user's Jupyter runtime folder
            **options,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def running_kernel(**start) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """A started kernel of kernel_manager() and its ready client; shut down afterwards."""
    with kernel_manager() as km:
        km.start_kernel(**start)
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
            yield km, kc
        finally:
            kc.stop_channels()
            if km.is_alive():
                km.shutdown_kernel(now=True)
