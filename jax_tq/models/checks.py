"""Argument checks of jax_tq.models' entry points: what the model's own inputs must be before they
reach jit (token ids, positions, block tables, the per-layer caches). What jax_tq's ops check
themselves (dtypes and shapes of the cache, GQA, head_dim) is left to them."""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq.cache import PagedKVCache

_INT32_RANGE = (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))


def is_host_value(x) -> bool:
    """Whether ``x`` is a host value (numpy / Python), whose values are checked without waiting for
    a device."""
    return not isinstance(x, (jax.Array, jax.core.Tracer))


def check_token_ids(token_ids, vocab_size: int, where: str, values: bool = True) -> None:
    """Raise unless ``token_ids`` are integers (TypeError) in ``[0, vocab_size)`` (ValueError; with
    ``values`` and for concrete arrays only: a traced array has no values at trace time, and a
    decode loop's device-side tokens are not pulled to the host every step)."""
    traced = isinstance(token_ids, jax.core.Tracer)
    if not traced and np.size(token_ids) == 0:  # no ids to check (the callers check the length)
        return
    dtype = token_ids.dtype if hasattr(token_ids, "dtype") else np.asarray(token_ids).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{where}: token ids must be integers, got dtype {dtype}")
    if traced or not values:
        return
    ids = np.asarray(token_ids)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, vocab_size={vocab_size}), got values "
                         f"{ids.min()}..{ids.max()}")


def token_vector(token_ids, vocab_size: int, where: str) -> jax.Array:
    """int32 ``[T >= 1]`` token ids: TypeError / ValueError as :func:`check_token_ids`, ValueError for
    any other shape."""
    check_token_ids(token_ids, vocab_size, where)
    shape = tuple(np.shape(token_ids))
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{where}: token_ids must be [T] with T >= 1 (one sequence, no batch axis), got shape {shape}")
    return jnp.asarray(token_ids, jnp.int32)


def int32(x, name: str, where: str) -> jax.Array:
    """``x`` as int32; TypeError unless its dtype is an integer one (floats would be truncated),
    ValueError for a concrete value outside int32 (it would wrap, e.g. 2**32 + 3 to 3)."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{where}: {name} must be integers, got dtype {dtype}")
    info = np.iinfo(dtype)
    if (info.min < _INT32_RANGE[0] or info.max > _INT32_RANGE[1]) and not isinstance(x, jax.core.Tracer):
        values = np.asarray(x)
        if values.size and (values.min() < _INT32_RANGE[0] or values.max() > _INT32_RANGE[1]):
            raise ValueError(f"{where}: {name} must fit int32, got values {values.min()}..{values.max()}")
    return jnp.asarray(x, jnp.int32)


def static_int(value, name: str, where: str, minimum: int) -> int:
    """``value`` as a Python int >= ``minimum``: TypeError unless a Python / numpy int (not bool,
    float or a traced value: it is static), ValueError below ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be a Python int (static), got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def check_caches(caches: Sequence, num_layers: int, where: str) -> int:
    """The caches' common page_size; ValueError unless one per layer, TypeError for an entry that is
    not a :class:`jax_tq.PagedKVCache`, ValueError when the layers' page sizes or page counts differ
    (one block table and one set of slots serve all layers: a smaller pool would silently drop the
    pages beyond it) or their windows do (one set of window slots serves the layers that have
    one). Compressed and uncompressed layers may mix (init_caches' ``exact_layers``)."""
    if len(caches) != num_layers:
        raise ValueError(f"{where}: expected {num_layers} caches, got {len(caches)}")
    for i, c in enumerate(caches):
        if not isinstance(c, PagedKVCache):
            raise TypeError(f"{where}: caches[{i}] must be a jax_tq.PagedKVCache (see init_caches), got "
                            f"{type(c).__name__}")
    windows = sorted({(c.window, c.num_windows) for c in caches if c.window})
    if len(windows) > 1:
        raise ValueError(f"{where}: the layers with a window must share its size and count (got (window, "
                         f"num_windows) {windows}): one set of window slots serves them all")
    for what in ("page_size", "num_pages"):
        sizes = sorted({int(getattr(c, what)) for c in caches})
        if len(sizes) > 1:
            raise ValueError(f"{where}: every layer's cache must have the same {what} (one block table serves "
                             f"all layers), got {sizes}")
    return int(caches[0].page_size)


def check_chunk(block_table, start_pos: int, num_tokens: int, page_size: int, where: str) -> None:
    """ValueError unless ``block_table`` is [max_pages] and covers positions start_pos .. + num_tokens - 1."""
    if block_table.ndim != 1:
        raise ValueError(f"{where}: block_table must be [max_pages] (1-D), got shape {block_table.shape}")
    capacity = block_table.shape[0] * page_size
    if start_pos + num_tokens > capacity:
        raise ValueError(f"{where}: positions {start_pos}..{start_pos + num_tokens - 1} are not covered by "
                         f"block_table ({block_table.shape[0]} pages x page_size {page_size} = {capacity} tokens)")


def decode_args(caches, num_layers: int, vocab_size: int, token, position, block_tables, seq_lens, where: str,
                token_values: bool = True):
    """The checked ``(page_size, token, position, block_tables, seq_lens)`` of a decode step or loop,
    the last four int32: TypeError / ValueError as :func:`check_caches`, :func:`check_token_ids`
    (values only with ``token_values``) and :func:`int32`, ValueError naming the first of token,
    position, seq_lens ([S >= 1]) and block_tables ([S, max_pages >= 1]) whose shape is wrong, and
    ValueError when caches with a window hold fewer than S window ids."""
    check_token_ids(token, vocab_size, where, values=token_values)
    page_size = check_caches(caches, num_layers, where)
    token, position = int32(token, "token", where), int32(position, "position", where)
    block_tables, seq_lens = int32(block_tables, "block_tables", where), int32(seq_lens, "seq_lens", where)
    if token.ndim != 1:
        raise ValueError(f"{where}: token must be [S] (one token per sequence), got shape {token.shape}")
    num_seqs = token.shape[0]
    if num_seqs < 1:
        raise ValueError(f"{where}: need at least one sequence (token is empty)")
    for name, x in (("position", position), ("seq_lens", seq_lens)):
        if x.shape != (num_seqs,):
            raise ValueError(f"{where}: {name} must be [S={num_seqs}] like token, got shape {x.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or block_tables.shape[1] < 1:
        raise ValueError(f"{where}: block_tables must be [S={num_seqs}, max_pages >= 1], got shape "
                         f"{block_tables.shape}")
    check_enough_windows(caches, num_seqs, where)
    return page_size, token, position, block_tables, seq_lens


def check_enough_windows(caches, num_seqs: int, where: str) -> None:
    """ValueError when caches with a window hold fewer window ids than ``num_seqs`` sequences
    (sequence s uses window id s: the rest would write and read no window)."""
    windows = min((c.num_windows for c in caches if c.window), default=num_seqs)
    if windows < num_seqs:
        raise ValueError(f"{where}: {num_seqs} sequences but the caches hold {windows} windows (sequence s uses "
                         f"window id s); create them with num_windows >= {num_seqs} (init_caches(..., num_windows=))")


def check_window_id(window_id, caches, where: str) -> None:
    """ValueError when a concrete ``window_id`` is outside [0, num_windows) of caches with a window
    (the chunk's last tokens would be written to no window, and later decode steps read none)."""
    windows = min((c.num_windows for c in caches if c.window), default=None)
    if windows is None or isinstance(window_id, jax.core.Tracer):
        return
    wid = int(np.asarray(window_id))
    if not 0 <= wid < windows:
        raise ValueError(f"{where}: window_id={wid} is outside the caches' window ids 0..{windows - 1}")


def window_ids(ids, num_seqs: int, caches, where: str):
    """None, or ``ids`` as int32 ``[num_seqs]``: each sequence's window id in the caches with a
    window (shard-local ids where the windows are split over a mesh axis). TypeError for non-integers;
    ValueError for another shape or a concrete id outside [0, num_windows), or for None (the default
    ids 0 .. num_seqs - 1) with more sequences than the caches' window ids."""
    if ids is None:
        check_enough_windows(caches, num_seqs, where)
        return None
    windows = min((c.num_windows for c in caches if c.window), default=None)
    host = is_host_value(ids)
    ids = int32(ids, "window_ids", where)
    if ids.shape != (num_seqs,):
        raise ValueError(f"{where}: window_ids must be [S={num_seqs}], got shape {tuple(ids.shape)}")
    if host and windows is not None and ids.size and not (0 <= int(ids.min()) and int(ids.max()) < windows):
        raise ValueError(f"{where}: window_ids must lie in the caches' window ids 0..{windows - 1}, got "
                         f"{np.asarray(ids).tolist()}")
    return ids


def check_active_positions(position, seq_lens, where: str, num_steps: int = 1, capacity: int | None = None) -> None:
    """ValueError when an active row (seq_lens > 0) is at a negative position (nothing would be
    written, and the row would attend to an unwritten slot) or, given ``capacity`` (max_pages x
    page_size), would step past its block table within ``num_steps`` steps (nothing written there
    either). Concrete values only; device arrays only with ``capacity`` (a loop's one host read per
    call, not a step's every call)."""
    if any(isinstance(x, jax.core.Tracer) for x in (position, seq_lens)):
        return
    if capacity is None and not (is_host_value(position) and is_host_value(seq_lens)):
        return
    pos, active = np.asarray(position), np.asarray(seq_lens) > 0
    if not active.any():
        return
    if pos[active].min() < 0:
        raise ValueError(f"{where}: active rows' positions must be >= 0, got {pos[active].min()}")
    if capacity is not None and pos[active].max() + num_steps > capacity:
        raise ValueError(f"{where}: active rows' positions {pos[active].min()}..{pos[active].max()} with "
                         f"{num_steps} step(s) do not fit the block tables' {capacity} tokens (max_pages x "
                         f"page_size); give the rows more pages or take fewer steps")


def check_host_rows(caches, position, block_tables, seq_lens, where: str, num_steps: int = 1) -> None:
    """For host (numpy / Python) values only: ValueError when an active row's (seq_lens > 0)
    seq_lens is not position + 1 (the row would attend to slots never written, or miss its own
    token), or a block-table entry covering its positions 0 .. position + num_steps - 1 is not a
    page of the pool (its tokens would be neither written nor read)."""
    if not all(is_host_value(x) for x in (position, block_tables, seq_lens)):
        return
    pos, lens, tables = np.asarray(position), np.asarray(seq_lens), np.asarray(block_tables)
    active = lens > 0
    if (lens[active] != pos[active] + 1).any():
        b = int(np.flatnonzero(active & (lens != pos + 1))[0])
        raise ValueError(f"{where}: seq_lens[{b}]={lens[b]} but position[{b}]={pos[b]}: an active row's seq_lens "
                         f"is its position + 1 (the tokens it attends to, its own included)")
    check_pages_in_pool(tables[active], pos[active] + num_steps, int(caches[0].page_size),
                        int(caches[0].num_pages), where)


def check_pages_in_pool(tables, ends, page_size: int, num_pages: int, where: str) -> None:
    """ValueError when an entry of ``tables`` [R, max_pages] covering positions 0 .. ends[r] - 1 of
    its row is outside [0, num_pages) (host values)."""
    tables = np.asarray(tables).reshape(-1, np.shape(tables)[-1])
    covering = np.arange(tables.shape[1])[None, :] * page_size < np.asarray(ends).reshape(-1, 1)
    bad = tables[covering & ((tables < 0) | (tables >= num_pages))]
    if bad.size:
        raise ValueError(f"{where}: block table entry {int(bad[0])} (covering a position of the row) is not a "
                         f"page of the caches' pool [0, {num_pages})")


def prompt_args(caches, num_layers: int, vocab_size: int, prompt_ids, prompt_lens, block_tables, where: str):
    """``(prompt_ids, prompt_lens, block_tables)`` as int32 arrays for fresh prompts
    (:func:`jax_tq.models.llama.make_prefill`), or the errors it documents: TypeError for
    non-integers or a cache that is not a PagedKVCache; ValueError for shapes other than
    ``[S >= 1, L >= 1]`` / ``[S]`` / ``[S, max_pages]``, ids outside ``[0, vocab_size)`` and (host
    values) lengths outside ``[1, L]``, a prompt longer than its table, a covering entry outside the pool."""
    page_size = check_caches(caches, num_layers, where)
    check_token_ids(prompt_ids, vocab_size, where)
    host_lens, host_tables = is_host_value(prompt_lens), is_host_value(block_tables)
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    prompt_lens = int32(prompt_lens, "prompt_lens", where)
    block_tables = int32(block_tables, "block_tables", where)
    if prompt_ids.ndim != 2 or 0 in prompt_ids.shape:
        raise ValueError(f"{where}: prompt_ids must be [num_prompts >= 1, L >= 1], got {prompt_ids.shape}")
    num_prompts, length = prompt_ids.shape
    if prompt_lens.shape != (num_prompts,) or block_tables.ndim != 2 or block_tables.shape[0] != num_prompts:
        raise ValueError(f"{where}: prompt_lens must be [{num_prompts}] and block_tables [{num_prompts}, max_pages], "
                         f"got {prompt_lens.shape} and {block_tables.shape}")
    if host_lens:
        lens = np.asarray(prompt_lens)
        if lens.min() < 1 or lens.max() > length:
            raise ValueError(f"{where}: prompt_lens must be in [1, {length}], got {lens.min()}..{lens.max()}")
        if lens.max() > block_tables.shape[1] * page_size:
            raise ValueError(f"{where}: a prompt of {lens.max()} tokens does not fit its block table "
                             f"({block_tables.shape[1]} pages of {page_size})")
        if host_tables:
            check_pages_in_pool(np.asarray(block_tables), lens, page_size, int(caches[0].num_pages), where)
    return prompt_ids, prompt_lens, block_tables
