"""Partition specs of a :class:`jax_tq.PagedKVCache` for a device mesh, and placing a cache on one.

With the cache placed so (KV heads over a "model" axis; optionally pages over a "data" axis), and
the other arguments as in docs/USAGE.md "Sharding", a plain ``jax.jit`` of the jax_tq ops runs each
kernel on each device's slice (the partitioning rules: jax_tq/partitioning.py).
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jax_tq.cache import PagedKVCache


def cache_partition_specs(cache: PagedKVCache, *, kv_head_axis="model", page_axis=None) -> PagedKVCache:
    """The PartitionSpecs of ``cache``'s leaves: a PagedKVCache-shaped pytree (for ``jax.device_put``,
    ``in_shardings`` / ``out_shardings`` or ``shard_map``'s specs).

    Args:
      cache: a :class:`jax_tq.PagedKVCache` (compressed or uncompressed); only its structure is read.
      kv_head_axis: mesh axis name (or tuple of names, or None) of the KV heads: dim 1 of the code,
        norm and page pools and of the windows.
      page_axis: None (every device holds all pages of its KV heads: the pages are shared by all
        sequence shards), or the mesh axis (or axes) the sequences are split over: dim 0 of the
        pools and windows, each sequence shard then owning ``num_pages / size`` pages and
        ``num_windows / size`` windows. Block tables, slot mappings, window ids and window slots
        must then hold shard-local ids (page ``j`` of the shard is global page
        ``shard * num_pages / size + j``).

    Returns:
      PagedKVCache whose array leaves are PartitionSpecs (the codecs' rotations and centroids ``P()``).

    Raises:
      TypeError: cache not a PagedKVCache.
      ValueError: kv_head_axis and page_axis share a mesh axis.

    Source: the layouts of docs/USAGE.md "Sharding" (pages over the data axis as in vLLM's
    tpu-inference ragged paged attention, which keeps per-shard page pools).
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"jax_tq.cache_partition_specs: cache must be a PagedKVCache, got {type(cache).__name__}")
    heads, pages = _names(kv_head_axis), _names(page_axis)
    if set(heads) & set(pages):
        raise ValueError(f"jax_tq.cache_partition_specs: kv_head_axis {kv_head_axis!r} and page_axis {page_axis!r} "
                         "share a mesh axis")
    head_entry = heads[0] if len(heads) == 1 else (heads or None)
    page_entry = pages[0] if len(pages) == 1 else (pages or None)

    def spec(name, value):
        if value is None:
            return None
        if name in ("k_codec", "v_codec"):
            return jax.tree_util.tree_map(lambda _: PartitionSpec(), value)
        return PartitionSpec(page_entry, head_entry, *([None] * (value.ndim - 2)))

    return dataclasses.replace(cache, **{f.name: spec(f.name, getattr(cache, f.name))
                                         for f in dataclasses.fields(cache)})


def shard_cache(cache: PagedKVCache, mesh: jax.sharding.Mesh, *, kv_head_axis="model", page_axis=None) -> PagedKVCache:
    """``cache`` placed on ``mesh`` with :func:`cache_partition_specs` (``jax.device_put``).

    Args:
      cache: a :class:`jax_tq.PagedKVCache` (any pools: codes, norms, windows, uncompressed pages).
      mesh: the ``jax.sharding.Mesh`` to place it on.
      kv_head_axis: mesh axis name (or tuple of names, or None) that splits dim 1 of every pool,
        the KV heads; default ``"model"``.
      page_axis: mesh axis name(s) that split the pages (dim 0 of the page pools) and the windows
        (dim 0 of the rings), or None (default): every device holds all pages. Split pages take
        shard-local page and window ids (docs/USAGE.md "Sharding").
    Returns:
      the same cache, each leaf a ``jax.Array`` sharded by its ``PartitionSpec``; no value changes.
    Raises:
      TypeError / ValueError: as :func:`cache_partition_specs`; ValueError when an axis is not one of
        the mesh's, or does not divide the dim it splits (num_kv_heads, num_pages, num_windows).
    """
    specs = cache_partition_specs(cache, kv_head_axis=kv_head_axis, page_axis=page_axis)
    for axis in _names(kv_head_axis) + _names(page_axis):
        if axis not in mesh.shape:
            raise ValueError(f"jax_tq.shard_cache: mesh axis {axis!r} is not one of the mesh's {tuple(mesh.shape)}")
    for leaf, spec in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
        for dim, (n, entry) in enumerate(zip(leaf.shape, spec)):
            size = 1
            for axis in _names(entry):
                size *= mesh.shape[axis]
            if n % size:
                what = "kv_head_axis" if dim == 1 else "page_axis"
                raise ValueError(f"jax_tq.shard_cache: {what} {entry!r} of size {size} does not divide the cache's "
                                 f"dim {dim} of size {n} (shape {tuple(leaf.shape)})")
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), cache, specs,
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def _names(axis) -> tuple:
    if axis is None:
        return ()
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
