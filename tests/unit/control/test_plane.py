"""The deadline for a registered engine's first answer (control/plane.py's describe): counted from the latest
first answer of any engine or the last output any program sent, so that engines answering one after
another on a machine's few cores, or behind a thousand workers' output, are not failed, while one that
hangs still is (at DESCRIBE_LIMIT however busy the plane). And the wait for a call's last output
(_drain): counted from the iopub channel's latest message, so that output running behind the replies is
still taken, and a notice in the output where it gives up.

The engines here are futures the test answers on its own schedule (the session side's describe is
what is tested; the real agent's hang is test_reliability.py's)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time

import pytest

from cmlcluster.control import plane as control

TIMEOUT = 2.0  # DESCRIBE_TIMEOUT here; the schedules below keep 1 s or more from each deadline


class Engines(control.IPyParallelControl):
    """describe's requests go to futures that `answer` resolves."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[int, list[concurrent.futures.Future[dict[str, str]]]] = {}

    def _apply(self, engine_id, args):  # type: ignore[no-untyped-def]
        assert args == ("describe",)
        request: concurrent.futures.Future[dict[str, str]] = concurrent.futures.Future()
        self.requests.setdefault(engine_id, []).append(request)
        return None, request

    def answer(self, engine_id: int) -> None:
        for request in self.requests[engine_id]:
            if not request.done():
                request.set_result({"ip_address": f"10.0.0.{engine_id}", "hostname": "h", "pid": "1"})


@pytest.fixture(autouse=True)
def short_deadline(monkeypatch):
    monkeypatch.setattr(control, "DESCRIBE_TIMEOUT", TIMEOUT)
    monkeypatch.setattr(control, "DESCRIBE_LIMIT", LIMIT)


LIMIT = 5.0  # DESCRIBE_LIMIT here


async def _news_every(engines: Engines, seconds: float, until: float) -> None:
    """Other engines' output reaching the session (what on_iopub notes), every `seconds` until `until`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + until
    while loop.time() < end:
        engines._last_news = time.monotonic()
        await asyncio.sleep(seconds)


async def _answer_at(engines: Engines, schedule: dict[int, float]) -> None:
    start = asyncio.get_running_loop().time()
    for engine_id, at in sorted(schedule.items(), key=lambda item: item[1]):
        await asyncio.sleep(max(0.0, start + at - asyncio.get_running_loop().time()))
        engines.answer(engine_id)


def test_an_engine_answering_after_the_timeout_while_others_answer_in_turn_is_not_failed():
    async def main() -> list[object]:
        engines = Engines()
        # Engine 0 answers at 4 s, past its own 2 s; the others answered at 1, 2 and 3 s.
        answering = asyncio.ensure_future(_answer_at(engines, {1: 1.0, 2: 2.0, 3: 3.0, 0: 4.0}))
        results = await asyncio.gather(*(engines.describe(i) for i in range(4)), return_exceptions=True)
        await answering
        return results

    results = asyncio.run(main())
    assert [r.ip_address for r in results] == ["10.0.0.0", "10.0.0.1", "10.0.0.2", "10.0.0.3"]  # type: ignore[union-attr]


def test_an_engine_that_never_answers_fails_a_timeout_after_the_last_other_answer():
    async def main() -> tuple[BaseException | None, float]:
        engines = Engines()
        loop = asyncio.get_running_loop()
        start = loop.time()
        answering = asyncio.ensure_future(_answer_at(engines, {1: 0.3, 2: 0.8}))
        hung = asyncio.ensure_future(engines.describe(0))
        await asyncio.gather(engines.describe(1), engines.describe(2), answering)
        with pytest.raises(TimeoutError) as failed:
            await hung
        return failed.value, loop.time() - start

    error, took = asyncio.run(main())
    assert 0.8 + TIMEOUT <= took < 0.8 + TIMEOUT + 2.0, took  # counted from engine 2's answer, not its own ask
    assert re.search(
        r"engine 0 did not answer for \d s, 2 s of them while no other engine answered or sent output", str(error)
    )


def test_an_engine_whose_answer_waits_behind_other_engines_output_is_not_failed():
    # No other engine answers a describe, but their output keeps coming (1,024 workers printing): the
    # answer at 3.5 s, past the 2 s timeout, is still taken.
    async def main() -> object:
        engines = Engines()
        news = asyncio.ensure_future(_news_every(engines, 0.2, until=4.0))
        answering = asyncio.ensure_future(_answer_at(engines, {0: 3.5}))
        info = await engines.describe(0)
        await asyncio.gather(news, answering)
        return info

    assert asyncio.run(main()).ip_address == "10.0.0.0"  # type: ignore[attr-defined]


def test_an_engine_that_never_answers_fails_at_the_limit_however_busy_the_plane():
    async def main() -> tuple[BaseException, float]:
        engines = Engines()
        loop = asyncio.get_running_loop()
        start = loop.time()
        news = asyncio.ensure_future(_news_every(engines, 0.2, until=LIMIT + 3))
        with pytest.raises(TimeoutError) as failed:
            await engines.describe(0)
        took = loop.time() - start
        news.cancel()
        return failed.value, took

    error, took = asyncio.run(main())
    assert LIMIT <= took < LIMIT + 1.5, took
    assert "the most it is given while other engines' output kept the controller busy" in str(error)


def test_the_client_is_in_place_before_the_first_registration_can_be_heard(monkeypatch):
    # The session's loop may announce a registration (and describe the engine through the client) before
    # the thread that connected has returned: by then the plane must hold the client (a CI run failed a
    # healthy worker with "'NoneType' object has no attribute 'send_apply_request'").
    import ipyparallel

    from cmlcluster.control import ipyparallel_internals

    plane = control.IPyParallelControl()
    seen = []

    class Hooks(list):
        def append(self, callback):
            seen.append(plane._client)  # what an announcement made now would use
            super().append(callback)

    client = object()
    monkeypatch.setattr(ipyparallel_internals, "probe_client", lambda: None)
    monkeypatch.setattr(ipyparallel, "Client", lambda *args, **kwargs: client)
    monkeypatch.setattr(ipyparallel_internals, "registration_callbacks", lambda c: Hooks())
    monkeypatch.setattr(ipyparallel_internals, "route_iopub_topic", lambda *args: None)
    plane._connect("client.json")
    assert seen == [client] and plane._client is client


# ------------------------------------------------------------ a call's last output (_drain)


class Call:
    """What _drain waits on: ipyparallel's message future, whose `output` the engine's idle status resolves."""

    def __init__(self) -> None:
        self.output: concurrent.futures.Future[None] = concurrent.futures.Future()


async def _drained(engines: Engines, call: Call, idle_at: float | None) -> tuple[list[str], float]:
    """_drain's wait, and what the call's relay delivered by its end (a notice, if it gave up)."""
    loop = asyncio.get_running_loop()
    delivered: list[str] = []
    relay = control.OutputRelay(loop, lambda stream, text: delivered.append(text))
    if idle_at is not None:
        loop.call_later(idle_at, call.output.set_result, None)
    start = loop.time()
    await engines._drain(call, relay)
    took = loop.time() - start
    await asyncio.sleep(0)  # the relay's delivery, scheduled before _drain returned
    return delivered, took


def test_a_calls_end_waits_for_its_output_while_the_iopub_channel_moves(monkeypatch):
    # 1,024 workers printing put the session's iopub more than 5 s behind the replies: each program's last
    # lines came after its end was taken, and were lost (bench/printing_model.py). Idle at 3.5 s, past the
    # 2 s timeout, while other output keeps coming: waited for, and no notice.
    monkeypatch.setattr(control, "OUTPUT_DRAIN_TIMEOUT", TIMEOUT)

    async def main() -> tuple[list[str], float]:
        engines = Engines()
        news = asyncio.ensure_future(_news_every(engines, 0.2, until=4.0))
        drained = await _drained(engines, Call(), idle_at=3.5)
        await news
        return drained

    delivered, took = asyncio.run(main())
    assert delivered == [] and 3.5 <= took < 4.5, (delivered, took)


def test_a_calls_end_waits_a_timeout_of_silence_then_says_its_output_may_be_cut(monkeypatch):
    monkeypatch.setattr(control, "OUTPUT_DRAIN_TIMEOUT", TIMEOUT)
    delivered, took = asyncio.run(_drained(Engines(), Call(), idle_at=None))
    assert TIMEOUT <= took < TIMEOUT + 1.0, took
    assert delivered == ["[cmlcluster: the rest of this output did not arrive within 2 s]\n"]


def test_a_calls_end_waits_at_most_the_limit_however_busy_the_channel(monkeypatch):
    monkeypatch.setattr(control, "OUTPUT_DRAIN_TIMEOUT", TIMEOUT)
    monkeypatch.setattr(control, "OUTPUT_DRAIN_LIMIT", LIMIT)

    async def main() -> tuple[list[str], float]:
        engines = Engines()
        news = asyncio.ensure_future(_news_every(engines, 0.2, until=LIMIT + 3))
        drained = await _drained(engines, Call(), idle_at=None)
        news.cancel()
        return drained

    delivered, took = asyncio.run(main())
    assert LIMIT <= took < LIMIT + 1.0, took
    assert delivered == [f"[cmlcluster: the rest of this output did not arrive within {LIMIT:.0f} s]\n"]
