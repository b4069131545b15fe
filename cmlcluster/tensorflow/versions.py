"""The TensorFlow and Keras this process has, and what Keras training on a parameter-server cluster needs.

cmlcluster never installs TensorFlow: it runs on the user's own, any build (tensorflow,
tensorflow-cpu, GPU or not), tested on 2.15 and 2.21. From 2.16 on, ``tf.keras`` is Keras 3
unless TF_USE_LEGACY_KERAS is set and tf_keras installed, and Keras 3's ``model.fit`` does not
support ParameterServerStrategy (keras-team/keras#18624). Custom training loops with a
ClusterCoordinator work with either Keras.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
import types

from ..errors import ConfigError

log = logging.getLogger(__name__)

TESTED = ((2, 15), (2, 21))  # the oldest and newest TensorFlow the test suite runs
LEGACY_KERAS = "TF_USE_LEGACY_KERAS"
_LEGACY_ON = ("true", "True", "1")  # what TensorFlow's lazy loader takes for "on"
TRAINING_METHODS = {"fit", "evaluate", "predict"}
_warned: set[str] = set()


def minor(version: str) -> tuple[int, int]:
    """(2, 21) of "2.21.0" or "2.16.0rc1"."""
    major, minor_, *_ = version.split(".")
    return int(major), int("".join(c for c in minor_ if c.isdigit()) or 0)


def distribution() -> str:
    """The installed distribution that provides the tensorflow package (tensorflow, tensorflow-cpu, ...)."""
    names = importlib.metadata.packages_distributions().get("tensorflow") or ["tensorflow"]
    return names[0].replace("_", "-").lower()


def keras_flavour(tf: types.ModuleType) -> str:
    """Which Keras tf.keras is in this process: "tf_keras", "keras_3", "keras_2", or "missing".

    Read without loading it: TensorFlow (2.15 as well) decides on first use, by the rule below.
    """
    state = vars(getattr(tf, "keras", types.ModuleType("keras")))
    decided = state.get("_tfll_keras_version") if state.get("_tfll_initialized") else None  # from 2.16
    if decided is not None:
        return str(decided)
    if os.environ.get(LEGACY_KERAS) in _LEGACY_ON:
        return "tf_keras" if importlib.util.find_spec("tf_keras") is not None else "missing"
    try:
        return "keras_3" if importlib.metadata.version("keras").startswith("3.") else "keras_2"
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def legacy_keras_fix(version: str, dist: str) -> str:
    """The exact steps that give this TensorFlow the Keras that trains on parameter servers."""
    major, minor_ = minor(version)
    pin = f'"tf-keras~={major}.{minor_}.0"'
    if dist == "tensorflow":
        install = f"pip install {pin}"
    else:  # tf-keras asks for the distribution named tensorflow: without --no-deps pip adds a second one
        install = f"pip install --no-deps {pin}   (--no-deps: tf-keras asks for tensorflow, and you have {dist})"
    return (
        f"  {install}\n"
        f"  and set {LEGACY_KERAS}=1 before TensorFlow is imported (in a notebook: restart the kernel, then\n"
        f"  os.environ[{LEGACY_KERAS!r}] = '1' in the first cell); cmlcluster passes it on to the workers."
    )


def check_coordinator(tf: types.ModuleType) -> None:
    """Before this process coordinates a cluster: say early what will not work with this TensorFlow.

    Keras 3 gets a warning, not an error, since custom training loops work with it; TFCluster
    turns the error of its model.fit into one that gives the fix (see fit_error).
    """
    _warn_if_untested(tf.__version__)
    flavour = keras_flavour(tf)
    if flavour == "missing":
        raise ConfigError(_missing_message(tf.__version__))
    if flavour == "keras_3" and "keras_3" not in _warned:
        _warned.add("keras_3")
        log.warning("cmlcluster: %s", _keras_3_message(tf.__version__))


def require_keras_2(tf: types.ModuleType) -> None:
    """For model.fit with ParameterServerStrategy, here and now: tf.keras must be Keras 2."""
    flavour = keras_flavour(tf)
    if flavour in ("keras_3", "missing"):
        raise ConfigError((_keras_3_message if flavour == "keras_3" else _missing_message)(tf.__version__))


def fit_error(error: BaseException) -> ConfigError | None:
    """A clear error for one raised by Keras 3's fit on a parameter-server cluster; None for any other."""
    tf = sys.modules.get("tensorflow")
    if tf is None or keras_flavour(tf) != "keras_3":
        return None
    in_keras_fit = False
    tb = error.__traceback__
    while tb is not None and not in_keras_fit:
        code = tb.tb_frame.f_code
        if f"{os.sep}keras{os.sep}src{os.sep}" in code.co_filename:
            # Keras cuts its own frames from tracebacks, but keeps the wrapper that holds the method.
            wrapped = tb.tb_frame.f_locals.get("fn") if code.co_name == "error_handler" else None
            in_keras_fit = bool(TRAINING_METHODS & {code.co_name, getattr(wrapped, "__name__", "")})
        tb = tb.tb_next
    return ConfigError(_keras_3_message(tf.__version__)) if in_keras_fit else None


def _keras_3_message(version: str) -> str:
    return (
        f"TensorFlow {version} gives tf.keras as Keras 3, whose model.fit does not support "
        "ParameterServerStrategy (keras-team/keras#18624). For Keras training with this process as the "
        "coordinator, use tf_keras, the Keras 2 made for this TensorFlow:\n"
        + legacy_keras_fix(version, distribution())
        + "\n  (Custom training loops with tf.distribute.coordinator.ClusterCoordinator work with Keras 3.)"
    )


def _missing_message(version: str) -> str:
    return f"{LEGACY_KERAS} is set, but tf_keras for TensorFlow {version} is not installed:\n" + legacy_keras_fix(
        version, distribution()
    )


def _warn_if_untested(version: str) -> None:
    if not TESTED[0] <= minor(version) <= TESTED[1] and version not in _warned:
        _warned.add(version)
        range_ = [".".join(map(str, v)) for v in TESTED]
        log.warning("cmlcluster: TensorFlow %s is outside the versions it is tested with (%s to %s)", version, *range_)


def legacy_keras_env() -> dict[str, str]:
    """TF_USE_LEGACY_KERAS for the workers, when this process has it: their tf.keras is then the same."""
    value = os.environ.get(LEGACY_KERAS)
    return {LEGACY_KERAS: value} if value is not None else {}
