"""Opt-in run-time validation of what shapes cannot show (``jax.experimental.checkify``).

Without checked mode the kernels never read or write out of bounds, but bad indices are handled
silently (docs/FORMAT.md): a block-table entry outside [0, num_pages) contributes no tokens, a
seq_len above the table's capacity is clamped, a slot outside the pool is not written. Checked mode
turns each of these into an error that names the sequence or token::

    step = jax.jit(jax_tq.checked(decode_step))
    err, out = step(q, cache, block_tables, seq_lens)
    err.throw()      # raises JaxRuntimeError: "jax_tq.paged_decode: block_tables[1, 2] = 57 ..."
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax.numpy as jnp
from jax.experimental import checkify

from jax_tq.format import INDEX_MAX, check_index_dtype

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("jax_tq_checked", default=False)


def checks_enabled() -> bool:
    """Whether ops traced now insert run-time checks."""
    return _enabled.get()


@contextlib.contextmanager
def _checking(enabled: bool = True):
    token = _enabled.set(enabled)
    try:
        yield
    finally:
        _enabled.reset(token)


def unchecked():
    """A context in which ops traced insert no run-time checks, even inside :func:`checked`: for a
    function that checks its own arguments (naming them) and then calls ops on values it derived
    from them, whose checks would name those derived values (or refuse what it made legal)."""
    return _checking(False)


def checked(fn):
    """Wrap ``fn`` so the jax_tq ops it traces validate indices at run time.

    Returns a function with ``fn``'s arguments that returns ``(error, fn's result)`` as
    ``checkify.checkify`` does; call ``error.throw()`` to raise. Put ``jax.jit`` outside:
    ``jax.jit(checked(fn))``. If ``fn`` itself is a ``jax.jit`` function, the undecorated function
    is checked instead (its jit cache would otherwise hand back an unchecked trace, or leak checks
    into later unchecked calls); ``jax.jit`` functions called *inside* ``fn`` should be created
    inside it or left unjitted. Likewise differentiate inside it, ``checked(jax.grad(f))``:
    ``jax.grad`` of a checked :func:`jax_tq.paged_decode` fails on the kernel backends (under
    checkify, JAX hands its custom VJP's backward pass a wrong residual).

    Args:
      fn: a function (or ``jax.jit`` function) that calls jax_tq ops.

    Returns:
      ``checked_fn(*args, **kwargs) -> (checkify.Error, fn(*args, **kwargs))``.

    Raises:
      TypeError: ``fn`` is not callable. Otherwise nothing itself; ``error.throw()`` raises
      ``checkify.JaxRuntimeError`` naming the first bad block-table entry, seq_lens value or
      slot_mapping value. Under ``jax.vmap`` the indices it names are those within the failing
      batch element (``block_tables[s, p]`` of one element's ``[S, max_pages]`` table); the batch
      index is not part of the message.
    """
    if not callable(fn):
        raise TypeError(f"jax_tq.checked: fn must be callable, got {type(fn).__name__}")
    inner = fn
    while hasattr(inner, "lower") and hasattr(inner, "__wrapped__"):  # a jax.jit wrapper
        inner = inner.__wrapped__

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        with _checking():
            return checkify.checkify(inner, errors=checkify.user_checks)(*args, **kwargs)

    return wrapper


def check_decode_indices(block_tables, seq_lens, *, num_pages: int, page_size: int, op: str = "paged_decode",
                         lens_name: str = "seq_lens", sliding_window: int = 0, row_starts=None) -> None:
    """Insert checks: 0 <= seq_lens <= max_pages * page_size, and every block-table entry a sequence
    uses lies in [0, num_pages); messages name ``jax_tq.{op}`` and call seq_lens ``lens_name``.
    With a ``sliding_window`` (0: none), pages wholly before the window of the sequence's first
    query row are not used (a server may have freed them); that row is at position seq_lens -
    its rows (``row_starts``: int [S + 1], sequence s owning rows row_starts[s] .. row_starts[s + 1];
    None: one row per sequence, a decode). No-op outside checked mode."""
    if not checks_enabled():
        return
    capacity = block_tables.shape[1] * page_size
    int32_cap = min(capacity, INDEX_MAX)  # int32 lengths never exceed a larger capacity
    if seq_lens.size == 0:  # no sequence: nothing to check (argmax of an empty array fails)
        return
    bad_len = (seq_lens < 0) | (seq_lens > int32_cap)
    first = jnp.argmax(bad_len)
    checkify.check(
        ~jnp.any(bad_len),
        # The static bounds are part of the text (they may exceed int32).
        f"jax_tq.{op}: {lens_name}[{{i}}] = {{n}} is outside [0, {capacity}] (max_pages * page_size)",
        i=first, n=seq_lens[first],
    )
    if block_tables.size == 0:  # no page entries: every positive length was reported above
        return
    lengths = jnp.clip(seq_lens, 0, int32_cap)
    pages_used = lengths // page_size + (lengths % page_size > 0)  # ceil, without int32 overflow
    used = jnp.arange(block_tables.shape[1])[None, :] < pages_used[:, None]
    if sliding_window:
        first_row = jnp.maximum(lengths - (1 if row_starts is None else jnp.diff(row_starts)), 0)
        first_seen = jnp.maximum(first_row - (min(sliding_window, int32_cap) - 1), 0)
        used = used & (jnp.arange(block_tables.shape[1])[None, :] >= (first_seen // page_size)[:, None])
    bad = used & ((block_tables < 0) | (block_tables >= num_pages))
    flat = jnp.argmax(bad.reshape(-1))
    row, col = flat // block_tables.shape[1], flat % block_tables.shape[1]
    checkify.check(
        ~jnp.any(bad),
        f"jax_tq.{op}: block_tables[{{r}}, {{c}}] = {{p}} is outside the pool [0, {num_pages}) but the sequence "
        "uses that page" + (" (inside its sliding window)" if sliding_window else ""),
        r=row, c=col, p=block_tables.reshape(-1)[flat],
    )


def reject_checkify_residuals(op: str, **wanted) -> None:
    """Raise a clear TypeError where a custom VJP's integer residuals arrive as something else: JAX
    passes checkify's error state in their place when the forward pass ran under jax_tq.checked /
    checkify and jax.grad was applied outside it. ``wanted``: name -> (value, expected dtype)."""
    for name, (value, dtype) in wanted.items():
        if jnp.result_type(value) != jnp.dtype(dtype):
            raise TypeError(
                f"jax_tq.{op}: its backward pass got {name} as {jnp.result_type(value)}, not {jnp.dtype(dtype)}: "
                f"jax.grad of a checked function (here of its {op}, which jax_tq ops such as "
                f"ragged_paged_attention call) is not supported; differentiate inside the check, "
                f"jax_tq.checked(jax.grad(f))")


def check_query_start_loc(query_start_loc, seq_lens, *, num_rows: int, op: str = "paged_prefill",
                          starts_name: str = "query_start_loc", lens_name: str = "seq_lens",
                          padding: bool = False,
                          hint: str = "write the new tokens into the cache first; seq_lens counts them") -> None:
    """Insert checks: query_start_loc starts at 0, never decreases and ends at num_rows (with
    ``padding``: at most num_rows, the rows after it being padding), and no sequence has more new
    rows than tokens (seq_lens[s] >= its rows); messages name ``jax_tq.{op}``, ``starts_name`` and
    ``lens_name``, the last one ending in ``hint``. No-op outside checked mode."""
    if not checks_enabled():
        return
    name = f"jax_tq.{op}: {starts_name}"
    checkify.check(query_start_loc[0] == 0, f"{name}[0] = {{a}} must be 0", a=query_start_loc[0])
    if seq_lens.size:   # reported before the end, which a decrease may also break
        steps = jnp.diff(query_start_loc)
        s = jnp.argmin(steps)
        checkify.check(
            steps[s] >= 0,
            f"{name} decreases from {{a}} to {{b}} at sequence {{s}}",
            a=query_start_loc[s], b=query_start_loc[s + 1], s=s,
        )
    if padding:
        checkify.check(query_start_loc[-1] <= num_rows,
                       f"{name}[-1] = {{b}} must be <= num_tokens = {num_rows}", b=query_start_loc[-1])
    else:
        checkify.check(query_start_loc[-1] == num_rows, f"{name}[-1] = {{b}} must be num_tokens = {num_rows}",
                       b=query_start_loc[-1])
    if seq_lens.size == 0:
        return
    short = steps > seq_lens
    s = jnp.argmax(short)
    checkify.check(
        ~jnp.any(short),
        f"jax_tq.{op}: sequence {{s}} has {{q}} new query rows but {lens_name}[{{s}}] = {{n}} tokens ({hint})",
        s=s, q=steps[s], n=seq_lens[s],
    )


def check_slot_mapping(slot_mapping, *, num_slots: int) -> None:
    """Insert a check that every non-negative slot is < num_pages * page_size (negative slots mark
    padding tokens and are allowed). No-op outside checked mode."""
    if not checks_enabled() or slot_mapping.size == 0 or num_slots > INDEX_MAX:
        return  # (an int32 slot can not be past a pool of more than 2**31 - 1 slots)
    bad = slot_mapping >= num_slots
    first = jnp.argmax(bad)
    checkify.check(
        ~jnp.any(bad),
        f"jax_tq.write_cache: slot_mapping[{{i}}] = {{s}} is outside the pool (num_pages * page_size = {num_slots})",
        i=first, s=slot_mapping[first],
    )


def check_window_slots(window_slots, *, num_entries: int) -> None:
    """Insert a check that every non-negative window slot is < num_windows * window (negative slots
    skip a token and are allowed). No-op outside checked mode."""
    if not checks_enabled() or window_slots.size == 0 or num_entries > INDEX_MAX:
        return
    bad = window_slots >= num_entries
    first = jnp.argmax(bad)
    checkify.check(
        ~jnp.any(bad),
        f"jax_tq.write_cache: window_slots[{{i}}] = {{s}} is outside the window (num_windows * window = "
        f"{num_entries})",
        i=first, s=window_slots[first],
    )


def check_window_ids(window_ids, seq_lens, *, num_windows: int, op: str = "paged_decode",
                     distinct: bool = False) -> None:
    """Insert a check that every sequence with tokens has a window id in [0, num_windows) (its last
    tokens live there) and, with ``distinct`` (ops that write the rings), that no two such
    sequences share one. No-op outside checked mode."""
    if not checks_enabled() or window_ids.size == 0:
        return
    live = seq_lens > 0
    bad = live & ((window_ids < 0) | (window_ids >= num_windows))
    first = jnp.argmax(bad)
    checkify.check(
        ~jnp.any(bad),
        f"jax_tq.{op}: window_ids[{{i}}] = {{w}} is outside [0, {num_windows}) but sequence {{i}} has tokens",
        i=first, w=window_ids[first],
    )
    if not distinct or window_ids.size < 2:
        return
    # sequences without tokens (or with an id outside the windows) get distinct negative keys
    keys = jnp.where(live & ~bad, window_ids, -1 - jnp.arange(window_ids.size, dtype=window_ids.dtype))
    order = jnp.argsort(keys)
    shared = keys[order][1:] == keys[order][:-1]
    pair = jnp.argmax(shared)
    checkify.check(
        ~jnp.any(shared),
        f"jax_tq.{op}: window_ids[{{i}}] = window_ids[{{j}}] = {{w}}: two sequences with tokens share a window "
        "(each writes its last tokens into it)",
        i=jnp.minimum(order[pair], order[pair + 1]), j=jnp.maximum(order[pair], order[pair + 1]),
        w=keys[order][pair],
    )


def check_at_most(values, bound: int, *, op: str, name: str, bound_name: str) -> None:
    """Insert a check that every element of ``values`` is <= ``bound`` (static); the message names
    ``jax_tq.{op}``, the first offending ``name[i]`` and ``bound_name``. No-op outside checked mode."""
    if not checks_enabled() or values.size == 0:
        return
    bad = values > bound
    first = jnp.argmax(bad)
    checkify.check(~jnp.any(bad), f"jax_tq.{op}: {name}[{{i}}] = {{n}} is past {bound_name} = {bound}",
                   i=first, n=values[first])


def as_array(x, name: str, op: str):
    """``jnp.asarray(x)``; TypeError naming ``jax_tq.{op}`` and ``name`` where x is no array (None, a
    string, a codec passed in its place)."""
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(f"jax_tq.{op}: {name} must be an array, got {type(x).__name__}") from None


def index_array(x, name: str, spec: str, op: str, *, ndim=None, leading=None, shape=None):
    """x as an int32 array; TypeError (dtype) / ValueError (rank or shape) naming ``jax_tq.{op}``,
    ``name`` and its ``spec`` (e.g. "[num_seqs]")."""
    what = f"jax_tq.{op}: {name} must be int32 {spec}"
    check_index_dtype(x, what)
    x = jnp.asarray(x)
    wrong_shape = ((ndim is not None and x.ndim != ndim) or (shape is not None and tuple(x.shape) != shape)
                   or (leading is not None and x.ndim >= 1 and x.shape[0] != leading))
    if x.dtype != jnp.int32 or wrong_shape:
        raise (TypeError if x.dtype != jnp.int32 else ValueError)(f"{what}, got {x.dtype}{tuple(x.shape)}")
    return x
