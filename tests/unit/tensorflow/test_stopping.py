"""What TensorFlow prints after the widget's Stop: an executor of a coordinator's thread, collected once the
workers it had work on are gone, says nothing; anything else unraisable still reaches Python's hook."""

from __future__ import annotations

from types import SimpleNamespace

from cmlcluster.tensorflow import stopping


class Executor:  # TensorFlow's is tensorflow.python.eager.executor.Executor: the hook knows it by its __del__
    def __del__(self):
        pass


class UnavailableError(Exception):  # tf.errors.UnavailableError, by its name
    pass


def test_an_executor_collected_after_a_stop_says_nothing_and_everything_else_reaches_the_hook(monkeypatch):
    said: list[object] = []
    hook = stopping._without_stopped_executors(said.append)
    lost = SimpleNamespace(object=Executor.__del__, exc_value=UnavailableError("Connection reset by peer"))
    monkeypatch.setattr(stopping, "_stopped_once", False)
    hook(lost)
    assert said == [lost]  # no cluster was stopped: TensorFlow's error is the user's to see
    monkeypatch.setattr(stopping, "_stopped_once", True)
    hook(lost)
    assert said == [lost]  # after a Stop: dropped
    other_error = SimpleNamespace(object=Executor.__del__, exc_value=ValueError("a bug"))
    elsewhere = SimpleNamespace(object=print, exc_value=UnavailableError("not an executor's"))
    hook(other_error)
    hook(elsewhere)
    assert said == [lost, other_error, elsewhere]
