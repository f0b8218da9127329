"""Two attentions over disjoint key sets merged in place: the dense prefill's last step.

Per (row, head): out <- w0 x out + w1 x other, both attentions' outputs already normalised and
the weights their shares of the joint softmax sum (FlashAttention's split-KV merge, arXiv
2307.08691 section 3.1.1; FlashInfer's ``merge_state_in_place``). The weights are computed by the
caller from the log-sum-exps (small [T, H] arrays); the kernel moves only the rows that change: a
row with weights (1, 0) is neither read nor written, a zero weight's operand is not read. Flagged
rows become NaN where their query holds a non-finite entry (the prefill's rule for such rows), so
that the query is read only for the rows the caller could not clear from the statistics.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_tq import _compat, reference
from jax_tq import _primitive_utils as pu
from jax_tq.backend import get_backend
from jax_tq.partitioning import Layout

__all__ = ["merge_attention"]

merge_attention_p = _compat.Primitive("jax_tq_merge_attention")

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def merge_attention(out, other, weights, q, check):
    """``w0 x out + w1 x other`` per (row, head), NaN where ``check`` and ``q`` is not finite.

    Args:
      out: [T, H, d] float32 / bfloat16 / float16: the first attention's output (the result reuses
        its buffer where XLA can); float64 (an oracle's precision) runs the reference in float64,
        as backend "xla" runs it for every dtype.
      other: [T, H, d] of out's dtype: the second attention's output.
      weights: [T, H, 2] float32 (or float64 with float64 out): (w0, w1) per (row, head). A zero
        weight's term is exactly 0 whatever its operand holds (the kernels do not read it); NaN
        weights give NaN rows.
      q: [T, H, d] of out's dtype: the rows' queries.  check: bool [T, H]: rows whose query is read.
    Returns:
      [T, H, d] of out's dtype: w0 x out + w1 x other computed in float32 (float64 for float64
      out); NaN where ``check`` and any of q[t, h, :] is not finite. Rows with weights (1, 0) keep
      out's values (the kernels leave their bytes as they are).
    Raises:
      TypeError / ValueError: operands other than the above, naming the argument (d even, at
        most 256), on every backend.
    Not differentiable (no JVP rule): the dense prefill differentiates through its own VJP.
    Source: the log-sum-exp merge of split-KV attention (FlashAttention-2, arXiv 2307.08691, 3.1.1).
    """
    out, other, weights, q, check = (jnp.asarray(x) for x in (out, other, weights, q, check))
    _check(out, other, weights, q, check)
    backend = get_backend()
    if backend == "xla" or jnp.dtype(out.dtype) == jnp.float64:
        return reference.merge_attention(out, other, weights, q, check)
    (merged,) = pu.bind(merge_attention_p, out, other, weights, q, check, backend=backend)
    return merged


def _check(out, other, weights, q, check):
    op = "jax_tq.merge_attention"
    if out.ndim != 3 or jnp.dtype(out.dtype) not in _FLOATS + (jnp.dtype(jnp.float64),):
        raise TypeError(f"{op}: out must be float32, bfloat16, float16 (or float64) [T, H, d], got "
                        f"{out.dtype}{tuple(out.shape)}")
    if out.shape[2] % 2 or out.shape[2] > 256:
        raise ValueError(f"{op}: head_dim must be even and at most 256, got {out.shape[2]}")
    for name, x in (("other", other), ("q", q)):
        if x.shape != out.shape or x.dtype != out.dtype:
            raise TypeError(f"{op}: {name} must be {out.dtype}{tuple(out.shape)}, got {x.dtype}{tuple(x.shape)}")
    f64 = jnp.dtype(jnp.float64)
    weight_dtypes = (jnp.dtype(jnp.float32), f64) if jnp.dtype(out.dtype) == f64 else (jnp.dtype(jnp.float32),)
    if weights.shape != out.shape[:2] + (2,) or jnp.dtype(weights.dtype) not in weight_dtypes:
        raise TypeError(f"{op}: weights must be float32{out.shape[:2] + (2,)}, got {weights.dtype}{tuple(weights.shape)}")
    if check.shape != out.shape[:2] or check.dtype != jnp.bool_:
        raise TypeError(f"{op}: check must be bool{out.shape[:2]}, got {check.dtype}{tuple(check.shape)}")


def _abstract(out, other, weights, q, check, *, backend):
    return (_compat.output_aval(out.shape, out.dtype, out, other, weights, q, check),)


def _reference(out, other, weights, q, check):
    return (reference.merge_attention(out, other, weights, q, check),)


def _ffi(ctx, *operands):
    return _compat.ffi_lowering("jax_tq_merge_attention", operand_output_aliases={0: 0})(ctx, *operands)


def _batch(args, dims, **params):
    return pu.rows_batch(merge_attention_p, 5, (), args, dims, **params)


_ROWS = ("seq", "kv")  # every (row, head) on its own: rows and heads split wherever the operands are
_LAYOUT = Layout(operands=(_ROWS + (None,),) * 3 + (_ROWS + (None,), _ROWS), results=(_ROWS + (None,),))

pu.define_op(merge_attention_p, abstract=_abstract, reference=_reference, ffi=_ffi, batch=_batch, layout=_LAYOUT)
