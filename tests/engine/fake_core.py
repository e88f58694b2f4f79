"""A stand-in engine core for client tests: echoes each prompt back, one token per window.

Triggers, by a prompt's first token id: 665 is rejected at once (finish_reason "error"), 666 makes `step()`
end the process with status 3, 667 makes `step()` raise RuntimeError("boom").
"""

from __future__ import annotations

import os
import time

from app.engine.config import EngineConfig
from app.engine.protocol import AddRequest, Ready, RequestOutput, SlotStats, WindowStats
from app.errors import StrataError
from app.loading.progress import Progress

MAX_MODEL_LEN = 64
VOCAB_SIZE = 1000
WINDOW_S = 0.005
REJECT, CRASH, RAISE = 665, 666, 667


class FakeCore:
    """Echo engine: request i's n-th output token is its prompt's token n (cycling), until max_tokens."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.requests: dict[str, tuple[AddRequest, list[int]]] = {}
        self.window = 0

    def ready(self) -> Ready:
        """The handshake."""
        return Ready(
            model="fake",
            model_path="",
            max_model_len=MAX_MODEL_LEN,
            vocab_size=VOCAB_SIZE,
            parallel=self.config.parallel,
            kv_blocks_total=16,
            block_size=16,
            eos_token_ids=[0],
        )

    def add_request(self, request: AddRequest) -> list[RequestOutput]:
        """Queue a request, or reject it when its prompt starts with REJECT."""
        if request.prompt_token_ids[0] == REJECT:
            return [RequestOutput(request.request_id, finished=True, finish_reason="error", error="rejected")]
        self.requests[request.request_id] = (request, [])
        return []

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Drop a request; its final output says abort."""
        if self.requests.pop(request_id, None) is None:
            return []
        return [RequestOutput(request_id, finished=True, finish_reason="abort")]

    def has_work(self) -> bool:
        """Whether any request is running."""
        return bool(self.requests)

    def step(self) -> tuple[list[RequestOutput], WindowStats]:
        """Emit one token per request."""
        started = time.time()
        time.sleep(WINDOW_S)
        outputs, slots = [], []
        for request_id, (request, generated) in list(self.requests.items()):
            prompt = request.prompt_token_ids
            if prompt[0] == CRASH:
                os._exit(3)
            if prompt[0] == RAISE:
                raise RuntimeError("boom")
            token = prompt[len(generated) % len(prompt)]
            generated.append(token)
            finished = len(generated) >= request.params.max_tokens
            if finished:
                del self.requests[request_id]
            outputs.append(
                RequestOutput(
                    request_id,
                    token_ids=[token],
                    text=f"<{token}>",
                    finished=finished,
                    finish_reason="length" if finished else None,
                    prompt_tokens=len(prompt),
                    output_tokens=len(generated),
                )
            )
            slots.append(
                SlotStats(
                    slot=len(slots),
                    request_id=request_id,
                    phase="decode",
                    prompt_tokens=len(prompt),
                    prompt_total=len(prompt),
                    output_tokens=len(generated),
                    context_tokens=len(prompt) + len(generated),
                    window_tokens=1,
                )
            )
        self.window += 1
        stats = WindowStats(
            window=self.window,
            started=started,
            duration_s=time.time() - started,
            rows=len(slots),
            prompt_tokens=0,
            decode_tokens=len(slots),
            slots=slots,
            waiting=0,
            kv_blocks_used=0,
            kv_blocks_total=16,
        )
        return outputs, stats


def make(config: EngineConfig) -> FakeCore:
    """The factory the client tests start the engine with."""
    return FakeCore(config)


def make_failing(config: EngineConfig) -> FakeCore:
    """A factory that cannot load its model."""
    raise StrataError("cannot load model X")


LOAD_STEPS = 4
LOAD_STEP_S = 0.12  # longer than the bar's 0.1 s between reports: every step is reported


def slow_load(config: EngineConfig) -> FakeCore:
    """A FakeCore that first reports a load of LOAD_STEPS steps, LOAD_STEP_S apart (the loader's bar)."""
    bar = Progress(LOAD_STEPS, "loading", enabled=True)
    for _ in range(LOAD_STEPS):
        time.sleep(LOAD_STEP_S)
        bar.advance()
    bar.close()
    return FakeCore(config)


def endless_load(config: EngineConfig) -> FakeCore:
    """A core whose load reports a first step and then never ends (a start that must be cancelled)."""
    Progress(2, "loading", enabled=True).advance()
    time.sleep(3600)
    return FakeCore(config)
