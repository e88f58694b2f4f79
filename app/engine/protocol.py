"""Messages between the engine process and its clients (msgspec structs, msgpack on the wire)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import msgspec

from app.errors import StrataError

FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_LOGPROBS = 20
MAX_SPEC_TOKENS = 16  # draft tokens a request may ask to verify a window
MAX_STOP_STRINGS = 64  # a request's stop strings: each is matched against every token's text
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
SEEDS = (-(2**63), 2**64)  # what a seed may be: a 64-bit integer, signed or not
EXPERT_REPORT_S = 0.5


class InvalidRequest(StrataError):
    """A request with a value no request may have; the message names the field, `param` holds it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


class Grammar(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a request's output must match (structured output, app/engine/grammar.py): `kind` one of
    GRAMMAR_KINDS; `source` the JSON schema as JSON text, the regular expression, the choices as a JSON list
    of strings, or the Lark grammar (nothing for json_object); `param` the request field it came from, for
    errors."""

    kind: str
    source: str = ""
    param: str = "response_format"

    def describe(self) -> str:
        """What the grammar is, in words."""
        return {
            "json_schema": "JSON schema",
            "json_object": "JSON object grammar",
            "regex": "regular expression",
            "choice": "choice list",
            "lark": "grammar",
        }.get(self.kind, "grammar")


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How one request picks its tokens and when it stops.

    temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 are off; a seed makes sampling reproducible
    alone or in any batch. Penalties follow OpenAI (presence, frequency: over generated tokens) and HF
    (repetition: over prompt and generated tokens). `logprobs` asks for the chosen token's log-probability
    and that many alternatives. `spec_tokens` drafts up to that many tokens a window for this request (0:
    none; None: the engine's `--spec-tokens` where `--spec` is on). `grammar` constrains every token to keep
    the output inside it (such a request drafts nothing).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spec_tokens: int | None = None
    grammar: Grammar | None = None

    def validate(self) -> None:
        """Raise InvalidRequest naming the first field out of range."""
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 turns it off)"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 10, "repetition_penalty", "must be in (0, 10]"),
            (all(self.stop), "stop", "must not contain empty strings"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop", f"may hold at most {MAX_STOP_STRINGS} strings"),
            (
                all(len(s) <= MAX_STOP_CHARS for s in self.stop),
                "stop",
                f"strings may be at most {MAX_STOP_CHARS} characters long",
            ),
            (
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                "stop_token_ids",
                f"may hold at most {MAX_STOP_TOKEN_IDS} ids",
            ),
            (
                self.seed is None or SEEDS[0] <= self.seed < SEEDS[1],
                "seed",
                "must be a 64-bit integer",
            ),
            (
                self.spec_tokens is None or 0 <= self.spec_tokens <= MAX_SPEC_TOKENS,
                "spec_tokens",
                f"must be in [0, {MAX_SPEC_TOKENS}]",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for ok, field, message in checks:
            if not ok:
                raise InvalidRequest(f"{field} {message}", field)
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}", self.grammar.param
            )

    @property
    def greedy(self) -> bool:
        """True when the request always takes the most likely token."""
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """True when the request's logits depend on the tokens generated so far (any penalty is set)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)


def check_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt as plain ints, once the request is known to fit the model; else InvalidRequest."""
    params.validate()
    try:
        prompt = [operator.index(token) for token in prompt_token_ids]
    except TypeError:
        raise InvalidRequest("prompt token ids must be integers", "prompt") from None
    if not prompt:
        raise InvalidRequest("prompt must not be empty", "prompt")
    bad = next((token for token in prompt if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    bad = next((token for token in params.stop_token_ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"stop token id {bad} is outside the vocabulary [0, {vocab_size})", "stop_token_ids"
        )
    if len(prompt) + params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
            f"{max_model_len} tokens",
            "max_tokens",
        )
    return prompt


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    """Start generating for a prompt of token ids."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    """Stop a request; its slot and state are freed within one window."""

    request_id: str


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Finish the current window and exit."""


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """A token id and its log-probability under the model."""

    token_id: int
    logprob: float


class PositionLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """The chosen token's log-probability and the most likely alternatives at one position."""

    chosen: TokenLogprob
    top: list[TokenLogprob]


class RequestOutput(msgspec.Struct, tag="out", omit_defaults=True):
    """What a request produced since its last output: new tokens, their text, and whether it is done.

    `finish_reason` is one of stop, length, abort, error; with error, `error` says why.
    """

    request_id: str
    token_ids: list[int] = []
    text: str = ""
    logprobs: list[PositionLogprobs] = []
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0


class SlotStats(msgspec.Struct, array_like=True, frozen=True):
    """One busy slot in a window: which request, what it did, how far it is."""

    slot: int
    request_id: str
    phase: str  # "prompt" (reading its prompt) or "decode"
    prompt_tokens: int  # tokens of the prompt read so far
    prompt_total: int
    output_tokens: int
    context_tokens: int  # tokens held in state
    window_tokens: int  # tokens this slot fed in this window
    grammar: bool = False  # its request's output follows a grammar (structured output, tool choice)


EXPERT_SOURCES = ("vram", "cpu", "pcie")  # what each `ExpertUsage.location` code means for a routed entry


class ExpertUsage(msgspec.Struct, frozen=True):
    """Where each routed expert lives and how often the router picked it since the previous report.

    One row per MoE layer (`layers` holds the model's layer indices); `location`: 0 GPU memory, 1 host RAM
    (run on the CPU), 2 copied over PCIe for the window (`EXPERT_SOURCES` names them).
    """

    layers: list[int]
    routed: list[list[int]]
    location: list[list[int]]
    seconds: float  # the span the counts cover
    swaps: int = 0  # experts the tier moved onto the device in that span (app/models/expert_tier.py)
    served: list[list[int]] | None = None  # with a tier: per layer, entries served per EXPERT_SOURCES
    pcie_bytes: int = 0  # bytes the tier copied to the device in that span (staged misses, swapped experts)
    adapt_wait_s: float = 0.0  # device time windows waited in that span for the tier's blocking swaps

    def served_total(self) -> list[int]:
        """Entries served per EXPERT_SOURCES over every layer (all 0 without a tier)."""
        if not self.served:
            return [0] * len(EXPERT_SOURCES)
        return [sum(column) for column in zip(*self.served, strict=True)]


class ParkingStats(msgspec.Struct, array_like=True, frozen=True):
    """The conversation park's state after a window: conversations and bytes in RAM and on disk, restores
    and their total time, bytes copied to the host (a conversation parked again copies only new blocks)."""

    conversations_ram: int
    conversations_disk: int
    bytes_ram: int
    bytes_disk: int
    restores: int
    restore_seconds: float
    copied_bytes: int


class StageTimes(msgspec.Struct, frozen=True):
    """One stage of a layer split in one window: seconds it worked on the window (its layers; stage 0 also
    embeds and samples elsewhere), and seconds it waited for the window to reach it (stage 0: for the last
    stage's answer)."""

    busy_s: float
    wait_s: float


class WindowStats(msgspec.Struct, tag="stats", frozen=True):
    """The record every window emits: what ran, how long it took, the state of slots, queue and KV pool."""

    window: int
    started: float
    duration_s: float
    rows: int
    prompt_tokens: int
    decode_tokens: int
    slots: list[SlotStats]
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    finished: int = 0
    preempted: int = 0
    experts: ExpertUsage | None = None  # sent at most every EXPERT_REPORT_S seconds
    prefix_cache_queries: int = 0  # tokens of the requests admitted in this window
    prefix_cache_hits: int = 0  # of which taken from the prefix cache
    parking: ParkingStats | None = None  # when conversations are parked
    step_s: float = 0.0  # the whole step: planning the window, running it, handing out its tokens
    host_s: float = 0.0  # of which the host was busy (not waiting for the device)
    stages: list[StageTimes] | None = None  # on a layer split, each stage's times in this window
    drafts: list[tuple[int, int, int]] = []  # each drafting request's (slot, draft tokens, of them accepted)
    kv_vram_reads: int = 0  # with --kv-resident: KV blocks the window read from VRAM (once a sequence)
    kv_host_reads: int = 0  # and streamed in from host RAM
    kv_moved_to_device: int = 0  # with --kv-resident: KV blocks copied onto the device before the window
    kv_moved_to_host: int = 0  # and cached blocks copied to host RAM to make room for them
    replayed: bool = False  # the window replayed captured CUDA graphs (else it ran eagerly)
    charged_s: float | None = None  # the time the scheduler predicted and charged decoding slots for it
    cost_s: float | None = None  # the time it took as the scheduler learned it (on a CPU: its computation)

    @property
    def kv_usage(self) -> float:
        """Share of the KV pool in use, 0..1."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """Sent once the engine has loaded its model and can take requests."""

    model: str
    model_path: str
    max_model_len: int
    vocab_size: int
    parallel: int
    kv_blocks_total: int
    block_size: int
    eos_token_ids: list[int]
    backends: str = ""
    device: str = ""
    dtype: str = ""  # the weights' dtype (`--dtype auto` chooses by device)
    prefix_cache: bool = False
    drafts: str | None = None  # why a request may not ask for drafts (`spec_tokens`), or None: it may
    window_tokens: int = 0  # a window's token budget (`EngineConfig.window_tokens`)


class Loading(msgspec.Struct, tag="loading", frozen=True):
    """Sent while the engine loads its model, before Ready: `done` of `total` (bytes, or steps)."""

    done: int
    total: int
    label: str = "loading"


class EngineFailed(msgspec.Struct, tag="failed", frozen=True):
    """The engine could not start or hit an error it cannot continue from."""

    message: str


ClientMessage = AddRequest | AbortRequest | Shutdown
EngineMessage = RequestOutput | WindowStats | Ready | Loading | EngineFailed
