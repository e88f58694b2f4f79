"""The scheduler: requests, batch slots, the KV pool's blocks, and what each window runs. Imports no torch.

Each window: decode rows first (one token per decoding slot), then prompt chunks of partially read requests
and of waiting requests, FIFO, within the window's token budget. While slots are decoding, the prompt budget
is cut so that decoding slots keep decode_share of their solo speed (docs/BATCHING.md): a window lasts at most
1 / decode_share times a decode-only window, plus what earlier windows left unused while prompts waited.
A request whose prompt is read while others' prompts still wait holds its decoding (up to HOLD_S, or two
full windows of prompt rows where those take longer) until they are read: a burst's first tokens come
together, and the slots that were decoding before it keep their share of their own speed, not of the speed
of a window that the burst's early readers fill.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from app.engine.blocks import ROOT, BlockPool, Donor
from app.engine.drafts import DraftSource, NgramDrafter
from app.engine.prefix_cache import PrefixHit, StateCheckpoints
from app.engine.protocol import SamplingParams
from app.engine.window_cost import DecodeWindowCost, WindowCost, chunk_pairs

UNCALIBRATED_CHUNK = 256
HOLD_S = 1.0  # the longest a request whose prompt was read waits for others' prompts before it decodes ...
# ... or, where a window of prompt rows takes longer (an expert tier copying its host experts for each), this
# many full-budget windows: the one that read it and the next, which reads what arrived while it ran
HOLD_WINDOWS = 2
# Windows are planned for the share asked raised by this fraction of itself (0.5: 0.56): their costs are
# predictions, and the overrun of a read's last window is never paid back (the credit is dropped once no
# prompt waits). Relative, so that a tiny share asked (prompts read nearly at once) stays tiny.
SHARE_MARGIN = 0.12
PARK_MIN_GAIN = 256  # tokens a parked conversation must reach beyond the device's prefix cache to be restored


def placeholder(row: int) -> int:
    """The stand-in for a token not yet read from the device: the one drawn in row `row` of the window
    launched last. Token ids are never negative; a window feeds such a token from the device (runner.py)."""
    return -1 - row


def placeholder_row(token: int) -> int:
    """The row of the last launched window whose drawn token the placeholder `token` stands for."""
    return -1 - token


class Phase(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    PROMPT = "prompt"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its progress.

    `computed` counts the tokens (prompt, then generated) held in the model state; the tokens after it are
    what the next window feeds. A request preempted for lack of KV blocks starts again from 0 and reads its
    prompt plus what it generated; seeded and greedy sampling make that exact. The newest token of `output`
    may be a `placeholder` while the window that draws it runs: the next window can feed it all the same.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    output: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    finish_reason: str | None = None
    admitted_order: int = 0
    cached_blocks: int = 0  # blocks of `blocks` registered in the prefix cache, the last under `chain_key`
    chain_key: bytes = ROOT
    park_missed: bool = False  # no parked conversation continued it when it was first looked up
    placed: int = 0  # blocks of `blocks` that `_place` has looked at (on the device, moved there, or shared)
    lend_from: int = 0  # while its prompt is read: blocks of `blocks` before this hold none it could lend
    held_since: float | None = None  # its prompt was read while others' waited: it decodes after them
    drafter: DraftSource | None = None  # its draft source, while it drafts
    rollback: int | None = None  # its slot's recurrent state went past `computed`; this draft slot holds it
    matcher: object | None = None  # with a grammar: where its output is in it (app/engine/grammar.py)

    @property
    def length(self) -> int:
        """Prompt and generated tokens so far."""
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + generated, without building the whole sequence."""
        split = len(self.prompt)
        if end <= split:
            return self.prompt[start:end]
        if start >= split:
            return self.output[start - split : end - split]
        return self.prompt[start:] + self.output[: end - split]

    @property
    def pending(self) -> int:
        """Tokens not yet in the model state."""
        return self.length - self.computed

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens, as one list."""
        return self.prompt + self.output


@dataclass(frozen=True)
class Chunk:
    """One request's rows in a window: `tokens` continuing `past` tokens of state in `slot`.

    `samples` is True when the chunk ends at the request's newest token, so its last row yields the next
    token; `fresh` when the slot's recurrent state must start empty; `decode` for a decode row (a token the
    request just generated), as opposed to prompt (or re-read context) tokens; `save` (position, checkpoint
    slot) when the recurrent state inside the chunk is checkpointed on the way. A decode chunk's last
    `drafts` tokens are guesses (app/engine/drafts.py): it samples at its last 1 + `drafts` rows. On a model
    with recurrent state its rows are read one at a time and `step_saves` holds a state slot for each row
    before the last (-1 for rows before the newest token, a draft slot from it on): the state after the
    newest token and j guesses is kept in a draft slot, where the request continues from if guess j + 1 is
    wrong.
    """

    request: Request
    slot: int
    tokens: list[int]
    past: int
    samples: bool
    fresh: bool
    decode: bool
    save: tuple[int, int] | None = None
    drafts: int = 0
    step_saves: tuple[int, ...] = ()

    @property
    def stepwise(self) -> bool:
        """A decode chunk of more than one row (draft tokens being verified), whose rows recurrent layers
        read one at a time, as one token a window would be."""
        return self.decode and len(self.tokens) > 1

    @property
    def sampled_rows(self) -> int:
        """Rows the chunk samples at: its last 1 + `drafts`, or none."""
        return 1 + self.drafts if self.samples else 0


@dataclass
class Window:
    """What one forward pass runs, decode rows first, and the state copies to make before it.

    Before the forward, in this order: `saves` copy a slot's recurrent state into a checkpoint slot (for a
    request that finished, or read a piece of its prompt, in an earlier window), `block_copies` copy a KV
    block into another, `restores` copy a checkpoint into a slot (a request continuing from it).
    `cache_queries` / `cache_hits`: prompt tokens of the requests admitted, and how many came from the cache.
    `unparks`: (parked conversation, slot, block table) to copy back from the host, after the restores.
    `charged`: the seconds the decoding slots' credit was charged for the window when it was planned;
    `observed`: the seconds it took, as `observe` learned them.
    `paced`: the decode rows whose speed set its prompt rows' time budget: its own, or with slot groups those
    of another group that it holds up in the stages where more (a window of no decode rows of its own then
    spends their credit). `beside_prompts`: with slot groups, planned while a prompt was being read or waited
    (its decode rows then shared the stages with prompt rows: what it took says nothing of their solo cost).
    `moved`: KV blocks its requests' blocks copied (to the device, to host RAM) in `block_copies` (`_place`).
    """

    chunks: list[Chunk]
    preempted: int = 0
    saves: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    cache_queries: int = 0
    cache_hits: int = 0
    unparks: list[tuple[object, int, list[int]]] = field(default_factory=list)
    charged: float | None = None
    observed: float | None = None
    paced: int = 0
    beside_prompts: bool = False
    moved: tuple[int, int] = (0, 0)

    @property
    def prompt_tokens(self) -> int:
        """Rows that read prompt (or preempted context) tokens."""
        return sum(len(c.tokens) for c in self.chunks if not c.decode)

    @property
    def decode_tokens(self) -> int:
        """Rows that feed a just-generated token."""
        return sum(len(c.tokens) for c in self.chunks if c.decode)


@dataclass(frozen=True)
class SchedulerConfig:
    """Slots, window budget, KV pool size and the decode-share target.

    `prompt_align`: a prompt chunk that stops before the request's newest token stops at a multiple of this
    many tokens of the sequence (models whose layers read prompts in fixed chunks compute a prompt exactly
    the same whichever windows it is read in only if its pieces end on their chunk boundaries).
    `prefix_cache`: requests continue from cached blocks; on a model with `recurrent` state only where a
    checkpoint was saved, in one of the state pools' `checkpoint_slots` (app/engine/prefix_cache.py).
    `window_rows`: the row counts (ascending) that windows with prompt rows are padded to when they replay a
    captured graph; such a window costs what its padded rows cost, so prompt chunks fill the padding.
    `groups`: the slots form this many groups (slot s in group s % groups) and a window holds the rows of
    one group only, so that the stages of a layer split each run another group's window (pipelined groups).
    `spec_tokens`: draft tokens a decoding request adds to its row (a request's `spec_tokens` overrides
    it), up to what `max_length` (tokens a request may hold) and its max_tokens leave. With `recurrent`
    state, slot s drafts only with draft slots, as many guesses a window as it has (`draft_slots` holds
    the same number for each slot, slot s's after slot s - 1's): the state slots that keep the state after
    each verified row but the last, one of which is restored when a guess was wrong (the window's later
    rows moved the slot's own state on).
    `kv_on_device`: KV blocks numbered from this on live in host RAM (`--kv-resident`); a window moves up to
    `kv_place_blocks` of its requests' blocks from there onto the device where the device has a block free
    or only cached (`BlockPool.place`).
    """

    parallel: int
    max_batched_tokens: int
    block_size: int
    kv_blocks: int
    decode_share: float = 0.5
    prompt_align: int = 1
    prefix_cache: bool = False
    checkpoint_slots: tuple[int, ...] = ()
    recurrent: bool = False
    window_rows: tuple[int, ...] = ()
    groups: int = 1
    spec_tokens: int = 0
    max_length: int = 1 << 62
    draft_slots: tuple[int, ...] = ()
    kv_on_device: int | None = None
    kv_place_blocks: int = 0


class ParkedStore(Protocol):
    """Conversations parked off the device (app/engine/parking.py), as the scheduler sees them."""

    def ready(self, tokens: list[int], limit: int) -> bool:
        """False while what `find` would give for `tokens[:limit]` is still being read from disk."""
        ...

    def find(self, tokens: list[int], limit: int) -> tuple[int, object] | None:
        """The longest parked state that `tokens[:limit]` continues: (its length, a handle), or None; it does
        no I/O."""
        ...


class Scheduler:
    """Admits requests into slots, plans windows, and frees what finished requests held.

    With a `parked` store, a request being admitted continues from a parked conversation when that reaches
    further than the device's prefix cache.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        parked: ParkedStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.parked = parked
        self.pool = BlockPool(config.kv_blocks, config.block_size, caching=config.prefix_cache)
        if config.kv_on_device is not None:
            self.pool.on_device = config.kv_on_device
        self.checkpoints: StateCheckpoints | None = None
        if config.prefix_cache and config.recurrent:
            self.checkpoints = StateCheckpoints(self.pool, list(config.checkpoint_slots))
        self._saves: list[tuple[int, int]] = []  # (slot, checkpoint slot) to copy before the next forward
        self.cost = WindowCost()
        self.decode_cost = DecodeWindowCost()
        self.credit = 0.0  # seconds decoding slots are ahead of their share while prompts wait (may be < 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.free_slots = list(range(config.parallel - 1, -1, -1))
        self.requests: dict[str, Request] = {}
        self._admissions = 0
        self._turn = 0  # the group whose turn it is to be planned next

    def add(self, request: Request) -> None:
        """Queue a request; it is never refused for being busy."""
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def planned_share(self) -> float:
        """The share windows are planned for: `decode_share` and SHARE_MARGIN (1 when not sharing)."""
        share = self.config.decode_share
        return share if share >= 1 else min(1.0, share * (1 + SHARE_MARGIN))

    def has_work(self) -> bool:
        """Any request waiting or running."""
        return bool(self.waiting or self.running)

    def capacity_tokens(self) -> int:
        """The most tokens one request can hold: the whole KV pool."""
        return self.pool.total * self.pool.block_size

    def group_of(self, slot: int) -> int:
        """The group of a slot (`SchedulerConfig.groups`)."""
        return slot % self.config.groups

    def schedule(self, busy: frozenset[int] = frozenset(), place: bool = True) -> Window:
        """Plan the next window: of the next group in turn that has work and is not `busy` (a window of it
        still runs), or an empty one. With `place`, its requests' blocks in host RAM move onto the device
        where blocks there are free or only cached (`_place`); the caller leaves it off while something
        launched before may still write the requests' blocks after this window's copies."""
        window = Window(chunks=[])
        group = self._pick_group(busy)
        if group is None:
            return window
        budget = self.config.max_batched_tokens
        reading = self._prompts_pending()
        hold = self.hold_limit() if reading else 0.0
        ours = [r for r in self.running if self.group_of(r.slot) == group]  # type: ignore[arg-type]
        for request in [r for r in ours if r.phase is Phase.DECODE]:
            if request.phase is not Phase.DECODE:
                continue  # preempted while making room for an earlier row
            if self._held(request, hold):
                continue
            if len(request.output) >= request.params.max_tokens:
                continue  # its last token is still being drawn: it ends when that is read
            take = request.pending
            while not self.pool.grow(request.blocks, request.computed + take):
                victim = next(r for r in reversed(ours) if r.phase is not Phase.WAITING)  # still running
                self._preempt(victim)
                window.preempted += 1
                if victim is request:
                    break
            if request.phase is Phase.DECODE:
                if request.rollback is not None:
                    assert request.slot is not None
                    window.restores.append((request.rollback, request.slot))
                    request.rollback = None
                chunk = self._with_drafts(self._chunk(request, take))
                window.chunks.append(chunk)
                budget -= len(chunk.tokens)
        reading = [r for r in ours if r.phase is Phase.PROMPT]
        window.paced = paced = max(len(window.chunks), self._decoding_beside(group))
        window.beside_prompts = self.config.groups > 1 and self._prompts_pending()
        share = _Share(self, len(window.chunks), budget, paced, reading[0].computed if reading else 0)
        for request in reading:
            take = share.take(request.pending, request.computed)
            if take <= 0:
                break
            window.chunks.append(self._with_checkpoint(self._chunk(request, take)))
        while self.waiting and self._free_slot(group) is not None and share.tokens > 0:
            request = self.waiting[0]
            if not self._park_ready(request):
                break  # its parked conversation is being read from disk: the slots that run go on
            hit = self._prefix_hit(request)
            start = hit.position if hit else 0
            unpark = self._parked_hit(request, start)
            if unpark is not None:
                hit, start = None, unpark[0]
            # The share first: a prompt it keeps waiting takes no blocks (a long one's table would be grown
            # and released every window, evicting cached blocks to make room for nothing).
            take = share.take(request.length - start, start)
            if take <= 0:
                break
            if hit:
                self.pool.take(request.blocks, hit.blocks)
            if not self.pool.grow(request.blocks, request.length + 1):
                self.pool.release(request.blocks)
                break
            self.waiting.popleft()
            self._admit(request, group)
            request.computed = start
            if hit:
                self._continue(window, request, hit)
            if unpark is not None:
                assert request.slot is not None
                window.unparks.append((unpark[1], request.slot, request.blocks))
            if self.pool.caching:
                window.cache_queries += request.length
                window.cache_hits += start
            window.chunks.append(self._with_checkpoint(self._chunk(request, take)))
        if window.chunks:
            window.saves, self._saves = self._saves, []
            if place:
                self._place(window)
        window.charged = self._charge(window)
        return window

    def _place(self, window: Window) -> None:
        """Move the window's requests' blocks that live in host RAM onto the device, decoding requests first
        (a window's other block copies are made first, so a continued request's tail block moves with its
        tail; an unparked request's blocks are filled after the copies, wherever they are; a window still in
        flight may have written drafts beyond a request's computed tokens, which move too).

        Block copies are bounded by `kv_place_blocks`, or by twice the blocks the requests have that were not
        looked at yet where that is more: the window would read those over the link anyway, so moving them
        and the cached blocks they displace costs it at most two such reads, once, and every later window
        reads them from the device.

        Where the device has no block free or only cached, requests reading their prompts lend theirs to the
        decoding requests (`Donor`): a decoding request's every window reads all its blocks, and one that
        reads any in host RAM runs eagerly, not from its graph, while a long prompt read beside it reads its
        earlier blocks once a chunk, streamed anyway once it passes what the device holds."""
        if self.pool.on_device >= self.pool.total or self.config.kv_place_blocks <= 0:
            return
        requests = list(dict.fromkeys(c.request for c in window.chunks))
        most = max(self.config.kv_place_blocks, 2 * sum(len(r.blocks) - r.placed for r in requests))
        unparked = {id(blocks) for _, _, blocks in window.unparks}
        size, moves, before = self.pool.block_size, window.block_copies, len(window.block_copies)

        def content(request: Request) -> int:
            written = request.computed + self.spec_tokens(request)
            return 0 if id(request.blocks) in unparked else -(-written // size)

        decoding = any(r.phase is Phase.DECODE for r in requests)  # only decoding requests borrow
        reading = [r for r in self.running if r.phase is Phase.PROMPT] if decoding else []
        stamps = [self.pool.stamp_of(r.blocks) for r in reading]
        donors = [Donor(r.blocks, content(r), r.lend_from) for r in reading]
        moved_in: list[Request] = []  # prompts whose own blocks moved onto the device: some may be lent again
        for request in requests:
            lending = donors if request.phase is Phase.DECODE else ()
            own = self.pool.stamp_of(request.blocks)
            made, request.placed = self.pool.place(
                request.blocks, content(request), most, moves, request.placed, lending
            )
            if request.phase is Phase.PROMPT and self.pool.stamp_of(request.blocks) != own:
                moved_in.append(request)
            most -= made
            if most <= 0:
                break
        for lender, stamp, donor in zip(reading, stamps, donors, strict=True):
            lender.lend_from = donor.start
            if self.pool.stamp_of(lender.blocks) != stamp:
                lender.placed = 0  # its lent blocks come back once the device has room
        for request in moved_in:
            request.lend_from = 0
        to_device = sum(target < self.pool.on_device for _, target in moves[before:])
        window.moved = (to_device, len(moves) - before - to_device)

    def _pick_group(self, busy: frozenset[int]) -> int | None:
        """The group to plan: the first from the one whose turn it is that is not busy and has a request or a
        free slot for a waiting one; None when every group is busy or idle."""
        groups = self.config.groups
        for group in ((self._turn + i) % groups for i in range(groups)):
            if group in busy:
                continue
            waiting = bool(self.waiting) and self._free_slot(group) is not None
            if groups == 1 or waiting or any(self.group_of(r.slot) == group for r in self.running):  # type: ignore[arg-type]
                self._turn = (group + 1) % groups
                return group
        return None

    def _decoding_beside(self, group: int) -> int:
        """The most requests decoding in one of the other slot groups: a window of this group holds up
        theirs in the stages, so its prompt rows are paced by them too."""
        if self.config.groups == 1:
            return 0
        counts = [0] * self.config.groups
        for r in self.running:
            if r.phase is Phase.DECODE and r.slot is not None and self.group_of(r.slot) != group:
                counts[self.group_of(r.slot)] += 1
        return max(counts)

    def _free_slot(self, group: int) -> int | None:
        """The free slot of `group` to fill next, or None."""
        return next((s for s in reversed(self.free_slots) if self.group_of(s) == group), None)

    def _prompts_pending(self) -> bool:
        """Whether a prompt is being read or waits with a slot free to be read in."""
        reading = any(r.phase is Phase.PROMPT for r in self.running)
        return reading or bool(self.waiting and self.free_slots)

    def hold_limit(self) -> float:
        """How long a request whose prompt was read while others waited holds its decoding at most: HOLD_S,
        or HOLD_WINDOWS windows of a full token budget of prompt rows at their predicted cost where that is
        longer (a window the hold cannot outlast would leave the burst's early readers decoding beside the
        rest, whose reading their decode share then paces)."""
        if not self.cost.calibrated:
            return HOLD_S
        budget = self.config.max_batched_tokens
        window = self.cost.predict(self.padded(budget), 1, chunk_pairs(budget, 0))
        return max(HOLD_S, HOLD_WINDOWS * window)

    def _held(self, request: Request, hold: float) -> bool:
        """Whether a request whose prompt was read while others waited still holds its decoding: until no
        prompt is pending (`hold` 0) or it has held for `hold` seconds."""
        if request.held_since is None:
            return False
        if self.clock() - request.held_since < hold:
            return True
        request.held_since = None
        return False

    def _prefix_hit(self, request: Request) -> PrefixHit | None:
        """Where a request being admitted can start instead of 0 (at least its last token is read)."""
        if not self.pool.caching:
            return None
        limit = request.length - 1
        if self.checkpoints is not None:
            return self.checkpoints.find(request.tokens, limit)
        blocks = self.pool.match(request.tokens, limit)
        return PrefixHit(blocks=blocks, position=len(blocks) * self.pool.block_size) if blocks else None

    def _park_ready(self, request: Request) -> bool:
        """Whether the park can answer for a request being admitted without reading a file."""
        if self.parked is None or not self.pool.caching or request.park_missed:
            return True
        if request.length - 1 <= PARK_MIN_GAIN:  # nothing parked could take it far enough
            return True
        return self.parked.ready(request.tokens, request.length - 1)

    def _parked_hit(self, request: Request, reached: int) -> tuple[int, object] | None:
        """A parked conversation that takes the request more than PARK_MIN_GAIN tokens beyond `reached`.

        Bringing a conversation back copies all of it, so a device cache that reaches nearly as far wins.
        """
        if self.parked is None or not self.pool.caching or request.length - 1 <= reached + PARK_MIN_GAIN:
            return None
        if request.park_missed:  # a request the share keeps waiting is not looked up again every window
            return None
        found = self.parked.find(request.tokens, request.length - 1)
        request.park_missed = found is None
        return found if found is not None and found[0] > reached + PARK_MIN_GAIN else None

    def _continue(self, window: Window, request: Request, hit: PrefixHit) -> None:
        """Set up an admitted request to continue at its hit: registered blocks, state and tail copies."""
        request.cached_blocks = len(hit.blocks)
        request.chain_key = self.pool.key_of(hit.blocks[-1]) if hit.blocks else ROOT
        checkpoint = hit.checkpoint
        if checkpoint is None:
            return
        assert request.slot is not None
        window.restores.append((checkpoint.slot, request.slot))
        if checkpoint.tail_block is not None:
            window.block_copies.append(
                (checkpoint.tail_block, request.blocks[checkpoint.position // self.pool.block_size])
            )

    def _with_checkpoint(self, chunk: Chunk) -> Chunk:
        """A prompt chunk that ends off a chunk multiple checkpoints the last multiple inside it.

        That is where a later prompt sharing this one's start (a system prompt) can continue on a model with
        recurrent state; the multiples where pieces end are checkpointed after their window anyway.
        """
        align = self.config.prompt_align
        end = chunk.past + len(chunk.tokens)
        inside = (end - 1) // align * align
        if self.checkpoints is None or chunk.decode or end % align == 0 or inside - chunk.past < align:
            return chunk
        checkpoint = self.checkpoints.save(chunk.request.tokens, inside, chunk.request.blocks)
        return chunk if checkpoint is None else replace(chunk, save=(inside, checkpoint.slot))

    def _save_state(self, request: Request) -> None:
        """Checkpoint the recurrent state of a request's slot at its computed position (copied next window).

        Called where the request can be continued: a prompt piece ending on a chunk multiple, or its end.
        """
        source = self.state_slot(request)
        if self.checkpoints is None or source is None or request.computed == 0:
            return
        checkpoint = self.checkpoints.save(request.tokens, request.computed, request.blocks)
        if checkpoint is not None:
            self._saves.append((source, checkpoint.slot))

    def _chunk(self, request: Request, take: int) -> Chunk:
        start = request.computed
        tokens = request.token_slice(start, start + take)
        return Chunk(
            request=request,
            slot=request.slot,
            tokens=tokens,
            past=start,
            samples=take == request.pending,
            fresh=start == 0,
            decode=request.phase is Phase.DECODE,
        )

    def _with_drafts(self, chunk: Chunk) -> Chunk:
        """A decode chunk with the draft tokens its request's drafter guesses, where it drafts, knows its
        newest token (not a placeholder) and has room left, and the KV blocks they need. With recurrent
        state, the window leaves the slot's state after each row but the last in the slot's draft slots
        (`Chunk.step_saves`): where the request continues from if the guess after that row is wrong."""
        request = chunk.request
        params = request.params
        room = min(params.max_tokens - len(request.output), self.config.max_length - request.length) - 1
        k = min(self.spec_tokens(request), room)
        saves: tuple[int, ...] = ()
        if self.config.recurrent:
            assert request.slot is not None
            saves = self._draft_slots(request.slot)
            k = min(k, len(saves))
        if k <= 0 or not request.output or request.output[-1] < 0 or params.grammar is not None:
            return chunk
        if request.drafter is None:
            request.drafter = NgramDrafter()
        drafts = request.drafter.draft(request.tokens, k)
        if not drafts or not self.pool.grow(request.blocks, chunk.past + len(chunk.tokens) + len(drafts)):
            return chunk
        known = (-1,) * (len(chunk.tokens) - 1) if saves else ()  # rows before the newest token keep nothing
        return replace(
            chunk, tokens=chunk.tokens + drafts, drafts=len(drafts), step_saves=known + saves[: len(drafts)]
        )

    def _draft_slots(self, slot: int) -> tuple[int, ...]:
        """The draft slots of batch slot `slot` (none without recurrent state or `--spec`)."""
        each = len(self.config.draft_slots) // self.config.parallel
        return self.config.draft_slots[slot * each : (slot + 1) * each]

    def spec_tokens(self, request: Request) -> int:
        """Draft tokens a request asks for a window: its own `spec_tokens`, else the engine's (0 without
        `--spec`)."""
        own = request.params.spec_tokens
        return self.config.spec_tokens if own is None else own

    def accept(self, chunk: Chunk, taken: int) -> None:
        """A window verified `taken` of a decode chunk's draft tokens as its request's next tokens. Without
        recurrent state they are in the model state (the rows after them hold what no later window reads);
        with it, unless all were right, the state went past them: the request continues from the state the
        window left after its last accepted row, in that row's draft slot, restored before its next window."""
        request = chunk.request
        if self.config.recurrent and taken < chunk.drafts:
            request.rollback = chunk.step_saves[len(chunk.tokens) - chunk.drafts - 1 + taken]
        request.computed += taken
        if self.pool.caching:
            self._commit(request)

    def cut(self, request: Request) -> None:
        """A request ends at its newest token though its state may hold more (draft tokens accepted after
        it): without recurrent state the keys and values past its end are simply not used; with it the
        state cannot be taken back, so nothing of it is kept for a follow-up."""
        if request.computed > request.length:
            request.computed = 0 if self.config.recurrent else request.length

    def state_slot(self, request: Request) -> int | None:
        """The state slot holding a request's recurrent state at `computed` (its draft slot after a
        rollback), or None without a slot."""
        if request.slot is None:
            return None
        return request.slot if request.rollback is None else request.rollback

    def _admit(self, request: Request, group: int) -> None:
        slot = self._free_slot(group)
        assert slot is not None
        self.free_slots.remove(slot)
        request.slot = slot
        request.phase = Phase.PROMPT
        self._admissions += 1
        request.admitted_order = self._admissions
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
        """Free a running request's slot and blocks; it waits at the head of the queue to be read again."""
        self._release(request)
        request.computed = 0
        request.rollback = None
        request.cached_blocks, request.chain_key = 0, ROOT
        request.placed = request.lend_from = 0
        request.phase = Phase.WAITING
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.pool.release(request.blocks)
        if request.slot is not None:
            self.free_slots.append(request.slot)
            request.slot = None
        if request in self.running:
            self.running.remove(request)

    def advance(self, window: Window) -> None:
        """Account for a window that ran: its chunks are now in the state."""
        align = self.config.prompt_align
        read: list[Request] = []
        for chunk in window.chunks:
            request = chunk.request
            request.computed += len(chunk.tokens) - chunk.drafts  # drafts count once verified (`accept`)
            if chunk.samples:
                if request.phase is Phase.PROMPT:
                    read.append(request)
                request.phase = Phase.DECODE
            if self.pool.caching:
                self._commit(request)
                if not chunk.decode and request.computed % align == 0:
                    self._save_state(request)
        if read and self.config.decode_share < 1 and self._prompts_pending():
            now = self.clock()
            for request in read:
                request.held_since = now

    def observe(self, window: Window, seconds: float, replayed: bool = False) -> None:
        """Learn from how long a window took, from planning it to handing out its tokens, and settle the
        decoding slots' credit: what it took beyond the cost it was charged at planning, or below it.

        The window-cost fit describes windows with prompt rows (at their bucket's rows where `replayed`: the
        window replayed a CUDA graph) and learns from them alone: decode-only windows have their own means,
        and where they run eagerly too (a CPU's) the hundreds of them between two prompt windows would wash
        those out of a fit that follows the latest windows. With slot groups a decode-only window planned
        while prompts are read shares the stages with another group's prompt rows, and what it took is the
        read's as much as its own: their means learn only from the others (the share would otherwise follow
        the read: on two stages sharing a core, a slot's decode windows behind 2,048-row prompt windows
        raised its `solo` from 10 to 137 ms, and the read ran nearly unpaced).
        """
        window.observed = seconds
        rows = sum(len(c.tokens) for c in window.chunks)
        decode = window.decode_tokens
        if rows > decode:
            ran = self.padded(rows) if replayed else rows
            self.cost.observe(ran, len(window.chunks), seconds, window_pairs(window.chunks, ran))
        if decode and rows == decode and not window.beside_prompts:
            self.decode_cost.observe(decode, seconds)
        if window.charged is not None:
            self._add_credit(decode or window.paced, window.charged - seconds)
        elif decode and (solo := self.solo_seconds(decode)) is not None:
            self._add_credit(decode, solo / self.planned_share - seconds)

    def _commit(self, request: Request) -> None:
        """Register the request's newly filled blocks in the prefix cache (nothing to do most windows)."""
        size = self.pool.block_size
        full = request.computed // size
        if full <= request.cached_blocks:
            return
        new_tokens = request.token_slice(request.cached_blocks * size, full * size)
        request.cached_blocks, request.chain_key = self.pool.commit(
            request.blocks, new_tokens, request.computed, request.cached_blocks, request.chain_key
        )

    def calibrate(self, windows: list[tuple[int, float]]) -> None:
        """Start the window-cost fit from measured (rows, seconds) of windows with prompt rows (each taken as
        a decode row beside one prompt chunk); the windows that run refine it. Without a start, windows that
        all read the same chunk size beside decoding slots could never tell fixed from per-row costs."""
        for rows, seconds in windows:
            self.cost.observe(rows, 2, seconds, chunk_pairs(rows, 0))

    def padded(self, rows: int) -> int:
        """The rows a window of `rows` rows with prompt rows runs as: its graph bucket, or itself."""
        return next((b for b in self.config.window_rows if b >= rows), rows)

    def fill(self, rows: int) -> int:
        """The most rows a window may hold if it may cost what `rows` rows cost: the largest bucket not
        above `rows` (beyond every bucket a window runs eagerly, at another cost); `rows` without buckets."""
        if not self.config.window_rows:
            return rows
        return max((b for b in self.config.window_rows if b <= rows), default=0)

    def solo_seconds(self, decode_rows: int) -> float | None:
        """Expected seconds of a window of `decode_rows` decode rows alone, None while unknown."""
        solo = self.decode_cost.predict(decode_rows)
        if solo is None and self.cost.calibrated:
            solo = self.cost.predict(decode_rows, decode_rows)
        return solo

    def credit_cap(self, decode_rows: int, allowed: float, past: int | None = None) -> float:
        """The most credit decoding slots may build: what a window with a full token budget costs, its chunk
        read after `past` positions (by default where the furthest prompt being read is)."""
        if not self.cost.calibrated:
            return allowed
        if past is None:
            past = max((r.computed for r in self.running if r.phase is Phase.PROMPT), default=0)
        budget = self.config.max_batched_tokens
        full = self.padded(decode_rows + budget)
        return max(allowed, self.cost.predict(full, decode_rows + 1, chunk_pairs(budget, past)))

    def _predict(self, window: Window) -> float | None:
        """Expected seconds of a planned window (at its bucket's rows), None while unknown."""
        rows = sum(len(c.tokens) for c in window.chunks)
        if rows == window.decode_tokens:
            return self.solo_seconds(rows)
        if not self.cost.calibrated:
            return None
        ran = self.padded(rows)
        return self.cost.predict(ran, len(window.chunks), window_pairs(window.chunks, ran))

    def _charge(self, window: Window) -> float | None:
        """Charge the decoding slots' credit for a window being planned, at its predicted cost (returned).

        Charged now, not when the window has run: the next window is planned while this one runs, and must
        not spend the same credit. A window of prompt rows alone that holds up another slot group's decoding
        slots (`Window.paced`) spends their credit: all it costs comes on top of their own windows. None
        (nothing charged) for a window that holds up no decode rows or of unknown cost.
        """
        decode = window.decode_tokens
        if not decode and window.paced and window.chunks:
            predicted = self._predict(window) if self.solo_seconds(window.paced) is not None else None
            if predicted is not None:
                self._add_credit(window.paced, -predicted)
            return predicted
        solo = self.solo_seconds(decode) if decode else None
        predicted = self._predict(window) if solo is not None else None
        if solo is None or predicted is None:
            return None
        self._add_credit(decode, solo / self.planned_share - predicted)
        return predicted

    def _add_credit(self, decode_rows: int, seconds: float) -> None:
        """Add `seconds` (negative: take) to the decoding slots' credit, kept within -`credit_cap` and
        `credit_cap`, so a window that took longer than predicted is paid back in full by the windows after
        it. Credit builds only while prompts wait to be read; it is dropped when none does."""
        waiting = bool(self.waiting) or any(r.phase is Phase.PROMPT for r in self.running)
        solo = self.solo_seconds(decode_rows) if decode_rows else None
        if solo is None or not waiting:
            self.credit = 0.0
            return
        cap = self.credit_cap(decode_rows, solo / self.planned_share)
        self.credit = min(max(self.credit + seconds, -cap), cap)

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stop, length, abort, error) and free what it held."""
        if request.phase is Phase.FINISHED:
            return
        self._save_state(request)  # where a follow-up turn continues
        request.finish_reason = reason
        request.phase = Phase.FINISHED
        self._release(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.requests.pop(request.request_id, None)


class _Share:
    """The prompt rows one window may still take: its token budget, and while slots decode, a time budget.

    With d decode rows the window may last solo(d) / decode_share plus the scheduler's credit; a prompt chunk
    costs its rows and one sequence, and a window replaying a graph its bucket's rows (chunks fill them). The
    first prompt chunk gets at least one block so prompts always progress, unless even one block would overrun
    the share (windows with prompt rows cost far more than decode-only ones, as eager windows beside replayed
    CUDA graphs): then windows decode only, building credit, until it pays for a whole chunk (the request's
    pending tokens or the token budget) or is capped. While earlier windows' overruns leave less than one
    block's cost (a debt), windows decode only until it is paid back. Until the window cost is calibrated,
    prompt chunks beside decoding slots take at most UNCALIBRATED_CHUNK tokens in all. A chunk that stops
    short of its request's end stops at a multiple of `prompt_align` positions; the first one reaches the next
    such multiple even past the token budget, so that it progresses.
    """

    def __init__(
        self, scheduler: Scheduler, decode_rows: int, tokens: int, paced: int | None = None, past: int = 0
    ) -> None:
        """`paced`: the decode rows whose solo speed sets the time budget (the window's own, or with slot
        groups those of another group it holds up, where more); `past`: where the first prompt chunk would
        start."""
        paced = decode_rows if paced is None else paced
        self.cost = scheduler.cost
        self.fill = scheduler.fill
        self.minimum = scheduler.config.block_size
        self.align = scheduler.config.prompt_align
        self.rows, self.sequences, self.pairs = decode_rows, decode_rows, 0
        self.tokens = tokens
        self.limit: float | None = None
        self.first = True
        self.saving = self.owing = False
        solo = scheduler.solo_seconds(paced) if paced else None
        if solo is not None and self.cost.calibrated:
            # a window of no decode rows adds all it costs to the held-up slots' own windows
            allowed = solo / scheduler.planned_share - (solo if not decode_rows else 0.0)
            self.limit = allowed + scheduler.credit
            block = scheduler.padded(decode_rows + self.minimum)
            one_block = self.cost.predict(block, decode_rows + 1, chunk_pairs(self.minimum, past))
            capped = scheduler.credit >= scheduler.credit_cap(paced, allowed, past)
            sharing = scheduler.config.decode_share < 1
            self.saving = one_block > allowed and sharing and not capped
            self.owing = one_block > self.limit and sharing and not capped
        elif paced:
            self.tokens = min(tokens, UNCALIBRATED_CHUNK)

    def take(self, pending: int, past: int) -> int:
        """How many of `pending` prompt tokens after position `past` the next chunk takes (0: none).

        The taken rows are accounted for.
        """
        take = min(pending, self.tokens)
        if self.limit is not None:
            spent = self.cost.predict(self.rows, self.sequences, self.pairs)
            window = self.rows + self.cost.rows_within(self.limit - spent, past)
            afford = self.fill(window) - self.rows
            if self.first and self.saving:
                take = take if afford >= take else 0
            elif self.first and self.owing:
                take = 0  # earlier windows took more than their share: this one pays it back
            else:
                take = min(take, max(afford, self.minimum) if self.first else afford)
        if 0 < take < pending:
            aligned = (past + take) // self.align * self.align - past
            take = aligned if aligned > 0 or not self.first else min(pending, self.align - past % self.align)
        if take > 0:
            self.first = False
            self.tokens -= take
            self.rows += take
            self.sequences += 1
            self.pairs += chunk_pairs(take, past)
        return take


def window_pairs(chunks: list[Chunk], ran: int) -> int:
    """The attention pairs of a window's prompt chunks (`chunk_pairs`), and of the padding sequence where it
    runs as `ran` rows (a graph bucket's)."""
    pairs = sum(chunk_pairs(len(c.tokens), c.past) for c in chunks if not c.decode)
    padding = ran - sum(len(c.tokens) for c in chunks)
    return pairs + chunk_pairs(padding, 0) if padding > 0 else pairs
