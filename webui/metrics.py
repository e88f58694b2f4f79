"""Server metrics at `/metrics`: vLLM's Prometheus names (`strata:` for our own), and the same as JSON."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from litestar import MediaType, Request, Response, get
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.params import QueryParameter
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.engine.protocol import (
    EXPERT_SOURCES,
    FINISH_REASONS,
    ExpertUsage,
    ParkingStats,
    Ready,
    SlotStats,
    WindowStats,
)
from webui.auth import require_api_key
from webui.engine_link import RequestRecord
from webui.experts import ExpertHeat
from webui.loading import not_loaded
from webui.system import SystemSampler

ENGINE = "0"
LABELS = ("model_name", "engine")
LIVE_SPAN_S = 5.0  # live_tok_s averages the windows that ended this long before the newest one
FORGET_AFTER = 4096  # finished request ids remembered, to hide them from windows that arrive late

LAT_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560),
)
WINDOW_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1)
ITERATION_TOKEN_BUCKETS = (1, *(2**power for power in range(3, 15)))
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
HTTP_DURATION_BUCKETS = (0.1, 0.5, 1)  # prometheus-fastapi-instrumentator's default for this metric

PROMETHEUS_TEXT = "text/plain; version=0.0.4"  # litestar appends "; charset=utf-8" to text/ types
SLOT_STATES = {"idle": 0, "prompt": 1, "decode": 2}

# (exposed name, type, help) of each unlabelled gauge and counter; its JSON key is the name after the prefix.
SCALARS = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in queried tokens."),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in cached tokens."),
    ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions from the engine."),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed."),
    ("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens."),
    ("strata:live_tok_s", "gauge", "Tokens generated per second over the last 5 s of windows."),
    ("strata:live_slots", "gauge", "Busy slots."),
    ("strata:parallel", "gauge", "Slots: the most requests the engine runs at once."),
    ("strata:window_seconds", "gauge", "Duration of the last window."),
    ("strata:kv_blocks_used", "gauge", "KV blocks in use."),
    ("strata:kv_blocks_total", "gauge", "KV blocks in the pool."),
    ("strata:windows_total", "counter", "Windows the engine ran."),
    (
        "strata:windows_replayed_total",
        "counter",
        "Windows replayed from captured CUDA graphs (others ran eagerly).",
    ),
    ("strata:decode_windows_total", "counter", "Windows of decode rows alone (no prompt rows)."),
    (
        "strata:decode_window_seconds_total",
        "counter",
        "What those windows took, as the scheduler measured them (on a CPU: their computation).",
    ),
    (
        "strata:paced_windows_total",
        "counter",
        "Windows with prompt rows whose cost the scheduler predicted and charged to decoding slots.",
    ),
    (
        "strata:paced_window_predicted_seconds_total",
        "counter",
        "The scheduler's predictions of what those windows take.",
    ),
    (
        "strata:paced_window_seconds_total",
        "counter",
        "What those windows took, as the scheduler measured them (on a CPU: their computation).",
    ),
    ("strata:parked_conversations_ram", "gauge", "Conversations parked in host RAM."),
    ("strata:parked_conversations_disk", "gauge", "Conversations parked on disk."),
    ("strata:parked_bytes_ram", "gauge", "Host RAM held by parked conversations."),
    ("strata:parked_bytes_disk", "gauge", "Disk held by parked conversations."),
    ("strata:park_restores_total", "counter", "Parked conversations brought back for a follow-up."),
    ("strata:park_restore_seconds_total", "counter", "Time spent bringing parked conversations back."),
    ("strata:park_copied_bytes_total", "counter", "Bytes copied from the device to park conversations."),
    (
        "strata:kv_vram_block_reads_total",
        "counter",
        "KV blocks attention read from VRAM, a block once a sequence a window (counted with --kv-resident).",
    ),
    (
        "strata:kv_host_block_reads_total",
        "counter",
        "KV blocks streamed in from host RAM for attention (--kv-resident), once a sequence a window.",
    ),
    (
        "strata:kv_blocks_moved_to_device_total",
        "counter",
        "KV blocks of the requests being answered copied from host RAM onto the device (--kv-resident).",
    ),
    (
        "strata:kv_blocks_moved_to_host_total",
        "counter",
        "Cached KV blocks no request holds copied to host RAM to make room on the device (--kv-resident).",
    ),
    ("strata:expert_swaps_total", "counter", "Experts the expert tier moved onto the device."),
    (
        "strata:expert_pcie_bytes_total",
        "counter",
        "Bytes the expert tier copied to the device: missed experts staged for a window, swapped-in experts.",
    ),
    (
        "strata:expert_adapt_wait_seconds_total",
        "counter",
        "Device time windows waited for the expert tier's blocking swaps (none with --adapt-async).",
    ),
)
GPU_GAUGES = (  # (name, card field, scale, documentation): one series per NVIDIA card, labelled gpu and name
    ("strata:gpu_utilization_ratio", "utilization", 0.01, "Share of the last sample period a kernel ran."),
    ("strata:gpu_memory_used_bytes", "memory_used", 1, "Device memory in use."),
    ("strata:gpu_memory_total_bytes", "memory_total", 1, "Device memory in all."),
    ("strata:gpu_power_watts", "power_w", 1, "Power draw."),
    ("strata:gpu_power_limit_watts", "power_limit_w", 1, "Enforced power limit."),
    ("strata:gpu_temperature_celsius", "temperature_c", 1, "Core temperature."),
)
SLOT_GAUGES = (
    ("strata:slot_context_tokens", "context_tokens", "Tokens held in the slot's state."),
    ("strata:slot_output_tokens", "output_tokens", "Tokens the slot's request generated."),
    ("strata:slot_state", "state", "Slot state: 0 idle, 1 reading its prompt, 2 decoding."),
)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's length buckets)."""
    buckets = []
    for power in range(len(str(max_value))):
        buckets += [m * 10**power for m in (1, 2, 5) if m * 10**power <= max_value]
    return buckets


def _generated(stats: WindowStats) -> int:
    """Tokens sampled in a window: one per slot that ran and decodes and each draft token it accepted, one
    per request it finished."""
    decoded = sum(slot.phase == "decode" and slot.window_tokens > 0 for slot in stats.slots)
    return decoded + sum(taken for _, _, taken in stats.drafts) + stats.finished


class ServerMetrics:
    """Every metric of the server, fed by the engine link (a `RequestObserver`) and the HTTP middleware.

    The gauges and counters live in plain attributes, changed only by `on_window` and
    `on_request_finished`; `values()` reads them once, and both the Prometheus exposition (`registry`)
    and the JSON `snapshot()` are rendered from that. Distributions are prometheus-client histograms.
    A window can arrive after the end of a request it lists (an abort crossing a running window), so
    finished requests are kept out of the slots, and an empty engine holds no KV blocks and makes no tokens.
    """

    def __init__(self, model_name: str, ready: Ready, per_expert: bool = False) -> None:
        self.model_name = model_name
        self.ready = ready
        self.registry = CollectorRegistry()
        self.slots: dict[int, SlotStats] = {}
        self.waiting = 0
        self.kv_blocks_used = 0
        self.kv_blocks_total = ready.kv_blocks_total
        self.window_seconds = 0.0
        self.windows_total = 0
        self.windows_replayed_total = 0
        self.decode_windows_total = 0
        self.decode_window_seconds_total = 0.0
        self.paced_windows_total = 0
        self.paced_window_predicted_seconds_total = 0.0
        self.paced_window_seconds_total = 0.0
        self.live_tok_s = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.kv_vram_block_reads_total = 0
        self.kv_host_block_reads_total = 0
        self.kv_blocks_moved_to_device_total = 0
        self.kv_blocks_moved_to_host_total = 0
        self.parking = ParkingStats(0, 0, 0, 0, 0, 0.0, 0)
        self.request_success_total = dict.fromkeys(FINISH_REASONS, 0)
        self.expert_routed_total = dict.fromkeys(EXPERT_SOURCES, 0)
        self.expert_routed_by_layer: dict[int, list[int]] = {}  # layer -> entries per EXPERT_SOURCES
        self.heat = ExpertHeat()  # where each expert lives and how hot it is (the Monitor's grid too)
        self.per_expert = per_expert
        self.expert_swaps_total = 0
        self.system: SystemSampler | None = None  # host, process and card figures (webui/system.py)
        self.expert_pcie_bytes_total = 0
        self.expert_adapt_wait_seconds_total = 0.0
        self.stage_seconds_total: list[list[float]] = []  # per stage of a layer split: [busy, wait]
        self.spec_decode_num_drafts_total = 0
        self.spec_decode_num_draft_tokens_total = 0
        self.spec_decode_num_accepted_tokens_total = 0
        self.spec_decode_accepted_per_pos: list[int] = []  # accepted draft tokens at each position
        self.slot_windows: dict[int, tuple[str, int, int]] = {}  # slot: (request, decode windows, tokens)
        self._recent: deque[tuple[float, float, int]] = deque()  # (start, end, tokens) of recent windows
        self._ended: dict[str, None] = {}  # ids of finished requests, oldest first
        self._histograms: dict[str, Histogram] = {}
        lengths = buckets_1_2_5(ready.max_model_len)
        self.iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine step.",
            ITERATION_TOKEN_BUCKETS,
        )
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", lengths
        )
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", lengths
        )
        self.request_max_num_generation_tokens = self._histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            lengths,
        )
        self.request_params_n = self._histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        )
        self.request_params_max_tokens = self._histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", lengths
        )
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.time_per_output_token = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e_latency = self._histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LAT_BUCKETS
        )
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase.", LAT_BUCKETS
        )
        self.prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase.", LAT_BUCKETS
        )
        self.decode_time = self._histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase.", LAT_BUCKETS
        )
        self.inference_time = self._histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase.", LAT_BUCKETS
        )
        self.window_step = self._histogram(
            "strata:window_step_seconds",
            "Histogram of engine steps: planning a window, running it and handing out its tokens.",
            WINDOW_BUCKETS,
        )
        self.window_host = self._histogram(
            "strata:window_host_seconds",
            "Histogram of the host's busy time in each engine step (not waiting for the device).",
            WINDOW_BUCKETS,
        )
        self.http_requests = Counter(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            ("handler", "method", "status"),
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler.",
            ("handler", "method"),
            buckets=HTTP_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.requests_by_feature = Counter(
            "strata:requests_by_feature",
            "Chat and completion requests by what they asked for: tools, tool_choice required or named, "
            "response_format json_object or json_schema, a regex, choice or Lark grammar, thinking.",
            [*LABELS, "feature"],
            registry=self.registry,
        )
        self.registry.register(_ValuesCollector(self))

    def count_features(self, features: list[str]) -> None:
        """Count a request under each feature it uses (`strata:requests_by_feature_total`)."""
        for feature in features:
            self.requests_by_feature.labels(self.model_name, ENGINE, feature).inc()

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
        histogram = Histogram(name, documentation, LABELS, buckets=buckets, registry=self.registry)
        self._histograms[name] = histogram
        return histogram.labels(self.model_name, ENGINE)

    def on_window(self, stats: WindowStats) -> None:
        """Take the state of slots, queue and KV pool from a window, and its sizes."""
        self.slots = {slot.slot: slot for slot in stats.slots if slot.request_id not in self._ended}
        self.waiting = stats.waiting
        self.kv_blocks_used = stats.kv_blocks_used
        self.kv_blocks_total = stats.kv_blocks_total
        self.window_seconds = stats.duration_s
        self.windows_total = stats.window
        self.windows_replayed_total += stats.replayed
        if stats.decode_tokens and not stats.prompt_tokens and stats.cost_s is not None:
            self.decode_windows_total += 1
            self.decode_window_seconds_total += stats.cost_s
        if stats.prompt_tokens and stats.charged_s is not None and stats.cost_s is not None:
            self.paced_windows_total += 1
            self.paced_window_predicted_seconds_total += stats.charged_s
            self.paced_window_seconds_total += stats.cost_s
        self.num_preemptions_total += stats.preempted
        self.prefix_cache_queries_total += stats.prefix_cache_queries
        self.prefix_cache_hits_total += stats.prefix_cache_hits
        self.kv_vram_block_reads_total += stats.kv_vram_reads
        self.kv_host_block_reads_total += stats.kv_host_reads
        self.kv_blocks_moved_to_device_total += stats.kv_moved_to_device
        self.kv_blocks_moved_to_host_total += stats.kv_moved_to_host
        if stats.parking is not None:
            self.parking = stats.parking
        self.heat.on_window(stats)
        if stats.experts is not None:
            self.expert_swaps_total += stats.experts.swaps
            self.expert_pcie_bytes_total += stats.experts.pcie_bytes
            self.expert_adapt_wait_seconds_total += stats.experts.adapt_wait_s
            self._count_served(stats.experts)
        for _, proposed, taken in stats.drafts:
            self.spec_decode_num_drafts_total += 1
            self.spec_decode_num_draft_tokens_total += proposed
            self.spec_decode_num_accepted_tokens_total += taken
            positions = self.spec_decode_accepted_per_pos
            positions += [0] * (proposed - len(positions))
            for position in range(taken):
                positions[position] += 1
        self._count_slot_windows(stats)
        for stage, times in enumerate(stats.stages or []):
            if stage == len(self.stage_seconds_total):
                self.stage_seconds_total.append([0.0, 0.0])
            self.stage_seconds_total[stage][0] += times.busy_s
            self.stage_seconds_total[stage][1] += times.wait_s
        self.iteration_tokens.observe(stats.rows)
        self.window_step.observe(stats.step_s)
        self.window_host.observe(stats.host_s)
        end = stats.started + stats.duration_s
        self._recent.append((stats.started, end, _generated(stats)))
        while self._recent[0][1] < end - LIVE_SPAN_S:
            self._recent.popleft()
        span = end - self._recent[0][0]
        self.live_tok_s = sum(tokens for *_, tokens in self._recent) / span if span > 0 else 0.0
        if not self.slots:
            self._idle()

    def _count_slot_windows(self, stats: WindowStats) -> None:
        """Each decoding slot's windows and the tokens they gave its request (1, and the drafts accepted)."""
        accepted = {slot: taken for slot, _, taken in stats.drafts}
        for slot in stats.slots:
            if slot.phase != "decode" or slot.window_tokens == 0:
                continue
            request, windows, tokens = self.slot_windows.get(slot.slot, (slot.request_id, 0, 0))
            if request != slot.request_id:
                windows, tokens = 0, 0
            gained = 1 + accepted.get(slot.slot, 0)
            self.slot_windows[slot.slot] = (slot.request_id, windows + 1, tokens + gained)

    def _tokens_per_window(self, slot: SlotStats) -> float:
        """The tokens a decode window gave the slot's request, on average so far (0 before its first)."""
        request, windows, tokens = self.slot_windows.get(slot.slot, ("", 0, 0))
        return tokens / windows if request == slot.request_id and windows else 0.0

    def _count_served(self, experts: ExpertUsage) -> None:
        """Routed entries of each layer by where they were served: as the tier counted them, else where the
        expert lives."""
        for i, layer in enumerate(experts.layers):
            if experts.served is not None:
                counts = experts.served[i]
            else:
                counts = [0] * len(EXPERT_SOURCES)
                for count, where in zip(experts.routed[i], experts.location[i], strict=True):
                    counts[where] += count
            totals = self.expert_routed_by_layer.setdefault(layer, [0] * len(EXPERT_SOURCES))
            for source, count in enumerate(counts):
                totals[source] += count
                self.expert_routed_total[EXPERT_SOURCES[source]] += count

    def on_request_finished(self, record: RequestRecord) -> None:
        """Count a request that ended (once each), free its slot, and observe its sizes and times.

        Its prompt counts in `prompt_tokens_total` once read, that is once it made a token (as in vLLM).
        """
        self._ended[record.request_id] = None
        if len(self._ended) > FORGET_AFTER:
            del self._ended[next(iter(self._ended))]
        freed = [index for index, slot in self.slots.items() if slot.request_id == record.request_id]
        for index in freed:
            del self.slots[index]
        if not freed and not record.token_times and record.finish_reason == "abort":
            self.waiting = max(0, self.waiting - 1)  # it left the queue
        if not self.slots:
            self._idle()
        reason = record.finish_reason if record.finish_reason in FINISH_REASONS else "error"
        self.request_success_total[reason] += 1
        self.generation_tokens_total += record.generation_tokens
        self.request_prompt_tokens.observe(record.prompt_tokens)
        self.request_generation_tokens.observe(record.generation_tokens)
        self.request_max_num_generation_tokens.observe(record.generation_tokens)
        self.request_params_n.observe(record.n)
        self.request_params_max_tokens.observe(record.max_tokens)
        finished = record.finished or time.time()
        scheduled = record.scheduled or finished
        self.e2e_latency.observe(finished - record.arrival)
        self.queue_time.observe(scheduled - record.arrival)
        if record.first_token is None:
            return
        self.prompt_tokens_total += record.prompt_tokens
        first, last = record.first_token, record.token_times[-1]
        self.time_to_first_token.observe(first - record.arrival)
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last - first)
        self.inference_time.observe(last - scheduled)
        for before, after in zip(record.token_times, record.token_times[1:], strict=False):
            self.inter_token_latency.observe(after - before)
        if record.generation_tokens > 1:
            self.time_per_output_token.observe((last - first) / (record.generation_tokens - 1))

    def _idle(self) -> None:
        """No slot is busy: no request holds KV blocks and no token is being made."""
        self.kv_blocks_used = 0
        self.live_tok_s = 0.0
        self._recent.clear()

    def record_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        """Count one HTTP request: its route template, method, status class ("2xx") and duration."""
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()
        self.http_duration.labels(handler, method).observe(seconds)

    def values(self) -> dict[str, Any]:
        """The gauges and counters, keyed by their names after `vllm:` / `strata:`."""
        return {
            "model_name": self.model_name,
            "num_requests_running": len(self.slots),
            "num_requests_waiting": self.waiting,
            "kv_cache_usage_perc": self.kv_blocks_used / max(self.kv_blocks_total, 1),
            "prefix_cache_queries_total": self.prefix_cache_queries_total,
            "prefix_cache_hits_total": self.prefix_cache_hits_total,
            "num_preemptions_total": self.num_preemptions_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "live_tok_s": self.live_tok_s,
            "live_slots": len(self.slots),
            "parallel": self.ready.parallel,
            "window_seconds": self.window_seconds,
            "kv_blocks_used": self.kv_blocks_used,
            "kv_blocks_total": self.kv_blocks_total,
            "windows_total": self.windows_total,
            "windows_replayed_total": self.windows_replayed_total,
            "decode_windows_total": self.decode_windows_total,
            "decode_window_seconds_total": self.decode_window_seconds_total,
            "paced_windows_total": self.paced_windows_total,
            "paced_window_predicted_seconds_total": self.paced_window_predicted_seconds_total,
            "paced_window_seconds_total": self.paced_window_seconds_total,
            "parked_conversations_ram": self.parking.conversations_ram,
            "parked_conversations_disk": self.parking.conversations_disk,
            "parked_bytes_ram": self.parking.bytes_ram,
            "parked_bytes_disk": self.parking.bytes_disk,
            "park_restores_total": self.parking.restores,
            "park_restore_seconds_total": self.parking.restore_seconds,
            "park_copied_bytes_total": self.parking.copied_bytes,
            "kv_vram_block_reads_total": self.kv_vram_block_reads_total,
            "kv_host_block_reads_total": self.kv_host_block_reads_total,
            "kv_blocks_moved_to_device_total": self.kv_blocks_moved_to_device_total,
            "kv_blocks_moved_to_host_total": self.kv_blocks_moved_to_host_total,
            "request_success_total": dict(self.request_success_total),
            "expert_routed_total": dict(self.expert_routed_total),
            "expert_swaps_total": self.expert_swaps_total,
            "expert_pcie_bytes_total": self.expert_pcie_bytes_total,
            "expert_adapt_wait_seconds_total": self.expert_adapt_wait_seconds_total,
            "spec_decode_num_drafts_total": self.spec_decode_num_drafts_total,
            "spec_decode_num_draft_tokens_total": self.spec_decode_num_draft_tokens_total,
            "spec_decode_num_accepted_tokens_total": self.spec_decode_num_accepted_tokens_total,
            "spec_decode_num_accepted_tokens_per_pos_total": list(self.spec_decode_accepted_per_pos),
            "stages": [
                {"stage": stage, "busy_seconds_total": busy, "wait_seconds_total": wait}
                for stage, (busy, wait) in enumerate(self.stage_seconds_total)
            ],
            "cache_config_info": {
                "block_size": self.ready.block_size,
                "cache_dtype": "auto",
                "enable_prefix_caching": self.ready.prefix_cache,
                "num_gpu_blocks": self.ready.kv_blocks_total,
            },
            "slots": [self._slot(index) for index in range(self.ready.parallel)],
        }

    def _slot(self, index: int) -> dict[str, Any]:
        slot = self.slots.get(index)
        if slot is None:
            return {
                "slot": index,
                "state": "idle",
                "request_id": None,
                "context_tokens": 0,
                "output_tokens": 0,
                "prompt_tokens": 0,
                "prompt_total": 0,
                "tokens_per_window": 0.0,
                "grammar": False,
            }
        return {
            "slot": index,
            "state": slot.phase,
            "request_id": slot.request_id,
            "context_tokens": slot.context_tokens,
            "output_tokens": slot.output_tokens,
            "prompt_tokens": slot.prompt_tokens,
            "prompt_total": slot.prompt_total,
            "tokens_per_window": self._tokens_per_window(slot),
            "grammar": slot.grammar,
        }

    def snapshot(self) -> dict[str, Any]:
        """`values()` plus each histogram's count and sum: the JSON form of `/metrics`."""
        histograms = {}
        for name, histogram in self._histograms.items():
            samples = {sample.name: sample.value for sample in histogram.collect()[0].samples}
            histograms[name.partition(":")[2]] = {
                "count": int(samples[f"{name}_count"]),
                "sum": samples[f"{name}_sum"],
            }
        return {**self.values(), **histograms}


class _ValuesCollector(Collector):
    """Renders `ServerMetrics.values()` as Prometheus families, labelled with model_name and engine."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """One family per gauge or counter, read from a single `values()` call."""
        values = self.metrics.values()
        base = [self.metrics.model_name, ENGINE]
        for name, kind, documentation in SCALARS:
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(name, documentation, labels=LABELS)
            family.add_metric(base, values[name.partition(":")[2]])
            yield family
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for reason, count in values["request_success_total"].items():
            success.add_metric([*base, reason], count)
        yield success
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for position, count in enumerate(values["spec_decode_num_accepted_tokens_per_pos_total"]):
            per_position.add_metric([*base, str(position)], count)
        yield per_position
        yield from _expert_families(self.metrics, base)
        yield from _stage_families(values["stages"], base)
        if self.metrics.system is not None:
            yield from _system_families(self.metrics.system.latest, base)
        config = {key: str(value) for key, value in values["cache_config_info"].items()}
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=[*LABELS, *config]
        )
        info.add_metric([*base, *config.values()], 1)
        yield info
        for name, key, documentation in SLOT_GAUGES:
            family = GaugeMetricFamily(name, documentation, labels=[*LABELS, "slot"])
            for slot in values["slots"]:
                value = SLOT_STATES[slot[key]] if key == "state" else slot[key]
                family.add_metric([*base, str(slot["slot"])], value)
            yield family


def _stage_families(stages: list[dict[str, Any]], base: list[str]) -> Iterator[Metric]:
    """Per stage of a layer split: seconds it worked on windows, and seconds it waited for them (stage 0:
    for the last stage's answers); nothing without a split."""
    if not stages:
        return
    busy = CounterMetricFamily(
        "strata:stage_busy_seconds",
        "Seconds each stage of the layer split worked on windows (its layers).",
        labels=[*LABELS, "stage"],
    )
    wait = CounterMetricFamily(
        "strata:stage_wait_seconds",
        "Seconds each stage of the layer split waited for windows to reach it (stage 0: for the last "
        "stage's answers).",
        labels=[*LABELS, "stage"],
    )
    for stage in stages:
        busy.add_metric([*base, str(stage["stage"])], stage["busy_seconds_total"])
        wait.add_metric([*base, str(stage["stage"])], stage["wait_seconds_total"])
    yield busy
    yield wait


def _expert_families(metrics: ServerMetrics, base: list[str]) -> Iterator[Metric]:
    """Per MoE layer: routed entries by where they ran, experts on the device, the busiest expert's share of
    the layer's recent routing; per (layer, expert) with `per_expert`: on the device or not, and its share."""
    routed = CounterMetricFamily(
        "strata:expert_routed",
        "Routed expert entries (a token's pick of an expert) of each MoE layer by where they ran: vram (an "
        "expert in device memory), pcie (copied over for the window), cpu (run in host RAM).",
        labels=[*LABELS, "layer", "source"],
    )
    for layer, counts in sorted(metrics.expert_routed_by_layer.items()):
        for source, count in zip(EXPERT_SOURCES, counts, strict=True):
            routed.add_metric([*base, str(layer), source], count)
    yield routed
    latest, shares = metrics.heat.snapshot()
    if latest is None:
        return
    resident = GaugeMetricFamily(
        "strata:expert_resident", "Experts of each MoE layer in device memory.", labels=[*LABELS, "layer"]
    )
    hottest = GaugeMetricFamily(
        "strata:expert_heat_max_share",
        "The busiest expert's share of its MoE layer's routing over the last 10 s.",
        labels=[*LABELS, "layer"],
    )
    for layer, where, layer_shares in zip(latest.layers, latest.location, shares, strict=True):
        resident.add_metric([*base, str(layer)], where.count(0))
        hottest.add_metric([*base, str(layer)], max(layer_shares, default=0.0))
    yield resident
    yield hottest
    if not metrics.per_expert:
        return
    on_device = GaugeMetricFamily(
        "strata:expert_on_device",
        "1 for an expert in device memory, 0 in host RAM.",
        labels=[*LABELS, "layer", "expert"],
    )
    heat = GaugeMetricFamily(
        "strata:expert_heat_share",
        "The expert's share of its MoE layer's routing over the last 10 s.",
        labels=[*LABELS, "layer", "expert"],
    )
    for layer, where, layer_shares in zip(latest.layers, latest.location, shares, strict=True):
        for expert, (place, share) in enumerate(zip(where, layer_shares, strict=True)):
            labels = [*base, str(layer), str(expert)]
            on_device.add_metric(labels, 1 if place == 0 else 0)
            heat.add_metric(labels, share)
    yield on_device
    yield heat


def _system_families(sample: dict[str, Any], base: list[str]) -> Iterator[Metric]:
    """The host's CPU and RAM, the server's and the engine's resident memory, and one series per NVIDIA card
    and figure (none without cards), from the system sampler's latest sample (nothing before the first)."""
    host = sample.get("host")
    if host:
        for name, value, documentation in (
            ("strata:host_cpu_ratio", host["cpu_percent"] / 100, "Share of the host's CPU time in use."),
            ("strata:host_memory_used_bytes", host["ram_used"], "Host RAM in use (total minus available)."),
            ("strata:host_memory_total_bytes", host["ram_total"], "Host RAM in all."),
        ):
            family = GaugeMetricFamily(name, documentation, labels=LABELS)
            family.add_metric(base, value)
            yield family
        resident = GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory size in bytes.", labels=[*LABELS, "process"]
        )
        for process in ("server", "engine"):
            if host.get(f"{process}_rss") is not None:
                resident.add_metric([*base, process], host[f"{process}_rss"])
        yield resident
    cards = (sample.get("gpus") or {}).get("cards") or []
    if not cards:
        return
    for name, key, scale, documentation in GPU_GAUGES:
        family = GaugeMetricFamily(name, documentation, labels=[*LABELS, "gpu", "name"])
        for card in cards:
            if card[key] is not None:
                family.add_metric([*base, str(card["index"]), card["name"]], card[key] * scale)
        yield family


def _wants_prometheus(output: str | None, accept: str) -> bool:
    """Prometheus text unless `?format=json`, or an Accept header asking for JSON and not for text (a
    scraper's or curl's `*/*`, a browser's and none at all get the text, as from vLLM)."""
    if output is not None:
        return output == "prometheus"
    texts = ("text/plain", "application/openmetrics-text")
    return "application/json" not in accept or any(kind in accept for kind in texts)


@get(
    "/metrics",
    guards=[require_api_key],
    summary="Server metrics: Prometheus text, or JSON when asked for",
    description=(
        "The Prometheus text format 0.0.4 with vLLM's metric names (`vllm:*`, labels `model_name` and "
        "`engine`), `strata:*` for the server's own values and `http_*` for the HTTP API, as scrapers, "
        "curl and browsers get it. With `?format=json`, or an Accept header naming `application/json` and "
        "neither `text/plain` nor `application/openmetrics-text`, it is one JSON object holding the same "
        "gauges and counters, keyed by their names without the prefix, the state of every slot under "
        "`slots`, and each histogram's `count` and `sum`."
    ),
)
async def metrics_route(
    request: Request,
    output: Annotated[
        Literal["prometheus", "json"] | None,
        QueryParameter(name="format", description="prometheus or json; default: by the Accept header, text"),
    ] = None,
) -> Response:
    """Prometheus exposition or JSON snapshot of the server's metrics. With a series per expert the text
    (tens of thousands of lines) is rendered in a worker thread, so a scrape does not hold the event loop."""
    metrics: ServerMetrics | None = getattr(request.app.state, "metrics", None)
    if metrics is None:
        raise not_loaded(request.app.state.loading)
    if _wants_prometheus(output, request.headers.get("accept", "")):
        if metrics.per_expert:
            return Response(
                await asyncio.to_thread(generate_latest, metrics.registry), media_type=PROMETHEUS_TEXT
            )
        return Response(generate_latest(metrics.registry), media_type=PROMETHEUS_TEXT)
    return Response(metrics.snapshot(), media_type=MediaType.JSON)


class HttpMetricsMiddleware(ASGIMiddleware):
    """Times every HTTP request and counts it in `app.state.metrics` by route template, method and status."""

    scopes = (ScopeType.HTTP,)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        """Pass the request on, note the status it answers with, and record it once it is done."""
        started = time.perf_counter()
        status = 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await next_app(scope, receive, send_noting_status)
        finally:
            metrics: ServerMetrics | None = getattr(scope["app"].state, "metrics", None)
            if metrics is not None:
                seconds = time.perf_counter() - started
                metrics.record_http(scope["path_template"], scope["method"], status, seconds)


http_metrics_middleware = HttpMetricsMiddleware()
