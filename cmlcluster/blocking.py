"""Calls that hold a notebook's cell, and ending one from another thread (the widget's Stop button).

A cell runs on the main thread; a click on the widget reaches the kernel on another one. A cmlcluster
call that blocks the cell (await_workers, run_horovod, run_torch, a TFCluster's run_script) runs inside
`blocking(session)`; `interrupt(session, finish)` from any thread then ends it the way the kernel's
Interrupt (■) does: SIGINT to the main thread. Every blocking call already waits in short slices and
stops what it started on KeyboardInterrupt, so those paths run unchanged; the outermost call then runs
`finish()` on the main thread and raises StoppedFromWidget with the sentence it returns.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


class StoppedFromWidget(KeyboardInterrupt):
    """A blocking call ended by the widget's Stop. A KeyboardInterrupt, so that every path that cleans
    up after Ctrl-C cleans up after it, and `except Exception` in a user's cell does not swallow it."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows under the cell: the sentence, not the frames of the call the user ended
        (a coordinator's model.fit has a screen of Keras's)."""
        return [f"{type(self).__name__}: {self}"]


@dataclass
class _Call:
    owner: object
    finish: Callable[[], str] | None = None  # set by interrupt(): runs on the main thread, says what stopped


_lock = threading.Lock()
_call: _Call | None = None  # the main thread's outermost blocking call
_listeners: list[Callable[[], None]] = []


@contextlib.contextmanager
def blocking(owner: object) -> Iterator[None]:
    """Mark a call of `owner` (a session) that blocks the main thread until it returns.

    Nested calls (run_torch waiting for its workers) belong to the outermost one. Off the main thread
    nothing is marked: a signal could only reach the main thread, which is not the one waiting."""
    call = _enter(owner)
    if call is None:
        yield
        return
    _changed()
    seen = False
    try:
        yield
    except KeyboardInterrupt:
        seen = True
        raise
    finally:
        finish, late = _leave(call, seen)
        _changed()
        if finish is not None:  # even if the call ended meanwhile: its workers are stopped
            raise StoppedFromWidget(finish()) from None
        if late:
            raise KeyboardInterrupt  # the kernel's Interrupt, while the call was leaving


def busy(owner: object) -> bool:
    """Whether a call of `owner` holds the main thread now."""
    call = _call
    return call is not None and call.owner is owner


def stopping(owner: object) -> bool:
    """Whether the widget's Stop is ending the call of `owner` that holds the main thread now."""
    call = _call
    return call is not None and call.owner is owner and call.finish is not None


def interrupt(owner: object, finish: Callable[[], str]) -> bool:
    """End the call of `owner` that holds the main thread, if one does; returns whether one did.

    Only schedules: safe on any thread, never blocks for long. Refused where SIGINT would not raise
    KeyboardInterrupt in the cell (someone else's handler is installed, as for an async cell)."""
    with _lock:
        call = _call
        if call is None or call.owner is not owner or call.finish is not None:
            return False
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        main = threading.main_thread().ident
        if main is None:
            return False
        call.finish = finish
        # Under the lock, so that the call cannot leave between this check and the signal (see _leave).
        signal.pthread_kill(main, signal.SIGINT)
    return True


def watch(listener: Callable[[], None]) -> None:
    """Call `listener()` (on the main thread, quickly) whenever a blocking call starts or ends."""
    _listeners.append(listener)


def unwatch(listener: Callable[[], None]) -> None:
    with contextlib.suppress(ValueError):
        _listeners.remove(listener)


def _enter(owner: object) -> _Call | None:
    global _call
    if threading.current_thread() is not threading.main_thread():
        return None
    with _lock:
        if _call is not None:
            return None  # an inner call
        _call = _Call(owner)
        return _call


def _leave(call: _Call, seen: bool) -> tuple[Callable[[], str] | None, bool]:
    """Unmark `call`: (what interrupt() left to run, or None; whether a KeyboardInterrupt came meanwhile).

    interrupt() signals while it holds the lock, so its SIGINT can land while this waits for the lock:
    take it and try again, so that the call is always unmarked. One sent just before this took the lock
    is taken here too (not in the cell's next line)."""
    global _call
    late = False
    while True:
        try:
            with _lock:
                if _call is call:
                    _call = None
                finish = call.finish
            if finish is not None and not (seen or late):
                time.sleep(0.001)  # a system call: the signal is delivered by now
                _checkpoint()
            return finish, late
        except KeyboardInterrupt:
            late = True


def _checkpoint() -> None:
    """A Python call: the interpreter runs a signal handler that is due on entering it."""


def _changed() -> None:
    for listener in list(_listeners):
        with contextlib.suppress(Exception):  # a view's trouble never fails the user's call
            listener()
