// The op table: every XLA FFI target of jax_tq, once. X(name, Stem): target "jax_tq_<name>", handler
// symbols JaxTq<Stem>Cpu (defined beside its implementation in <file>.cc) and JaxTq<Stem>Cuda (in
// <file>.cu). Operands, results and attributes: the Bind<Stem> of ffi_checks.h (docs/DESIGN.md).
// A new op: one line here, its Bind<Stem>, its two handlers, its primitive in jax_tq/.
#ifndef JAX_TQ_OPS_H_
#define JAX_TQ_OPS_H_

#define JAX_TQ_OPS(X)             \
  X(compress, Compress)           \
  X(decompress, Decompress)       \
  X(write_cache, WriteCache)      \
  X(paged_decode, PagedDecode)    \
  X(qjl_compress, QjlCompress)    \
  X(qjl_scores, QjlScores)        \
  X(paged_prefill, PagedPrefill)  \
  X(merge_attention, MergeAttention)

#endif  // JAX_TQ_OPS_H_
