"""The backend contract (backends/base.py), checked the same way on every registered backend.

Each backend runs the same small programs, called directly through the contract (no session, no
control plane): a process that lives until stopped, one that exits with a code, one killed by a
signal, one that prints. The fake plays them from its script; the others run real processes
(local), containers (docker), processes on SSH hosts (ssh) and pods (kubernetes), and so does the
example backend of docs/guide/writing-a-backend.md, which also launches real workers through a session.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import sys
import tempfile

import pytest
from harness.fixtures import DOCKER_TEST_IMAGE, kube_backend, slurm_backend, ssh_backend

from cmlcluster.backends import Backend, Capabilities, SessionContext, backend_class, known_backends
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.errors import ConfigError
from cmlcluster.wire import CONNECTION_ENV
from cmlcluster.workers import Resources, WorkerSpec

pytestmark = pytest.mark.integration

BURST = "for i in range(20000): print('line', i)\nprint('the last line', flush=True)\n"
PROGRAMS = {
    "serve": "import time; print('up', flush=True); time.sleep(120)",
    "exit 3": "print('leaving', flush=True); raise SystemExit(3)",
    "killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    # Much output at the very end: of a program that ends, and of one that a stop ends (its cleanup).
    "burst, exit 0": BURST,
    "burst when stopped": "import signal, sys, time\n"
    "def stop(*_):\n" + "".join("    " + line + "\n" for line in BURST.splitlines()) + "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('up', flush=True)\n"
    "time.sleep(120)\n",
}
FAKE = {  # the same programs, as the fake plays them
    "serve": FakeWorker(),
    "exit 3": FakeWorker(dies_after=0.05, death_code=3),
    "killed": FakeWorker(dies_after=0.05, death_code=-9),
    "burst, exit 0": FakeWorker(dies_after=0.05, death_code=0),
    "burst when stopped": FakeWorker(),
}


ROOT = pathlib.Path(__file__).resolve().parents[2]


def example_backend_class() -> type[Backend]:
    """The example backend of docs/guide/writing-a-backend.md, exactly as the page shows it."""
    page = (ROOT / "docs" / "guide" / "writing-a-backend.md").read_text()
    code = page.split(":name: example-backend\n", 1)[1].split("```", 1)[0]
    namespace: dict = {"__name__": "writing_a_backend_example"}
    exec(compile(code, "docs/guide/writing-a-backend.md", "exec"), namespace)
    return namespace["NiceBackend"]


def test_every_registered_backend_is_checked_here():
    assert set(known_backends()) == {"local", "docker", "ssh", "slurm", "kubernetes", "fake"}
    for name in known_backends():
        assert issubclass(backend_class(name), Backend)


@pytest.fixture(params=["local", "docker", "ssh", "slurm", "kubernetes", "fake", "docs example"])
def contract(request):
    """(backend, spec(program) -> WorkerSpec), attached to a throwaway session folder."""
    name = request.param
    if name == "docker":
        from cmlcluster.backends.docker.backend import DockerBackend

        backend: Backend = DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True)
    elif name == "ssh":
        backend = ssh_backend(request.getfixturevalue("ssh_hosts"))
    elif name == "slurm":
        backend = slurm_backend(request.getfixturevalue("slurm_cluster"))
    elif name == "kubernetes":
        backend = kube_backend(request.getfixturevalue("kube"))
    elif name == "fake":
        plan: list[FakeWorker] = []
        backend = FakeBackend(lambda i: plan[i])
    elif name == "docs example":
        backend = example_backend_class()()
    else:
        backend = backend_class(name)()
    folder = tempfile.mkdtemp(prefix="cmlcluster-contract-")
    asyncio.run(backend.attach(SessionContext(session_id=f"contract{os.getpid()}", session_dir=folder)))
    counter = iter(range(100))

    def spec(program: str) -> WorkerSpec:
        if name == "fake":
            plan.append(FAKE[program])
        engine_id = next(counter)
        python = backend.capabilities().python
        return WorkerSpec(
            worker_id=f"contract-{engine_id}",
            engine_id=engine_id,
            argv=(python, "-c", PROGRAMS[program]),
            env={"PYTHONUNBUFFERED": "1", CONNECTION_ENV: "{}"},  # what a session puts in every spec
            resources=Resources(cpu=0.2, memory=0.5),
            cwd=os.getcwd(),
        )

    yield backend, spec
    asyncio.run(backend.close())
    backend.detach()
    shutil.rmtree(folder)


def run(coro):
    return asyncio.run(coro)


def test_capabilities_are_declared(contract):
    backend, _ = contract
    capabilities = backend.capabilities()
    assert isinstance(capabilities, Capabilities)
    assert capabilities.python and all(os.path.isabs(p) for p in capabilities.shared_paths)
    assert capabilities.sees("/") == ("/" in capabilities.shared_paths)
    if capabilities.session_host:  # the same machine: it sees the session's files
        assert capabilities.sees(sys.executable)


def test_start_poll_stop_is_idempotent_and_stop_ends_the_process(contract):
    backend, spec = contract

    async def scenario():
        handle = await backend.start(spec("serve"))
        assert await backend.poll(handle) is None
        waiting = asyncio.ensure_future(backend.wait(handle))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # alive until stopped
        await backend.stop(handle, grace=2)
        code = await asyncio.wait_for(waiting, 30)
        assert code != 0 and await backend.poll(handle) == code
        await backend.stop(handle, grace=2)  # stopping a stopped worker is a no-op
        assert await backend.poll(handle) == code

    run(scenario())


def test_exit_codes_and_signals(contract):
    backend, spec = contract

    async def scenario():
        exited = await backend.start(spec("exit 3"))
        killed = await backend.start(spec("killed"))
        codes = await asyncio.wait_for(asyncio.gather(backend.wait(exited), backend.wait(killed)), 60)
        assert codes == [3, -9]  # killed by signal N reports -N
        await backend.stop(exited)
        await backend.stop(killed)

    run(scenario())


def test_output_is_kept_for_failure_messages(contract):
    backend, spec = contract
    # The fake's programs print through its control plane; its process output is its death notice.
    expected = "died with code 3" if isinstance(backend, FakeBackend) else "leaving"

    async def scenario():
        handle = await backend.start(spec("exit 3"))
        assert await asyncio.wait_for(backend.wait(handle), 60) == 3
        assert expected in backend.output(handle)  # at once: wait() returns once the output is all in
        await backend.stop(handle)

    run(scenario())


def test_output_is_complete_once_wait_or_stop_returns(contract):
    # The session reports a worker's end once wait() (or stop()) returns, and quotes output() then:
    # what the process wrote last is there, however much of it came at the end.
    backend, spec = contract
    fake = isinstance(backend, FakeBackend)

    async def scenario():
        ends = await backend.start(spec("burst, exit 0"))
        assert await asyncio.wait_for(backend.wait(ends), 60) == 0
        last = "fake worker contract-0 died with code 0" if fake else "the last line"  # the fake's: its death notice
        assert backend.output(ends).splitlines()[-1] == last
        await backend.stop(ends)

        stopped = await backend.start(spec("burst when stopped"))
        for _ in range(300):  # its handler is set once it says "up"
            if fake or "up" in backend.output(stopped):
                break
            await asyncio.sleep(0.1)
        await asyncio.wait_for(backend.stop(stopped, grace=20), 60)
        if not fake:
            assert backend.output(stopped).splitlines()[-1] == "the last line"
        assert await asyncio.wait_for(backend.wait(stopped), 10) == (-15 if fake else 0)
        if not fake:
            assert backend.output(stopped).splitlines()[-1] == "the last line"

    run(scenario())


def test_a_launch_that_can_never_fit_is_refused_before_anything_starts(contract):
    backend, _ = contract
    with pytest.raises(ConfigError, match=r"nvidia_gpu=64|do not fit"):
        run(backend.check(1000, Resources(cpu=1, memory=1, nvidia_gpu=64)))


def test_the_docs_example_backend_runs_real_workers_through_a_session():
    from cmlcluster.session import Session

    code = "import os; print('niceness', os.nice(0))"
    with Session(backend=example_backend_class()(niceness=7), echo=False) as session:
        workers = session.launch_workers(2, cpu=0.5, memory=0.5, code=code)
        done = session.await_workers(workers, wait_for_completion=True, timeout_seconds=120)
        assert done["failures"] == [] and len(done["workers"]) == 2, done
        expected = f"niceness {min(os.nice(0) + 7, 19)}"  # nice adds to this process's own niceness
        assert [session.output(w) for w in workers] == [expected, expected]
        with pytest.raises(ConfigError, match="nvidia_gpu=1: the nice backend starts no GPU workers"):
            session.launch_workers(1, cpu=1, memory=1, nvidia_gpu=1, code="pass")
