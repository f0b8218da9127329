"""benchmarks/bench_decode.py's --variants: the keyword arguments of each variant set, and the tokens
a sliding window's query reads (its pages only, from the first visible token's page), against hand
counts."""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode  # noqa: E402


def test_variant_sets_become_paged_decode_keywords():
    assert bench_decode.parse_variant("none") == {}
    got = bench_decode.parse_variant("soft_cap=50+sliding_window=4096+sinks")
    assert got["soft_cap"] == 50.0 and got["sliding_window"] == 4096
    np.testing.assert_array_equal(got["sinks"], np.ones(bench_decode.NUM_HEADS, np.float32))
    with pytest.raises(SystemExit, match="unknown variant 'window=3'"):
        bench_decode.parse_variant("window=3")


@pytest.mark.parametrize("seq_len,window,tokens", [
    (8192, None, 8192),
    (8192, 8192, 8192),   # a window as long as the sequence: every page
    (8192, 4096, 4096),   # first visible token 4096, a page start
    (8192, 4001, 4016),   # first visible 4191 in the page from 4176: 15 tokens read and masked
    (100, 40, 52),        # first visible 60 in the page from 48, to the sequence's end (100)
])
def test_a_sliding_window_reads_its_pages_only(seq_len, window, tokens):
    assert bench_decode.PAGE_SIZE == 16
    assert bench_decode.window_tokens(seq_len, window) == tokens
