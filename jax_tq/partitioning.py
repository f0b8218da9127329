"""How the jax_tq primitives are partitioned under ``jax.jit`` with sharded inputs (GSPMD or Shardy).

Each partitioned primitive P (compress, decompress, write_cache, paged_decode, paged_prefill,
merge_attention) lowers through ``jax.experimental.custom_partitioning`` wrapped around a per-shard twin primitive
(``P.name + "_shard"``, the same abstract eval and lowerings as P, no transformation rules): XLA's
partitioner asks :func:`_partition` for the operand and result shardings of one call, and every
device then runs the twin on its slice. Transformations (vmap, jvp, vjp) stay on P, so the
partitioning only appears when P is lowered; a program with one device, or inside a fully manual
``shard_map``, lowers P's twin directly (custom_partitioning inlines its body there).

Each op declares a :class:`Layout`: the role of every dimension of its operands and results.

  ``"kv"``    KV heads: split over the mesh axes the cache's KV-head dim is sharded over, when they
              divide it (else whole).
  ``"head"``  query heads (num_kv_heads * group, query head h reading KV head h // group): split
              over the KV heads' axes, so that each device holds its KV heads' query heads.
  ``"seq"``   sequences (or the rows of compress / decompress, or write_cache's new tokens): split
              over the axes of the first such dim, when they divide every ``"seq"`` dim and are not
              the KV heads' axes.
  ``"page"``  pages (and ``"window"``, window ids): split over the ``"seq"`` axes only when the
              page pool comes in sharded over exactly those axes (each sequence shard owns its pages
              and windows: its block tables, slots and window ids are shard-local), else whole.
  ``None``    never split (head_dim, page_size, codec tables, query_start_loc, ...).

A layout whose shardings do not fit (KV heads not divisible by the model axis, sequences not
divisible by the data axis) falls back to a whole dim there: XLA then gathers that operand, and the
result still equals the unsharded call. Pages that come in split are the exception: their ids are
shard-local, so a call that cannot keep them split (sequences or new tokens not split over the same
axes, or an op that never splits them) raises instead of reading local ids as global.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jax_tq import _compat

Roles = tuple  # tuple[Optional[str], ...]: one role per dim

#: The JAX versions (major, minor) whose custom_partitioning hooks (the registry of primitives that
#: need their devices at lowering, Shardy's sharding rules) this module was run against. Under any
#: other version the primitives lower whole, as before this module: XLA gathers sharded operands,
#: results unchanged (:func:`enabled`).
VERIFIED_JAX = ((0, 10), (0, 11))


def enabled() -> bool:
    """Whether the primitives lower through custom_partitioning under the running JAX."""
    version = tuple(int(x) for x in jax.__version__.split(".")[:2])
    return version in VERIFIED_JAX and _compat.devices_at_lowering_registry() is not None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The dim roles of one primitive's operands and results (see the module docstring).

    Attributes:
      operands, results: one tuple of roles per operand / result, one role per dim.
      whole: roles that this op never splits (e.g. paged_prefill's ``"seq"``: its query rows are
        addressed by the global ``query_start_loc``).
      seq_needs_pages: ``"seq"`` may be split only together with the pages (write_cache: a token's
        slot addresses the whole pool unless each shard owns its pages).
    """

    operands: tuple
    results: tuple
    whole: frozenset = frozenset()
    seq_needs_pages: bool = False


def _axes(entry) -> tuple:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_axes(sharding, dim: int) -> tuple:
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec):
        return ()
    return _axes(spec[dim])


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _first(layout_dims, role):
    """(operand index, dim) of the first operand dim with ``role``, or None."""
    for i, roles in enumerate(layout_dims):
        for d, r in enumerate(roles):
            if r == role:
                return i, d
    return None


def _dims_with(layout_dims, shapes, role):
    return [shapes[i][d] for i, roles in enumerate(layout_dims) for d, r in enumerate(roles) if r == role]


def decide(layout: Layout, mesh, shapes: Sequence[tuple], shardings: Sequence, op: str = "op",
           refuse: bool = True) -> dict:
    """Mesh axes per role for one call, from the operands' shapes and (suggested) shardings.

    Returns:
      dict role -> tuple of mesh axis names (empty: whole).
    Raises:
      ValueError (with ``refuse``): the page pools come in split (``shard_cache(..., page_axis=...)``:
        block tables, slots and window ids are shard-local) but this call cannot keep them split:
        gathered, they would be read and written with shard-local ids as if global.
    """
    def pick(role):
        at = _first(layout.operands, role)
        if at is None or role in layout.whole:
            return ()
        axes = _spec_axes(shardings[at[0]], at[1])
        size = _size(mesh, axes) if axes else 1
        dims = _dims_with(layout.operands, shapes, role) + (
            [] if role != "kv" else _dims_with(layout.operands, shapes, "head"))
        return axes if axes and all(n % size == 0 for n in dims) else ()

    kv = pick("kv")
    seq = tuple(a for a in pick("seq") if a not in kv)
    seq = seq if seq == pick("seq") else ()
    pages = pick("page")
    split_pages = bool(seq) and pages == seq and all(
        n % _size(mesh, seq) == 0 for n in _dims_with(layout.operands, shapes, "window"))
    if layout.seq_needs_pages and not split_pages:
        seq = ()
    page_axes = seq if split_pages else ()
    at = _first(layout.operands, "page")
    split_in = _spec_axes(shardings[at[0]], at[1]) if at is not None else ()
    if refuse and split_in and not page_axes:
        where = (f"jax_tq.{op}: the page pools are split over {split_in} (page_axis: shard-local block tables, "
                 "slots and window ids), which this call cannot keep")
        if {"seq", "tok"} & layout.whole:
            raise ValueError(f"{where}: it does not run per page shard; keep the pages whole for it (shard_cache "
                             "without page_axis)")
        raise ValueError(f"{where}: its sequences (write_cache: its new tokens and slots) come in split over "
                         f"{pick('seq') or 'no axis'}; pass them split over {split_in}, each shard's own "
                         "(docs/USAGE.md \"Sharding\")")
    return {"kv": kv, "head": kv, "seq": seq, "page": page_axes, "window": page_axes, None: ()}


def _fitted(layout: Layout, shapes: Sequence[tuple]) -> Layout:
    """``layout`` with the roles of its operands' empty dims None (an optional operand left out, as
    sinks [0] or windows [0, Hkv, 0, d]: nothing to split, and no factor to size)."""
    operands = tuple(tuple(None if shapes[i][d] == 0 else r for d, r in enumerate(roles))
                     for i, roles in enumerate(layout.operands))
    return dataclasses.replace(layout, operands=operands)


def _sharding(mesh, roles, axes):
    entries = []
    for r in roles:
        a = axes.get(r, ())
        entries.append(None if not a else a[0] if len(a) == 1 else a)
    return NamedSharding(mesh, PartitionSpec(*entries))


def _shapes(arg_shapes):
    return [tuple(a.shape) for a in arg_shapes]


def _op_name(prim) -> str:
    return prim.name.removeprefix("jax_tq_").removesuffix("_shard")


def _partition(prim, layout, params, mesh, arg_shapes, result_shape):
    layout = _fitted(layout, _shapes(arg_shapes))
    shardings = [a.sharding for a in arg_shapes]
    axes = decide(layout, mesh, _shapes(arg_shapes), shardings, _op_name(prim))
    arg_shardings = tuple(_sharding(mesh, roles, axes) for roles in layout.operands)
    result_shardings = tuple(_sharding(mesh, roles, axes) for roles in layout.results)

    def lower(*operands):
        return tuple(prim.bind(*operands, **dict(params)))

    return mesh, lower, result_shardings, arg_shardings


def _infer(prim, layout, params, mesh, arg_shapes, result_shape):
    layout = _fitted(layout, _shapes(arg_shapes))
    # GSPMD's propagation aborts the process on an exception here: the refusal waits for _partition
    axes = decide(layout, mesh, _shapes(arg_shapes), [a.sharding for a in arg_shapes], _op_name(prim), refuse=False)
    return tuple(_sharding(mesh, roles, axes) for roles in layout.results)


def _sharding_rule(layout, params, mesh, value_types, result_types):
    """The Shardy rule (an SdyShardingRule, built from public classes): one factor per role, every
    never-split dim its own need-replication factor, and so the roles in ``layout.whole``. Query
    heads are a factor of their own, not the compound (KV head, group): Shardy would then shard
    them over a sub-axis where the KV heads do not fill a mesh axis (4 KV heads, 8 devices), which
    custom_partitioning cannot express. :func:`decide` ties them to the KV heads' axes."""
    from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule

    shapes = [tuple(_compat.ir.RankedTensorType(t).shape) for t in value_types]
    layout = _fitted(layout, shapes)
    names = {"kv": "k", "head": "h", "seq": "s", "tok": "n", "page": "p", "window": "w"}
    order = []  # factors in the order they first appear (Shardy wants the special ones so sorted)
    replicate = {names[r] for r in layout.whole if r in names}

    def mapping(roles):
        dims = []
        for r in roles:
            factor = names[r] if r is not None else f"x{len(order)}"
            if r is None:
                replicate.add(factor)
            dims.append(factor)
            if factor not in order:
                order.append(factor)
        return ArrayMapping(*dims)

    operands = tuple(mapping(roles) for roles in layout.operands)
    results = tuple(mapping(roles) for roles in layout.results)
    special = tuple(f for f in order if f in replicate)
    return SdyShardingRule(operands, results, need_replication_factors=special)


def lowering(prim, twin, layout: Layout) -> Callable:
    """The lowering rule of ``prim``: ``twin`` (the per-shard primitive) under custom_partitioning."""
    return functools.partial(_lower_partitioned, twin, layout)


@functools.lru_cache(maxsize=None)
def _partitioned_call(twin, layout):
    from jax.experimental.custom_partitioning import custom_partitioning

    def call(params, *operands):
        return tuple(twin.bind(*operands, **dict(params)))

    wrapped = custom_partitioning(call, static_argnums=(0,))
    wrapped.def_partition(
        partition=functools.partial(_partition_static, twin, layout),
        infer_sharding_from_operands=functools.partial(_infer_static, twin, layout),
        sharding_rule=functools.partial(_rule_static, layout),
    )
    return wrapped


# custom_partitioning passes the static args first: (params, mesh, arg_shapes, result_shape)
def _partition_static(twin, layout, params, mesh, arg_shapes, result_shape):
    return _partition(twin, layout, params, mesh, arg_shapes, result_shape)


def _infer_static(twin, layout, params, mesh, arg_shapes, result_shape):
    return _infer(twin, layout, params, mesh, arg_shapes, result_shape)


def _rule_static(layout, params, mesh, value_types, result_types):
    return _sharding_rule(layout, params, mesh, value_types, result_types)


def _single_device(ctx) -> bool:
    """Whether the program being lowered runs on one device (or its devices are not yet known:
    custom_partitioning needs them), so that the twin is lowered as it is."""
    context = ctx.module_context.axis_context
    if not hasattr(context, "device_assignment"):  # shard_map (SPMDAxisContext) and other contexts
        return False
    return context.device_assignment is None or len(context.device_assignment) <= 1


def _lower_partitioned(twin, layout, ctx, *operands, **params):
    if _single_device(ctx):
        return _compat.mlir.lower_fun(lambda *ops: twin.bind(*ops, **params), multiple_results=True)(ctx, *operands)
    wrapped = _partitioned_call(twin, layout)
    static = tuple(sorted(params.items()))
    return _compat.mlir.lower_fun(lambda *ops: wrapped(static, *ops), multiple_results=True)(ctx, *operands)


def twin_primitive(prim):
    """The per-shard primitive of ``prim``: ``prim.name + "_shard"``, multiple results."""
    twin = _compat.Primitive(prim.name + "_shard")
    twin.multiple_results = True
    return twin
