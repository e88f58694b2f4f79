"""The per-row sampler: penalties, temperature, top-k/top-p/min-p, seeded draws and logprobs, in pure torch.

Order (as vLLM): logprobs from the raw logits; then repetition, presence and frequency penalties; then a
grammar's mask (app/engine/grammar.py) on the rows that have one; then greedy
argmax for temperature 0, or softmax(logits / temperature) filtered by top_k, top_p and min_p, renormalised,
and drawn with the exponential race argmax(probs / E), E ~ Exp(1). A seeded row takes E from its own CPU
generator seeded with `mix_seed(seed, position)`, so its token depends only on (seed, position, its logits),
whatever the batch around it; unseeded rows share the engine-wide generator. This is the reference that
faster kernels are checked against: it favours plain code over speed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.engine.grammar import TokenMask
from app.engine.protocol import PositionLogprobs, SamplingParams, TokenLogprob
from app.engine.transfer import device_tensor, to_device

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class RowSampling:
    """What the sampler needs to know about one row of logits.

    `position` is the index of the token being sampled within its sequence (the number of tokens before it);
    `output_token_ids` are the tokens generated so far, not including the one being sampled.
    """

    params: SamplingParams
    position: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass
class SampleResult:
    """One sampled token per row, and its logprobs where the row asked for them (None otherwise)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]
    wait_s: float = 0.0  # how long reading the tokens back waited for the device


@dataclass
class DrawnTokens:
    """Tokens drawn on the device and not yet read back: `tokens` [rows], and for the rows that asked for
    logprobs (a width in `logprob_widths`, None elsewhere), the chosen and top ones (`values` [asking,
    1 + width], `top_ids` [asking, width]).

    `to_host` queues their copy to host memory behind the work that computes them, so the host can go on
    planning the next window; `read` waits for that copy and returns the lists.
    """

    tokens: torch.Tensor
    logprob_widths: list[int | None]
    values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    _host: tuple[torch.Tensor, ...] | None = None
    _copied: torch.cuda.Event | None = None

    def to_host(self) -> None:
        """Queue the copy of everything `read` returns to (pinned) host memory."""
        if self._host is not None:
            return
        parts = [self.tokens] if self.top_ids is None else [self.tokens, self.top_ids.flatten()]
        ids = torch.cat(parts) if len(parts) > 1 else parts[0]
        device_parts = (ids,) if self.values is None else (ids, self.values)
        if ids.device.type != "cuda":
            self._host = device_parts
            return
        self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device_parts)
        for host, device in zip(self._host, device_parts, strict=True):
            host.copy_(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def read(self) -> SampleResult:
        """The drawn tokens and logprobs as lists, once the device has computed and copied them."""
        self.to_host()
        assert self._host is not None
        began = time.perf_counter()
        if self._copied is not None:
            self._copied.synchronize()
        wait_s = time.perf_counter() - began
        rows = len(self.logprob_widths)
        ids = self._host[0].tolist()
        token_ids, top_flat = ids[:rows], ids[rows:]
        logprobs: list[PositionLogprobs | None] = [None] * rows
        if self.values is not None:
            values = self._host[1].tolist()
            width = self.values.shape[1] - 1
            wanted = [i for i, n in enumerate(self.logprob_widths) if n is not None]
            for j, i in enumerate(wanted):
                n = self.logprob_widths[i]
                assert n is not None
                top = top_flat[j * width : j * width + n]
                logprobs[i] = PositionLogprobs(
                    chosen=TokenLogprob(token_ids[i], values[j][0]),
                    top=[TokenLogprob(t, v) for t, v in zip(top, values[j][1 : n + 1], strict=True)],
                )
        return SampleResult(token_ids, logprobs, wait_s)


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser of x + golden gamma: a bijection of 64-bit integers."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded row: splitmix64(splitmix64(seed) ^ position), masked to 63 bits.

    Seed and position are taken modulo 2**64, so negative and large seeds are accepted.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) & _MASK63


def seeded_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """A seeded row's Exp(1) noise over the whole vocabulary: fp32 on CPU, from `mix_seed(seed, position)`."""
    generator = torch.Generator().manual_seed(mix_seed(seed, position))
    return torch.empty(vocab_size, dtype=torch.float32).exponential_(generator=generator)


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row indices as a tensor on `device`."""
    return device_tensor(rows, torch.long, device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """The logits after each row's repetition, presence and frequency penalties; `logits` stays unchanged.

    Repetition (HF): each distinct token of prompt and output has its logit divided by the penalty when
    positive, multiplied by it otherwise. Then presence and frequency (OpenAI): each token generated `count`
    times loses presence + frequency * count. Returns `logits` itself when no row has a penalty.
    """
    penalised = [
        i
        for i, row in enumerate(rows)
        if row.params.repetition_penalty != 1.0
        or (row.output_token_ids and (row.params.presence_penalty or row.params.frequency_penalty))
    ]
    if not penalised:
        return logits
    out = logits.clone()
    for i in penalised:
        row, params = rows[i], rows[i].params
        if params.repetition_penalty != 1.0:
            seen = sorted({*row.prompt_token_ids, *row.output_token_ids})
            if seen:
                ids = _index(seen, out.device)
                values = out[i, ids]
                penalty = params.repetition_penalty
                out[i, ids] = torch.where(values > 0, values / penalty, values * penalty)
        if row.output_token_ids and (params.presence_penalty or params.frequency_penalty):
            counts = Counter(row.output_token_ids)
            ids = _index(list(counts), out.device)
            n = device_tensor(list(counts.values()), out.dtype, out.device)
            out[i, ids] = out[i, ids] - (params.presence_penalty + params.frequency_penalty * n)
    return out


def _filter(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Rows of probabilities cut by top_k, then top_p (on the top-k renormalised), then min_p; renormalised.

    top_k keeps every token at least as likely as the k-th most likely (ties at the boundary stay); top_p
    keeps the shortest prefix, in descending order with ties by lower id, whose sum reaches top_p; min_p drops
    tokens below min_p times the most likely. The most likely token always stays.
    """
    vocab = probs.shape[1]
    device, dtype = probs.device, probs.dtype
    k = _index([min(p.top_k, vocab) or vocab for p in params], device)[:, None]
    top_p = device_tensor([p.top_p for p in params], dtype, device)[:, None]
    min_p = device_tensor([p.min_p for p in params], dtype, device)[:, None]

    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    ordered = ordered.masked_fill(ordered < ordered.gather(1, k - 1), 0.0)
    ordered = ordered / ordered.sum(-1, keepdim=True)
    before = torch.cat([torch.zeros_like(ordered[:, :1]), ordered.cumsum(-1)[:, :-1]], dim=1)
    ordered = ordered.masked_fill((before >= top_p) & (top_p < 1), 0.0)
    ordered = ordered.masked_fill(ordered < min_p * ordered[:, :1], 0.0)
    kept = torch.zeros_like(probs).scatter_(1, order, ordered)
    return kept / kept.sum(-1, keepdim=True)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row draws from: softmax(logits / temperature), cut by top_k, top_p and min_p.

    `logits` are the penalised logits of rows that sample (every temperature > 0). A row with no cut gets the
    plain softmax; a row with any cut gets the renormalised remainder, computed from its own values only.
    """
    if any(p.greedy for p in params):
        raise ValueError("sampling_probs takes only rows with temperature > 0")
    temperature = device_tensor([p.temperature for p in params], logits.dtype, logits.device)
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature[:, None], dim=-1)
    cut = [i for i, p in enumerate(params) if p.top_k or p.top_p < 1 or p.min_p > 0]
    if cut:
        idx = _index(cut, logits.device)
        probs[idx] = _filter(probs[idx], [params[i] for i in cut])
    return probs


class Sampler:
    """Picks one token per row of logits and reports logprobs; see the module docstring for the order."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows on `device` (one per device, seeded with the engine seed)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _draw(self, probs: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
        """One token per row by the exponential race argmax(probs / E), E from the row's generator."""
        vocab, device = probs.shape[1], probs.device
        noise = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(rows) if row.params.seed is None]
        seeded = [i for i, row in enumerate(rows) if row.params.seed is not None]
        if unseeded:
            draws = torch.empty((len(unseeded), vocab), dtype=probs.dtype, device=device)
            noise[_index(unseeded, device)] = draws.exponential_(generator=self._generator(device))
        if seeded:
            draws = torch.stack([seeded_noise(rows[i].params.seed, rows[i].position, vocab) for i in seeded])
            noise[_index(seeded, device)] = to_device(draws, device).to(probs.dtype)
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[RowSampling], mask: TokenMask | None = None
    ) -> SampleResult:
        """Sample one token for each row of `logits` ([rows, vocab]) under that row's parameters."""
        return self.sample(logits, rows, mask).read()

    def sample(
        self, logits: torch.Tensor, rows: Sequence[RowSampling], mask: TokenMask | None = None
    ) -> DrawnTokens:
        """Draw one token for each row of `logits` ([rows, vocab]) on their device, without waiting for it;
        rows under a grammar (`mask`) draw only tokens it allows (their logprobs stay the model's)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows")
        logits = logits.float()
        device = logits.device
        processed = apply_penalties(logits, rows)
        if mask is not None:
            processed = mask.apply(processed)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):
            return _drawn(logits, processed.argmax(-1), rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=device)
        if greedy:
            idx = _index(greedy, device)
            tokens[idx] = processed[idx].argmax(-1)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        idx = _index(sampled, device)
        probs = sampling_probs(processed[idx], [rows[i].params for i in sampled])
        tokens[idx] = self._draw(probs, [rows[i] for i in sampled])
        return _drawn(logits, tokens, rows)


def _drawn(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[RowSampling]) -> DrawnTokens:
    """The drawn tokens and, for rows that asked, the chosen and top logprobs under log_softmax of the raw
    logits (the widest request's width for every such row)."""
    widths = [row.params.logprobs for row in rows]
    wanted = [i for i, n in enumerate(widths) if n is not None]
    if not wanted:
        return DrawnTokens(tokens, widths)
    idx = _index(wanted, logits.device)
    logp = torch.log_softmax(logits[idx], dim=-1)
    width = min(max(widths[i] or 0 for i in wanted), logits.shape[1])
    top_values, top_ids = logp.topk(width, dim=-1)
    chosen = logp.gather(1, tokens[idx, None])
    return DrawnTokens(
        tokens,
        [None if n is None else min(n, width) for n in widths],
        torch.cat([chosen, top_values], dim=1),
        top_ids,
    )
