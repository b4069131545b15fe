"""Which Keras tf.keras is, and the fix that is given for Keras 3 on a parameter-server cluster, on
stand-in TensorFlow modules (the real ones: tests/integration/test_tensorflow.py on 2.15 and 2.21)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import types

import pytest

from cmlcluster.errors import ConfigError
from cmlcluster.tensorflow import versions


def fake_tf(version: str, **keras_state) -> types.ModuleType:
    tf = types.ModuleType("tensorflow")
    tf.__version__ = version
    tf.keras = types.ModuleType("keras")  # as TensorFlow's lazy loader, before and after its first use
    vars(tf.keras).update(keras_state)
    return tf


@pytest.fixture(autouse=True)
def no_legacy_keras_variable(monkeypatch):
    """What this process has does not count (the TensorFlow 2.21 run sets TF_USE_LEGACY_KERAS)."""
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)


@pytest.fixture
def installed(monkeypatch):
    """Pretend which of keras (and its version) and tf_keras are installed."""

    def pretend(keras: str | None, tf_keras: bool) -> None:
        def version(name):
            if name == "keras" and keras is not None:
                return keras
            raise importlib.metadata.PackageNotFoundError(name)

        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.metadata, "version", version)
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: (object() if tf_keras else None) if name == "tf_keras" else real_find_spec(name, *a),
        )

    return pretend


@pytest.mark.parametrize(
    ("version", "legacy", "keras", "tf_keras", "flavour"),
    [
        ("2.15.1", None, "2.15.0", False, "keras_2"),  # 2.15 comes with Keras 2
        ("2.15.1", "1", "2.15.0", False, "missing"),  # and follows TF_USE_LEGACY_KERAS too
        ("2.21.0", None, "3.15.1", True, "keras_3"),  # installed tf_keras is not enough
        ("2.21.0", "0", "3.15.1", True, "keras_3"),
        ("2.21.0", "1", "3.15.1", True, "tf_keras"),
        ("2.21.0", "True", "3.15.1", True, "tf_keras"),
        ("2.21.0", "1", "3.15.1", False, "missing"),
        ("2.16.0rc0", None, "2.16.0", False, "keras_2"),
        ("2.21.0", None, None, False, "missing"),
    ],
)
def test_keras_flavour_follows_tensorflows_own_rule(monkeypatch, installed, version, legacy, keras, tf_keras, flavour):
    if legacy is not None:  # unset otherwise (no_legacy_keras_variable)
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy)
    installed(keras, tf_keras)
    assert versions.keras_flavour(fake_tf(version)) == flavour


def test_once_tf_keras_was_used_its_choice_stands_whatever_the_environment_says_now(monkeypatch, installed):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    installed("3.15.1", True)
    tf = fake_tf("2.21.0", _tfll_initialized=True, _tfll_keras_version="keras_3")
    assert versions.keras_flavour(tf) == "keras_3"


def test_the_fix_pins_tf_keras_to_the_tensorflow_and_keeps_pip_from_adding_a_second_one():
    cpu = versions.legacy_keras_fix("2.21.0", "tensorflow-cpu")
    assert 'pip install --no-deps "tf-keras~=2.21.0"' in cpu and "you have tensorflow-cpu" in cpu
    assert "TF_USE_LEGACY_KERAS=1" in cpu
    full = versions.legacy_keras_fix("2.17.1", "tensorflow")
    assert 'pip install "tf-keras~=2.17.0"' in full and "--no-deps" not in full


def test_tf_use_legacy_keras_without_tf_keras_is_refused_before_training(monkeypatch, installed):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    installed("3.15.1", False)
    with pytest.raises(ConfigError, match=r"TF_USE_LEGACY_KERAS is set, but tf_keras for TensorFlow 2\.21\.0"):
        versions.check_coordinator(fake_tf("2.21.0"))


def test_versions_outside_the_tested_range_are_warned_about_once(caplog, installed):
    installed("2.12.0", False)
    for _ in range(2):
        versions.check_coordinator(fake_tf("2.12.0"))
    warned = [r.getMessage() for r in caplog.records if "outside the versions" in r.getMessage()]
    assert warned == ["cmlcluster: TensorFlow 2.12.0 is outside the versions it is tested with (2.15 to 2.21)"]


def test_the_workers_get_tf_use_legacy_keras_only_when_this_process_has_it(monkeypatch):
    assert versions.legacy_keras_env() == {}
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert versions.legacy_keras_env() == {"TF_USE_LEGACY_KERAS": "1"}


@pytest.mark.parametrize(
    ("legacy", "tf_keras", "error"),
    [
        (None, True, "gives tf.keras as Keras 3"),
        ("1", False, "tf_keras for TensorFlow 2.21.0 is not installed"),
        ("1", True, None),
    ],
)
def test_the_main_job_needs_keras_2_and_says_how_to_get_it(monkeypatch, installed, legacy, tf_keras, error):
    if legacy is not None:  # unset otherwise (no_legacy_keras_variable)
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy)
    installed("3.15.1", tf_keras)
    if error is None:
        versions.require_keras_2(fake_tf("2.21.0"))
        return
    with pytest.raises(ConfigError, match=error) as caught:
        versions.require_keras_2(fake_tf("2.21.0"))
    assert 'tf-keras~=2.21.0"' in str(caught.value)
