"""benchmarks/http_burst.py's figures from the streams' token times."""

from __future__ import annotations

import pytest

from benchmarks.http_burst import Stream, together_rate


def test_streams_decoding_together_count_only_while_all_of_them_decode() -> None:
    # the second stream's first token comes at 1.0 s, the first's last at 3.0 s: between them both decode
    early = Stream(sent=0.0, events=[0.1, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0])
    late = Stream(sent=0.0, events=[1.0, 1.4, 1.8, 2.2, 2.6, 3.0, 3.4])
    assert together_rate([early, late]) == pytest.approx((4 + 5) / 2.0)


def test_streams_that_never_decode_at_once_are_an_error() -> None:
    with pytest.raises(RuntimeError, match="never decoded all at once"):
        together_rate([Stream(events=[0.0, 1.0]), Stream(events=[2.0, 3.0])])
