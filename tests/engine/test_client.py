"""The engine clients against a fake core in a real engine process: streaming, abort, checks, failures."""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fake_core import CRASH, LOAD_STEPS, MAX_MODEL_LEN, RAISE, REJECT, VOCAB_SIZE

from app.engine.client import AsyncEngineClient, EngineClient, EngineError
from app.engine.config import EngineConfig
from app.engine.protocol import InvalidRequest, Loading, SamplingParams, WindowStats

CONFIG = EngineConfig(parallel=4)
FAKE = "fake_core:make"
DEADLINE_S = 5.0


def start(factory: str = FAKE) -> EngineClient:
    return EngineClient.start(CONFIG, factory, startup_timeout=30)


@pytest.fixture(scope="module")
def client() -> Iterator[EngineClient]:
    with start() as engine:
        yield engine


def test_ready_handshake(client: EngineClient) -> None:
    ready = client.ready
    assert (ready.model, ready.max_model_len, ready.vocab_size, ready.parallel) == (
        "fake",
        MAX_MODEL_LEN,
        VOCAB_SIZE,
        4,
    )
    assert client.exitcode is None


def test_generate_and_stats(client: EngineClient) -> None:
    windows: list[WindowStats] = []
    client.add_stats_listener(windows.append)
    done = client.generate([5, 6, 7], SamplingParams(max_tokens=5))
    assert done.token_ids == [5, 6, 7, 5, 6]
    assert done.text == "<5><6><7><5><6>"
    assert (done.finish_reason, done.prompt_tokens) == ("length", 3)
    assert windows
    assert client.last_stats is not None


def test_concurrent_requests(client: EngineClient) -> None:
    def run(i: int) -> list[int]:
        stream = client.submit([i + 1, i + 2, i + 3], SamplingParams(max_tokens=6), request_id=f"req-{i}")
        outputs = list(stream)
        assert all(output.request_id == f"req-{i}" for output in outputs)
        assert outputs[-1].finished
        return [token for output in outputs for token in output.token_ids]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    assert results == [[i + 1, i + 2, i + 3] * 2 for i in range(8)]


def test_abort(client: EngineClient) -> None:
    stream = client.submit([9], SamplingParams(max_tokens=60))
    first = next(stream)
    assert first.token_ids == [9] and not first.finished
    stream.abort()
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert len(rest) < 59
    client.abort("no-such-request")
    assert client.generate([4], SamplingParams(max_tokens=1)).token_ids == [4]


@pytest.mark.parametrize(
    ("prompt", "params", "param", "message"),
    [
        ([1], SamplingParams(temperature=-1), "temperature", "temperature must be >= 0"),
        (
            [1] * 10,
            SamplingParams(max_tokens=60),
            "max_tokens",
            "prompt (10 tokens) + max_tokens (60) exceeds",
        ),
        ([], SamplingParams(), "prompt", "must not be empty"),
        ([1, VOCAB_SIZE], SamplingParams(), "prompt", "outside the vocabulary"),
        ([-1], SamplingParams(), "prompt", "outside the vocabulary"),
        ([1.5], SamplingParams(), "prompt", "must be integers"),
        ([1], SamplingParams(stop=["x"] * 65), "stop", "at most 64 strings"),
        ([1], SamplingParams(stop=["x" * 1025]), "stop", "at most 1024 characters"),
        ([1], SamplingParams(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids", "outside the vocabulary"),
        ([1], SamplingParams(seed=2**64), "seed", "64-bit integer"),
    ],
)
def test_invalid_requests(
    client: EngineClient, prompt: list[int], params: SamplingParams, param: str, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)) as err:
        client.submit(prompt, params)
    assert err.value.param == param


def test_context_limit_is_inclusive(client: EngineClient) -> None:
    assert len(client.generate([2] * 4, SamplingParams(max_tokens=MAX_MODEL_LEN - 4)).token_ids) == 60


def test_duplicate_request_id(client: EngineClient) -> None:
    stream = client.submit([3], SamplingParams(max_tokens=30), request_id="same")
    with pytest.raises(InvalidRequest, match="already running"):
        client.submit([3], SamplingParams(), request_id="same")
    stream.abort()
    assert list(stream)[-1].finish_reason in ("abort", "length")


def test_rejected_request_raises(client: EngineClient) -> None:
    stream = client.submit([REJECT], SamplingParams())
    with pytest.raises(EngineError, match="rejected"):
        next(stream)
    with pytest.raises(StopIteration):
        next(stream)


def test_startup_failure() -> None:
    began = time.monotonic()
    with pytest.raises(EngineError, match="^cannot load model X$"):
        start("fake_core:make_failing")
    assert time.monotonic() - began < 10


def test_unknown_factory() -> None:
    with pytest.raises(EngineError, match="ModuleNotFoundError"):
        start("no_such_module:make")


@pytest.mark.parametrize(
    ("trigger", "message"),
    [
        (CRASH, "^engine process exited with status 3$"),
        (RAISE, "^engine process exited with status 1: .*boom$"),
    ],
)
def test_engine_death_reaches_waiting_client(trigger: int, message: str) -> None:
    engine = start()
    try:
        waiting = engine.submit([1], SamplingParams(max_tokens=60))
        assert next(waiting).token_ids == [1]
        began = time.monotonic()
        engine.submit([trigger], SamplingParams())
        with pytest.raises(EngineError, match=message):
            list(waiting)
        assert time.monotonic() - began < DEADLINE_S
        with pytest.raises(EngineError, match=message):
            engine.submit([1], SamplingParams())
        assert engine.exitcode == (3 if trigger == CRASH else 1)
    finally:
        engine.shutdown()


def test_shutdown_is_clean_and_idempotent() -> None:
    engine = start()
    assert engine.generate([7, 8], SamplingParams(max_tokens=2)).token_ids == [7, 8]
    open_stream = engine.submit([1], SamplingParams(max_tokens=60))
    engine.shutdown()
    engine.shutdown()
    assert engine.exitcode == 0
    with pytest.raises(EngineError, match="shut down"):
        list(open_stream)
    with pytest.raises(EngineError, match="shut down"):
        engine.submit([1], SamplingParams())


def test_async_client() -> None:
    async def main() -> None:
        async with await AsyncEngineClient.start(CONFIG, FAKE, startup_timeout=30) as engine:
            windows: list[tuple[WindowStats, bool]] = []
            loop_thread = threading.get_ident()
            engine.add_stats_listener(
                lambda stats: windows.append((stats, threading.get_ident() == loop_thread))
            )
            first, second = await asyncio.gather(
                engine.generate([1, 2], SamplingParams(max_tokens=4)),
                engine.generate([3], SamplingParams(max_tokens=3)),
            )
            assert (first.token_ids, second.token_ids) == ([1, 2, 1, 2], [3, 3, 3])
            assert windows and all(on_loop for _, on_loop in windows)

            stream = engine.submit([5], SamplingParams(max_tokens=60))
            assert (await anext(stream)).token_ids == [5]
            stream.abort()
            outputs = [output async for output in stream]
            assert outputs[-1].finish_reason == "abort"

            waiting = engine.submit([1], SamplingParams(max_tokens=60))
            await anext(waiting)
            began = time.monotonic()
            engine.submit([CRASH], SamplingParams())
            with pytest.raises(EngineError, match="status 3"):
                async for _ in waiting:
                    pass
            assert time.monotonic() - began < DEADLINE_S

    asyncio.run(main())


def test_the_loads_progress_comes_before_ready() -> None:
    reports: list[Loading] = []
    with EngineClient.start(
        CONFIG, "fake_core:slow_load", startup_timeout=30, on_loading=reports.append
    ) as c:
        assert c.ready.model == "fake"
    assert [r.done for r in reports] == list(range(1, LOAD_STEPS + 1))
    assert {(r.total, r.label) for r in reports} == {(LOAD_STEPS, "loading")}


def test_a_start_cancelled_while_the_engine_loads_stops_it() -> None:
    cancel = threading.Event()
    reports: list[Loading] = []

    def reported(message: Loading) -> None:
        reports.append(message)
        cancel.set()

    async def main() -> None:
        await AsyncEngineClient.start(
            CONFIG, "fake_core:endless_load", startup_timeout=60, on_loading=reported, cancel=cancel
        )

    before = {p.pid for p in multiprocessing.active_children()}
    began = time.monotonic()
    with pytest.raises(EngineError, match="cancelled"):
        asyncio.run(main())
    assert reports and time.monotonic() - began < 20
    assert {p.pid for p in multiprocessing.active_children()} <= before  # the loading engine is gone
