"""A synthetic byte-level BPE tokenizer of a model's vocabulary size, for benchmarks of structured output.

Random-weight checkpoints carry a word-level tokenizer whose tokens ("t0" .. "tN") cannot spell JSON, so a
grammar would allow nothing. This one has the 256 byte tokens and then merges of earlier tokens (mostly
printable ASCII, short ones more often) up to the vocabulary's size, with GPT-2's byte-to-character mapping,
pre-tokenizer and decoder: a grammar's masks cost what they cost over a real tokenizer of that size.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_byte_tokenizer(path: Path, vocab_size: int, seed: int = 0) -> None:
    """Write `tokenizer.json` at `path`: byte-level BPE with `vocab_size` tokens."""
    rng = random.Random(seed)
    chars = _byte_chars()
    common = [chars[b] for b in range(32, 127)] + [chars[10]]
    vocab = {c: i for i, c in enumerate(chars)}
    tokens, merges = list(chars), []
    short = list(common)
    while len(tokens) < vocab_size:
        first = rng.choice(short) if rng.random() < 0.7 else rng.choice(tokens)
        second = rng.choice(common) if rng.random() < 0.8 else rng.choice(short)
        token = first + second
        if token in vocab or len(token) > 16:
            continue
        vocab[token] = len(tokens)
        tokens.append(token)
        merges.append((first, second))
        if len(token) <= 4:
            short.append(token)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
