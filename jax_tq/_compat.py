"""Every shim over JAX internals that differ between the supported versions (0.10, 0.11).

Nothing else in jax_tq imports from ``jax._src`` or relies on a version-specific name.
"""
from __future__ import annotations

import functools
import json

import jax
import numpy as np
from jax.extend.core import Primitive  # noqa: F401  (re-exported)
from jax.interpreters import batching, mlir  # noqa: F401  (re-exported)
from jax.interpreters.mlir import ir  # noqa: F401  (re-exported: MLIR types in Shardy rules)

try:  # public through 0.10; moved later
    from jax.core import ShapedArray
except (ImportError, AttributeError):  # pragma: no cover - newer JAX
    from jax._src.core import ShapedArray  # type: ignore[no-redef]

#: What a batching rule receives for an operand that is not batched.
NOT_MAPPED = None

#: Where an aval keeps the mesh axes a value varies over inside shard_map: ``manual_axis_type``
#: (JAX 0.10) or ``vma`` (earlier and some later versions).
_VARYING_FIELDS = ("manual_axis_type", "vma")


def _varying(aval) -> frozenset:
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()) or ())


def float0_zeros_like(value):
    """The float0 zero tangent of an integer ``value``, varying over the same shard_map mesh axes
    (a plain numpy float0 array varies over none, which custom_jvp rejects under check_vma)."""
    return varying_like(np.zeros(value.shape, jax.dtypes.float0), value)


def varying_like(x, like):
    """``x`` varying over the shard_map mesh axes that ``like`` varies over (a tangent built from
    inputs that vary over fewer, e.g. instantiated zeros, must match its primal under check_vma);
    ``x`` itself outside shard_map or where this JAX has no ``lax.pcast``."""
    axes = tuple(sorted(_varying(getattr(like, "aval", like)) - _varying(getattr(x, "aval", x))))
    cast = getattr(jax.lax, "pcast", None)
    if not axes or cast is None:
        return x
    try:
        return cast(x, axes, to="varying")
    except (TypeError, ValueError):  # pragma: no cover - other JAX
        return x


def output_aval(shape, dtype, *inputs) -> ShapedArray:
    """``ShapedArray(shape, dtype)`` for a primitive's output that varies, inside shard_map, over
    the mesh axes of its most-varying input (a fresh ShapedArray would claim it varies over none:
    gradients then fail the check_vma type check, and an unvarying output can be returned as
    replicated when it is not). Outside shard_map the inputs vary over nothing: a plain aval."""
    fresh = ShapedArray(shape, dtype)
    avals = [getattr(x, "aval", x) for x in inputs]
    base = max(avals, key=lambda a: len(_varying(a)), default=None)
    if base is None or not _varying(base):
        return fresh
    field = next((f for f in _VARYING_FIELDS if hasattr(base, f)), None)
    try:  # the varying axes need the input's (manual) mesh; the spec follows the output's rank
        spec = jax.sharding.PartitionSpec(*([None] * len(shape)))
        sharding = jax.sharding.NamedSharding(base.sharding.mesh, spec)
        return fresh.update(sharding=sharding, **{field: getattr(base, field)})
    except (AttributeError, AssertionError, TypeError, ValueError):  # pragma: no cover - other JAX
        return fresh


def ffi_lowering(target: str, **kwargs):
    """``jax.ffi.ffi_lowering`` (public since JAX 0.4.36)."""
    return jax.ffi.ffi_lowering(target, **kwargs)


def register_ffi_target(name: str, capsule, platform: str) -> None:
    """Register an XLA FFI handler capsule under ``name`` for ``platform`` ("cpu" or "CUDA")."""
    jax.ffi.register_ffi_target(name, capsule, platform=platform)


def lowering_platforms(ctx) -> tuple[str, ...]:
    """Platforms a lowering rule is being lowered for (e.g. ("cpu",) or ("cuda",))."""
    platforms = getattr(ctx.module_context, "platforms", None)
    if platforms is None:  # pragma: no cover - very old JAX
        platforms = (ctx.module_context.platform,)
    return tuple(platforms)


def _first_gpu():
    """The first GPU device, or None when JAX has none."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0] if gpus else None


def gpu_core_count(default: int = 132) -> int:
    """Number of streaming multiprocessors of the first GPU, or ``default`` when unknown."""
    return int(getattr(_first_gpu(), "core_count", default) or default)


def gpu_compute_capability(default: tuple[int, int] = (9, 0)) -> tuple[int, int]:
    """(major, minor) compute capability of the first GPU, or ``default`` when unknown."""
    text = str(getattr(_first_gpu(), "compute_capability", "") or "")
    try:
        major, minor = (int(v) for v in text.split(".")[:2])
    except ValueError:
        return default
    return major, minor


def enable_x64():
    """Context manager turning on 64-bit types (``jax.enable_x64(True)``; older: jax.experimental)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as _enable_x64  # pragma: no cover - older JAX

    return _enable_x64()


def require_devices_at_lowering(prim) -> None:
    """Lower programs holding ``prim`` with their device assignment known, as custom_partitioning
    needs (JAX adds its own custom_partitioning primitive to the same registry; ``prim`` lowers
    through custom_partitioning only inside its lowering rule, where JAX would not see it)."""
    registry = devices_at_lowering_registry()
    if registry is not None:
        registry.add(prim)


def devices_at_lowering_registry():
    """JAX's set of primitives lowered with their device assignment, or None where it has none."""
    try:
        from jax._src import dispatch
    except ImportError:  # pragma: no cover - other JAX
        return None
    return getattr(dispatch, "prim_requires_devices_during_lowering", None)


def _cudnn_module():
    """JAX's cuDNN fused-attention module (``jax._src.cudnn.fused_attention_stablehlo``), or None."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo
    except ImportError:  # pragma: no cover - other JAX
        return None
    if not hasattr(fused_attention_stablehlo, "dot_product_attention"):  # pragma: no cover
        return None
    return fused_attention_stablehlo


@functools.cache
def has_cudnn_attention() -> bool:
    """Whether :func:`cudnn_attention_with_lse` can be traced: JAX has its cuDNN attention module, a
    CUDA backend (tracing it checks the cuDNN version of the CUDA runtime; a ROCm GPU has none) of
    compute capability 9.0 or later (JAX's cuDNN call serves the packed layout from Hopper on). Asked
    once per process (it lists devices)."""
    cudnn = _cudnn_module()
    try:
        if cudnn is None or not jax.devices("cuda"):
            return False
        cudnn.check_cudnn_version()
        return bool(cudnn.check_compute_capability("9.0"))
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def packed_kv_offsets_follow_key_heads() -> bool:
    """Whether JAX's cuDNN call turns packed kv offsets (tokens) into elements with the key's heads
    (jax-ml/jax#39521, after jax 0.11.0); before it, with the query's, wrong for GQA. Asked of JAX's
    own conversion on a 2-query-head / 1-key-head shape, evaluated at once even inside a trace.
    Raises (uncached) where JAX has no such conversion."""
    cudnn = _cudnn_module()
    jnp = jax.numpy
    with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
        offsets, lens = jnp.asarray([[0, 1, -1]], jnp.int32), jnp.asarray([[1, 1]], jnp.int32)
        kv_offsets = cudnn._fix_seqlen_offsets(lens, lens, offsets, offsets, jnp.zeros((1, 2, 2, 1)),
                                               jnp.zeros((1, 2, 1, 1)))[3]
        return int(kv_offsets[0, 1]) == 1


def packed_kv_heads(num_heads: int, num_kv_heads: int) -> int:
    """The KV heads cuDNN's packed call is handed (:func:`packed_keys`): num_kv_heads where JAX scales
    kv offsets by the key's heads, else num_heads (each KV head repeated: MHA, where both rules agree,
    and the rule of a JAX that cannot be asked)."""
    try:
        follows = num_heads == num_kv_heads or packed_kv_offsets_follow_key_heads()
    except Exception:  # pragma: no cover - another JAX
        follows = False
    return num_kv_heads if follows else num_heads


def packed_keys(q, k, v):
    """k, v as cuDNN's packed call through JAX reads them correctly ([B, S, K, H] -> [B, S,
    packed_kv_heads(N, K), H])."""
    group = packed_kv_heads(q.shape[2], k.shape[2]) // k.shape[2]
    if group == 1:
        return k, v
    return jax.numpy.repeat(k, group, axis=2), jax.numpy.repeat(v, group, axis=2)


def cudnn_attention_with_lse(q, k, v, q_lens, kv_lens, *, scale: float, causal: bool, q_offsets, kv_offsets):
    """cuDNN flash attention of disjoint segments (cuDNN's packed layout) with its float32 softmax
    statistics (``jax.nn.dot_product_attention`` with ``return_residual`` rounds them to the inputs'
    dtype, too coarse to merge two attentions).

    Args:
      q: [1, T, N, H] bfloat16 / float16.  k, v: [1, S, K, H] (N a multiple of K).
      q_lens, kv_lens: int32 [1, M] (M >= 2): each segment's rows / keys (-1: no segment).
      scale: the logits' factor (static).  causal: top-left causal mask (row i of a segment sees its
        keys j <= i, both counted from the segment's start).
      q_offsets, kv_offsets: int32 [1, M + 1]: the first row / key of each segment (-1: none; the
        last entry -1). Segment m's rows see segment m's keys only.
    Returns:
      (out [1, T, N, H] of q's dtype, lse float32 [1, T, N]: log sum exp of the scaled logits), rows
      in no segment unspecified.
    """
    cudnn = _cudnn_module()
    jnp = jax.numpy
    mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    k, v = packed_keys(q, k, v)
    out, stats = cudnn.dot_product_attention(q, k, v, q_seqlen=q_lens, kv_seqlen=kv_lens, q_offsets=q_offsets,
                                             kv_offsets=kv_offsets, scale=float(scale), mask_type=mask,
                                             qkv_layout="BTNH", return_residual=True)
    # stats [M, N, T]: row i of the r-th segment present (JAX drops the -1 entries) at [r, :, i].
    starts, lens = q_offsets[0, :-1], q_lens[0]
    present = (starts >= 0) & (lens >= 0)
    rank = jnp.cumsum(present) - 1
    rows = jnp.arange(q.shape[1])[:, None]
    inside = present[None, :] & (rows >= starts[None, :]) & (rows < (starts + lens)[None, :])   # [T, M]
    segment = jnp.argmax(inside, axis=1)
    index = jnp.clip(rows[:, 0] - starts[segment], 0, q.shape[1] - 1)
    lse = stats[jnp.clip(rank[segment], 0, stats.shape[0] - 1), :, index]                     # [T, N]
    return out, jnp.where(jnp.any(inside, axis=1)[:, None], lse, 0.0)[None]


def exportable_pytree(cls):
    """``cls`` (a registered pytree node whose aux data is a tuple of ints, floats, strings and
    None) made serializable in ``jax.export`` programs (``Exported.serialize``) under the name
    ``jax_tq.<class name>``, its aux data as JSON; a JAX without the registry leaves it as it is."""
    register = getattr(getattr(jax, "export", None), "register_pytree_node_serialization", None)
    if register is not None:
        register(cls, serialized_name=f"jax_tq.{cls.__name__}",
                 serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
                 deserialize_auxdata=lambda data: tuple(json.loads(data)))
    return cls
