"""An asyncio loop on a background thread, and a sync facade that stays interruptible.

A notebook always has a running loop of its own, so the core cannot use it (nor
asyncio.run). The core runs on a private loop thread; sync callers wait on it in
short slices so that Ctrl-C / a kernel interrupt reaches them, and cancel the
coroutine when it does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_WAIT_SLICE = 0.1  # seconds; how quickly a sync caller notices Ctrl-C


class LoopThread:
    """Owns one event loop running forever on a daemon thread."""

    def __init__(self, name: str = "cmlcluster-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for it; Ctrl-C cancels it and re-raises."""
        if self.in_loop_thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from the loop thread; await the coroutine instead")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return _wait_in_slices(future, timeout)
        except BaseException:
            future.cancel()
            raise

    def call_soon(self, callback: Any, *args: Any) -> None:
        """Schedule a plain callback on the loop from any thread."""
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_loop_thread:
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self.loop.close()


def _wait_in_slices(future: concurrent.futures.Future[T], timeout: float | None) -> T:
    waited = 0.0
    while True:
        try:
            return future.result(timeout=_WAIT_SLICE)
        except concurrent.futures.TimeoutError:
            waited += _WAIT_SLICE
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"gave up after {timeout:g} s") from None


def settle_on_this_thread(future: asyncio.Future[T], loop: asyncio.AbstractEventLoop, call: Callable[[], T]) -> None:
    """Run call() on this thread; settle `future` (of `loop`) with its result or exception."""

    def settle(method: Callable[[Any], None], outcome: Any) -> None:
        if not future.done():
            method(outcome)

    try:
        result = call()
    except BaseException as e:
        loop.call_soon_threadsafe(settle, future.set_exception, e)
    else:
        loop.call_soon_threadsafe(settle, future.set_result, result)
