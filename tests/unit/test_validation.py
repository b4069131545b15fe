"""Bad input is refused before anything starts, with the value and the fix in the message."""

from __future__ import annotations

import pytest

from cmlcluster import ConfigError, Session
from cmlcluster.backends import backend_class, known_backends, make_backend
from cmlcluster.backends.fake import FakeBackend


@pytest.fixture
def session():
    backend = FakeBackend(gpus=["0", "1"])
    with Session(backend, echo=False) as s:
        yield s


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n=0"),
        (dict(n=2.5), "n=2.5"),
        (dict(cpu=0), "cpu=0"),
        (dict(cpu=-1), "cpu=-1"),
        (dict(memory=0), r"memory=0: memory \(GB\)"),
        (dict(memory=float("nan")), "memory=nan"),
        (dict(nvidia_gpu=-1), "nvidia_gpu=-1"),
        (dict(script="train.py", code="print(1)"), "pass only one of them"),
        (dict(script="does/not/exist.py"), "script='does/not/exist.py': no such file"),
        (dict(kernel="r"), "kernel='r'"),
        (dict(env={"A": 1}), "must be strings"),
    ],
)
def test_bad_launch_input_is_refused_before_anything_starts(session, kwargs, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)")
    args = dict(n=1, cpu=1, memory=1) | kwargs
    with pytest.raises(ConfigError, match=message):
        session.launch_workers(**args)
    assert session.list_workers() == []
    assert not session.backend.control.started  # not even the controller


def test_more_gpus_than_exist_is_refused_before_anything_starts(session):
    assert not session.backend.control.started
    with pytest.raises(
        ConfigError, match=r"nvidia_gpu=2 for 2 workers needs 4 GPUs, but this machine has 2 \(ids: 0, 1\)"
    ):
        session.launch_workers(2, cpu=1, memory=1, nvidia_gpu=2)
    assert session.list_workers() == []
    assert not session.backend.control.started  # not even the controller


def test_gpus_are_given_back_when_workers_end(session):
    [w] = session.launch_workers(1, cpu=1, memory=1, nvidia_gpu=2)
    with pytest.raises(ConfigError, match="of which 0 are free"):
        session.launch_workers(1, cpu=1, memory=1, nvidia_gpu=1)
    session.stop_workers(w)
    assert len(session.launch_workers(1, cpu=1, memory=1, nvidia_gpu=2)) == 1


def test_unknown_backend_lists_known_ones():
    with pytest.raises(
        ConfigError, match=r"backend='kubernetes-typo' is not a known backend; choose one of .*fake.*local"
    ):
        Session("kubernetes-typo")


def test_registry_finds_builtin_backends_through_entry_points():
    assert {"local", "fake"} <= set(known_backends())
    assert backend_class("fake") is FakeBackend


def test_backend_instance_with_options_is_refused():
    with pytest.raises(ConfigError, match="pass them to its class"):
        make_backend(FakeBackend(), gpus=["0"])


def test_bad_timeout_is_refused(session):
    with pytest.raises(ConfigError, match="timeout_seconds=-1"):
        session.await_workers([], timeout_seconds=-1)
