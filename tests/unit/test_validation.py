"""Bad input is refused before anything starts, with the value and the fix in the message."""

from __future__ import annotations

import re

import pytest

import cmlcluster
from cmlcluster import ConfigError, Session, api
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
        (dict(env={"A": 1}), r"env\['A'\] is a int: .*must be strings"),
        (dict(env={"A;touch /tmp/x": "1"}), r"env key 'A;touch /tmp/x' is not a variable name: use letters"),
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


BAD_ENV_NAMES = ["A;touch /tmp/x", "1ABC", "A B", "A=B", "", "-x", "$(id)", "Ä", "A\nB"]


def _entry_points(tmp_path):
    """Every public entry point that takes env=, as a call with that env on a fake session."""
    from cmlcluster.horovod import run_horovod
    from cmlcluster.pytorch import run_torch
    from cmlcluster.tensorflow import run_cluster, start_cluster

    script = tmp_path / "train.py"
    script.write_text("print(1)")
    return {
        "launch_workers": lambda s, env: s.launch_workers(1, cpu=1, memory=1, env=env),
        "run_horovod": lambda s, env: run_horovod(str(script), session=s, env=env, echo=False),
        "run_torch": lambda s, env: run_torch(str(script), session=s, env=env, echo=False),
        "start_cluster": lambda s, env: start_cluster(1, 0, session=s, env=env),
        "run_cluster": lambda s, env: run_cluster(1, 0, 1, 1, session=s, env=env),
    }


@pytest.mark.parametrize("entry", ["launch_workers", "run_horovod", "run_torch", "start_cluster", "run_cluster"])
def test_env_names_that_are_not_variable_names_are_refused_before_anything_starts(session, entry, tmp_path):
    call = _entry_points(tmp_path)[entry]
    for name in BAD_ENV_NAMES:
        with pytest.raises(ConfigError, match=rf"env key {re.escape(repr(name))} is not a variable name") as e:
            call(session, {"GOOD": "fine", name: "s3cret-value"})
        assert "letters, digits and '_'" in str(e.value)  # the fix
        assert "s3cret-value" not in str(e.value)  # the message names the key, never a value
    with pytest.raises(ConfigError, match=r"env\['N'\] is a int") as e:
        call(session, {"TOKEN": "s3cret-value", "N": 1})
    assert "s3cret-value" not in str(e.value)
    assert session.list_workers() == []
    assert not session.backend.control.started  # not even the controller


@pytest.mark.parametrize("entry", ["launch_workers", "run_horovod", "run_torch", "start_cluster", "run_cluster"])
def test_env_names_of_cmlclusters_own_are_refused_before_anything_starts(session, entry, tmp_path):
    # On Kubernetes cmlcluster's own variables go by value in the pod spec (env= by reference to a
    # Secret): a secret named CMLCLUSTER_* would be in every `kubectl get pod -o yaml`.
    call = _entry_points(tmp_path)[entry]
    for name in ["CMLCLUSTER_TOKEN", "CMLCLUSTER_CONNECTION_FILE", "CMLCLUSTER_ENGINE_ID", "CMLCLUSTER_"]:
        with pytest.raises(ConfigError, match=rf"env key '{name}' is reserved: names starting with 'CMLCLUSTER_'") as e:
            call(session, {"GOOD": "fine", name: "s3cret-value"})
        assert f"rename it, e.g. 'MY_{name[len('CMLCLUSTER_') :]}'" in str(e.value)  # the fix
        assert "s3cret-value" not in str(e.value)
    assert session.list_workers() == []
    assert not session.backend.control.started  # not even the controller


@pytest.mark.parametrize("entry", ["launch_workers", "run_horovod", "run_torch", "%horovod", "%torchrun"])
def test_a_missing_script_names_the_folder_searched_and_the_path_from_there(session, entry, tmp_path, monkeypatch):
    # A notebook opened in JupyterLab runs in its own folder (notebooks/), not the project's root where
    # the script's path was written: the message says where it looked, and the path that works from there.
    from IPython.core.interactiveshell import InteractiveShell

    from cmlcluster.horovod import run_horovod
    from cmlcluster.pytorch import run_torch

    (tmp_path / "worker_scripts").mkdir()
    (tmp_path / "worker_scripts" / "train.py").write_text("print(1)")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    monkeypatch.setattr(api, "_default", None)  # the magics' session: the default one, never started here
    script = "worker_scripts/train.py"
    call = {
        "launch_workers": lambda: session.launch_workers(1, cpu=1, memory=1, script=script),
        "run_horovod": lambda: run_horovod(script, session=session, echo=False),
        "run_torch": lambda: run_torch(script, session=session, echo=False),
        "%horovod": lambda: InteractiveShell.instance().run_line_magic("horovod", f"-np 1 {script}"),
        "%torchrun": lambda: InteractiveShell.instance().run_line_magic("torchrun", f"--nnodes 1 {script}"),
    }[entry]
    if entry.startswith("%"):
        InteractiveShell.instance().run_line_magic("load_ext", "cmlcluster")
    with pytest.raises(ConfigError) as e:
        call()
    assert str(e.value) == (
        f"script='worker_scripts/train.py': no such file in {tmp_path / 'notebooks'} (the working folder, where "
        "a relative path starts; a notebook's is its own folder); did you mean '../worker_scripts/train.py'? "
        "Give a path relative to that folder, or an absolute one"
    )
    assert api._default is None
    assert session.list_workers() == []
    assert not session.backend.control.started  # not even the controller


def test_a_users_file_is_found_from_the_working_folder_or_refused_with_the_fix(tmp_path, monkeypatch):
    from cmlcluster.workers import user_file

    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert user_file("train.py") == str(tmp_path / "train.py")  # absolute: a later chdir does not break it
    assert user_file("./train.py", cwd=str(tmp_path)) == str(tmp_path / "train.py")
    assert user_file(tmp_path / "train.py") == str(tmp_path / "train.py")  # a Path, as from pathlib
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_file("~/train.py", cwd="/") == str(tmp_path / "train.py")
    searched = re.escape(str(tmp_path))
    with pytest.raises(
        ConfigError, match=rf"^script='elsewhere.py': no such file in {searched} \(the working .*; give a"
    ):
        user_file("elsewhere.py")  # nothing above has it either: no guess
    with pytest.raises(ConfigError, match=r"^script='/no/such.py': no such file$"):
        user_file("/no/such.py")  # an absolute path: no folder was searched
    with pytest.raises(ConfigError, match=rf"^identity='.': {searched} is a folder; give the path of a file$"):
        user_file(".", name="identity")
    with pytest.raises(ConfigError, match=r"^script=3: give the path of a file, as a string$"):
        user_file(3)


def test_the_documented_knobs_may_still_be_set(session):
    knobs = {"CMLCLUSTER_PRELOAD": "json", "CMLCLUSTER_LOG_LEVEL": "DEBUG"}  # a worker elsewhere's log level
    [worker] = session.launch_workers(1, cpu=1, memory=1, code="pass", env=knobs)
    assert session.list_workers()[0]["id"] == worker["id"]


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


@pytest.fixture
def default_backend(monkeypatch):
    """The default session's backend choice, as a test leaves it: put back afterwards."""
    monkeypatch.setattr(api, "_backend", api._backend)
    monkeypatch.setattr(api, "_backend_options", api._backend_options)
    yield
    cmlcluster.stop_session()


def refuse_to_connect(monkeypatch):
    """Building or using a Docker backend now fails the test: use_backend must not reach the engine."""
    from cmlcluster.backends.docker import backend as docker

    def connect(*args, **kwargs):
        raise AssertionError("use_backend connected to Docker")

    monkeypatch.setattr(docker, "connect", connect)
    monkeypatch.setattr(docker, "visible_gpus", connect)  # what the constructor asks


@pytest.mark.parametrize(
    "backend, options, message",
    [
        ("nosuchbackend", {}, r"backend='nosuchbackend' is not a known backend; choose one of .*docker.*local"),
        (
            "docker",
            {"imagee": "x"},
            r"backend='docker' has no option imagee='x' \(did you mean image\?\); its options are image, network,",
        ),
        ("local", {"gpus": ["0"], "memory": 4}, r"backend='local' has no option memory=4; its options are gpus, "),
        ("local", {"limits": False}, r"has no option limits=False \(did you mean apply_limits\?\)"),
        (42, {}, "backend=42: give a backend name such as 'local', or a Backend instance"),
        (FakeBackend(), {"gpus": ["0"]}, "pass them to its class"),
    ],
)
def test_use_backend_refuses_a_bad_name_or_option_at_once(default_backend, monkeypatch, backend, options, message):
    refuse_to_connect(monkeypatch)
    cmlcluster.use_backend("fake")
    with pytest.raises(ConfigError, match=message):
        cmlcluster.use_backend(backend, **options)
    assert (api._backend, api._backend_options) == ("fake", {})  # the choice before it stands
    assert api._default is None  # nothing started


def test_use_backend_refuses_an_option_of_the_environments_backend(default_backend, monkeypatch):
    monkeypatch.setenv("CMLCLUSTER_BACKEND", "docker")
    refuse_to_connect(monkeypatch)
    with pytest.raises(ConfigError, match=r"backend='docker' has no option hosts=\['a'\]; its options are image,"):
        cmlcluster.use_backend(None, hosts=["a"])


def test_session_refuses_a_bad_option_with_the_same_message():
    with pytest.raises(ConfigError, match=r"backend='fake' has no option gpu=\['0'\] \(did you mean gpus\?\)"):
        Session("fake", gpu=["0"])


def test_use_backend_takes_good_choices_without_building_them(default_backend, monkeypatch):
    refuse_to_connect(monkeypatch)
    cmlcluster.use_backend("docker", image="python:3.11", mount_cwd=False)
    assert (api._backend, api._backend_options) == ("docker", {"image": "python:3.11", "mount_cwd": False})
    backend = FakeBackend()
    cmlcluster.use_backend(backend)
    assert cmlcluster.get_session().backend is backend
    cmlcluster.use_backend(None)
    assert (api._backend, api._backend_options) == (None, {})


class OrphanBackend(FakeBackend):
    """Another package's backend, registered by entry point, that finds something to clean up."""

    @classmethod
    def cleanup(cls, dry_run, options):
        return [f"pod {options['namespace']}/left{' (dry run)' if dry_run else ''}"]


class UnreachableBackend(FakeBackend):
    @classmethod
    def cleanup(cls, dry_run, options):
        raise RuntimeError("its API did not answer")


def registered(monkeypatch, **backends):
    """Entry points of the group cmlcluster.backends, as an installed package would register them."""
    import importlib.metadata

    from cmlcluster.backends import registry

    points = [
        importlib.metadata.EntryPoint(name, f"{__name__}:{cls.__name__}", registry.ENTRY_POINT_GROUP)
        for name, cls in backends.items()
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: [p for p in points if p.group == group])


def test_one_registry_built_ins_first_then_other_packages(monkeypatch):
    assert set(known_backends()) == {"local", "fake", "docker", "ssh", "slurm", "kubernetes"}
    assert backend_class("fake") is FakeBackend
    registered(monkeypatch, acme=OrphanBackend, local=UnreachableBackend)
    assert "acme" in known_backends() and backend_class("acme") is OrphanBackend
    assert backend_class("local").__name__ == "LocalBackend"  # a package cannot take a built-in's name


def test_cleanup_asks_every_registered_backend(monkeypatch, capsys):
    from cmlcluster.__main__ import cleanup_sessions

    monkeypatch.delenv("KUBECONFIG", raising=False)
    registered(monkeypatch, acme=OrphanBackend, flaky=UnreachableBackend)
    assert cleanup_sessions(dry_run=True, namespace="team") == 0
    out, err = capsys.readouterr()
    assert "would end pod team/left (dry run)" in out
    assert "the flaky backend was not checked: its API did not answer" in err


def test_backend_instance_with_options_is_refused():
    with pytest.raises(ConfigError, match="pass them to its class"):
        make_backend(FakeBackend(), gpus=["0"])


def test_bad_timeout_is_refused(session):
    with pytest.raises(ConfigError, match="timeout_seconds=-1"):
        session.await_workers([], timeout_seconds=-1)


@pytest.mark.parametrize(
    ("value", "low", "high", "ok"),
    [
        (1, 1, None, True),
        (0, 1, None, False),
        (True, 0, None, False),
        (2.0, 0, None, False),
        (5, 1, 4, False),
        (4, 1, 4, True),
    ],
)
def test_a_whole_number_is_an_int_within_its_bounds_and_never_a_bool(value, low, high, ok):
    from cmlcluster import checks

    assert checks.whole(value, low, high) is ok


@pytest.mark.parametrize(
    ("value", "ok"),
    [(0.5, True), (0, False), (float("nan"), False), (float("inf"), False), (False, False), ("1", False)],
)
def test_a_number_is_finite_real_and_never_a_bool(value, ok):
    from cmlcluster import checks

    assert checks.number(value, above=0) is ok


def test_a_backends_options_are_read_from_its_constructor_for_help_and_the_command_line():
    import argparse

    from cmlcluster.backends import add_backend_arguments, backend_from, backends_help, options_of
    from cmlcluster.backends.local import LocalBackend

    assert options_of("local") == {"gpus": "None", "apply_limits": "True", "fork": "True"}
    assert "local: gpus=None, apply_limits=True, fork=True" in backends_help().splitlines()
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    assert backend_from(parser.parse_args(["--backend", "docker"])) == "docker"  # a name: built at launch
    built = backend_from(parser.parse_args(["--backend", "local", "--backend-option", "fork=False"]))
    assert isinstance(built, LocalBackend) and built._fork is False  # a literal, not the text "False"
    with pytest.raises(ConfigError, match=r"no option forks=True \(did you mean fork\?\)"):
        backend_from(parser.parse_args(["--backend", "local", "--backend-option", "forks=True"]))
    with pytest.raises(ConfigError, match="give KEY=VALUE"):
        backend_from(parser.parse_args(["--backend-option", "fork"]))


def test_stop_workers_before_any_session_refuses_a_named_worker_and_starts_nothing(default_backend, monkeypatch):
    refuse_to_connect(monkeypatch)
    cmlcluster.use_backend("fake")
    assert cmlcluster.stop_workers() == []  # nothing to stop
    with pytest.raises(ConfigError, match=r"'w-7' is not a worker: no session runs in this process"):
        cmlcluster.stop_workers({"id": "w-7"})
    assert api._default is None  # nothing started
