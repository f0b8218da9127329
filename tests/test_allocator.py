"""jax_tq.PageAllocator: randomized operations against a plain model of who owns which page, the
errors it promises, and its block tables through slot_mapping / write_cache / paged_decode."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq


def _check_invariants(alloc, owned, tokens):
    """The allocator agrees with the model ``owned`` (seq -> pages) / ``tokens`` (seq -> count)."""
    assert set(alloc.seq_ids) == set(owned)
    every = [p for pages in owned.values() for p in pages]
    assert len(every) == len(set(every)), "a page is owned twice"
    assert all(0 <= p < alloc.num_pages for p in every)
    assert alloc.free_pages == alloc.num_pages - len(every)
    for s, pages in owned.items():
        assert alloc.pages(s) == pages
        assert alloc.num_tokens(s) == tokens[s]
        assert len(pages) == -(-tokens[s] // alloc.page_size)
    if owned:
        ids = list(owned)
        tables = alloc.block_tables(ids)
        assert tables.dtype == np.int32 and tables.shape == (len(ids), alloc.max_pages_per_seq)
        for row, s in zip(tables, ids):
            n = len(owned[s])
            assert list(row[:n]) == owned[s] and (row[n:] == -1).all()


def test_random_operations_match_a_simple_model(rng):
    page_size, max_pages = int(rng.integers(1, 6)), int(rng.integers(1, 7))
    alloc = tq.PageAllocator(int(rng.integers(4, 24)), page_size, max_pages)
    owned, tokens, next_id = {}, {}, 0
    reused = out_of_pages = 0
    ever_freed = set()
    for _ in range(600):
        op = rng.choice(["allocate", "extend", "free"], p=[0.4, 0.35, 0.25])
        free_before = alloc.free_pages
        if op == "allocate" or not owned:
            n = int(rng.integers(0, max_pages * page_size + 1))
            need = -(-n // page_size)
            if need > free_before:
                with pytest.raises(tq.OutOfPagesError) as err:
                    alloc.allocate(next_id, n)
                assert (err.value.needed, err.value.free) == (need, free_before)
                assert f"needs {need} more page(s)" in str(err.value) and f"only {free_before} of" in str(err.value)
                out_of_pages += 1
            else:
                pages = alloc.allocate(next_id, n)
                want = sorted(alloc_free_model(alloc.num_pages, owned))[:need]  # lowest free first
                assert pages == want
                reused += len(ever_freed & set(pages))
                owned[next_id], tokens[next_id] = pages, n
                next_id += 1
        elif op == "extend":
            s = list(owned)[int(rng.integers(len(owned)))]
            n = tokens[s] + int(rng.integers(0, 2 * page_size + 1))
            need = -(-n // page_size)
            if need > max_pages:
                with pytest.raises(ValueError, match="max_pages_per_seq"):
                    alloc.extend(s, n)
            elif need - len(owned[s]) > free_before:
                with pytest.raises(tq.OutOfPagesError) as err:
                    alloc.extend(s, n)
                assert (err.value.needed, err.value.free) == (need - len(owned[s]), free_before)
                out_of_pages += 1
            else:
                added = alloc.extend(s, n)
                assert len(added) == need - len(owned[s])
                reused += len(ever_freed & set(added))
                owned[s] = owned[s] + added
                tokens[s] = n
        else:
            s = list(owned)[int(rng.integers(len(owned)))]
            assert alloc.free(s) == owned[s]
            ever_freed |= set(owned.pop(s))
            del tokens[s]
        _check_invariants(alloc, owned, tokens)
    assert reused > 0 and out_of_pages > 0  # both paths were exercised


def alloc_free_model(num_pages, owned):
    taken = {p for pages in owned.values() for p in pages}
    return [p for p in range(num_pages) if p not in taken]


def test_errors_name_the_problem_and_change_nothing():
    alloc = tq.PageAllocator(num_pages=5, page_size=4, max_pages_per_seq=3)
    assert alloc.allocate(7, 9) == [0, 1, 2]
    with pytest.raises(ValueError, match="seq_id 7 is already allocated"):
        alloc.allocate(7, 1)
    with pytest.raises(tq.OutOfPagesError, match="needs 3 more page.s. for 12 tokens but only 2 of 5") as err:
        alloc.allocate("b", 12)
    assert isinstance(err.value, RuntimeError) and (err.value.needed, err.value.free) == (3, 2)
    with pytest.raises(ValueError, match="needs 4 pages of 4, more than max_pages_per_seq=3"):
        alloc.allocate("c", 13)
    with pytest.raises(ValueError, match="max_pages_per_seq=3"):
        alloc.extend(7, 13)
    with pytest.raises(ValueError, match="below seq_id 7's 9 tokens"):
        alloc.extend(7, 8)
    for method, args in (("extend", (3, 1)), ("free", (3,)), ("pages", (3,)), ("num_tokens", (3,))):
        with pytest.raises(KeyError, match="unknown seq_id 3"):
            getattr(alloc, method)(*args)
    with pytest.raises(KeyError, match="unknown seq_id 'x'"):
        alloc.block_tables([7, "x"])
    for bad in (1.0, True, "3", None):
        with pytest.raises(TypeError, match="num_tokens must be an int"):
            alloc.allocate("d", bad)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        alloc.allocate("d", -1)
    for method, args in (("allocate", ([1], 3)), ("extend", ([7], 12)), ("free", ({},)), ("pages", (np.arange(2),)),
                         ("capacity", ([7],)), ("block_tables", ([[7]],))):  # was Python's bare "unhashable type"
        with pytest.raises(TypeError, match=f"PageAllocator.{method}: seq_id must be hashable"):
            getattr(alloc, method)(*args)
    assert [7] not in alloc and 7 in alloc
    assert alloc.pages(7) == [0, 1, 2] and alloc.num_tokens(7) == 9 and alloc.free_pages == 2 and len(alloc) == 1
    alloc.free(7)
    with pytest.raises(KeyError, match="unknown seq_id 7"):
        alloc.free(7)  # double free
    assert alloc.free_pages == 5
    for kwargs, exc in ((dict(num_pages=0), ValueError), (dict(page_size=0), ValueError),
                        (dict(max_pages_per_seq=-1), ValueError), (dict(num_pages=2.0), TypeError),
                        (dict(page_size=True), TypeError), (dict(num_pages=2**28, page_size=16), ValueError)):
        args = dict(num_pages=4, page_size=4, max_pages_per_seq=2) | kwargs
        with pytest.raises(exc, match=next(iter(kwargs))):
            tq.PageAllocator(**args)
    for num_pages in (-1, 0):  # one message for both (-1 said ">= 0", which 0 also fails)
        with pytest.raises(ValueError, match=f"num_pages must be >= 1, got {num_pages}"):
            tq.PageAllocator(num_pages, 4, 2)


def test_block_tables_keep_writes_past_a_sequences_pages_off_other_pages(rng):
    """Two sequences with interleaved pages (grown by extend, one page reused after a free): a write
    one token past a's pages goes nowhere (the -1 entry), every page holds its owner's tokens only,
    and paged_decode over the tables == float64 softmax attention over each sequence's tokens."""
    ps, heads, d = 4, 2, 8
    alloc = tq.PageAllocator(num_pages=6, page_size=ps, max_pages_per_seq=4)
    alloc.allocate("tmp", 4)          # page 0, freed below: reused by b
    alloc.allocate("a", 5)            # pages 1, 2
    alloc.free("tmp")
    alloc.allocate("b", 3)            # page 0
    alloc.extend("b", 9)              # pages 3, 4
    alloc.extend("a", 6)              # no new page
    assert alloc.pages("a") == [1, 2] and alloc.pages("b") == [0, 3, 4]
    tables = alloc.block_tables(["a", "b"])
    lens = {"a": 6, "b": 9}
    positions = np.concatenate([np.arange(lens["a"] + 3), np.arange(lens["b"])]).astype(np.int32)  # a: 3 too many
    seq_ids = np.repeat(np.array([0, 1], np.int32), [lens["a"] + 3, lens["b"]])
    slots = np.asarray(tq.slot_mapping(jnp.asarray(tables), jnp.asarray(positions), ps, jnp.asarray(seq_ids)))
    assert (slots[lens["a"]:lens["a"] + 2] >= 0).all() and slots[lens["a"] + 2] == -1  # a's 2 pages end at 8
    k = rng.normal(size=(positions.size, heads, d)).astype(np.float32)
    v = rng.normal(size=k.shape).astype(np.float32)
    cache = tq.PagedKVCache.create(num_pages=6, page_size=ps, num_kv_heads=heads, preset="none", head_dim=d)
    cache = tq.write_cache(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    pages = np.asarray(cache.k_pages)  # [num_pages, heads, ps, d]
    for row, name in enumerate(["a", "b"]):
        mine = np.flatnonzero(seq_ids == row)
        for t in mine[:lens[name]]:
            p = positions[t]
            np.testing.assert_array_equal(pages[tables[row, p // ps], :, p % ps], k[t])
    assert not pages[5].any()  # never allocated, never written
    q = rng.normal(size=(2, 2 * heads, d)).astype(np.float32)
    out = np.asarray(tq.paged_decode(jnp.asarray(q), cache, jnp.asarray(tables),
                                     jnp.asarray([lens["a"], lens["b"]], jnp.int32)))
    for row, name in enumerate(["a", "b"]):
        toks = np.flatnonzero(seq_ids == row)[:lens[name]]
        kk, vv = k[toks].astype(np.float64), v[toks].astype(np.float64)
        for h in range(2 * heads):
            s = kk[:, h // 2] @ q[row, h].astype(np.float64) / np.sqrt(d)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(out[row, h], (w / w.sum()) @ vv[:, h // 2], rtol=1e-5, atol=1e-5)
