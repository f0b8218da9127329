"""jax_tq: TurboQuant-compressed paged KV caches for JAX, with XLA FFI kernels (CPU and CUDA).

Public API::

    import jax_tq as tq
    codec = tq.TurboQuant(head_dim=128, bits=4, seed=0)
    codes, norms = tq.compress(x, codec)
    x_hat = tq.decompress(codes, norms, codec, dtype=jnp.float32)
    cache = tq.PagedKVCache.create(num_pages=..., page_size=16, num_kv_heads=..., k_codec=..., v_codec=...)
    cache = tq.PagedKVCache.create(num_pages=..., page_size=16, num_kv_heads=..., preset="k4v4",
                                   head_dim=128, num_windows=num_seqs)   # fitted scales + 64-token window
    slots = tq.slot_mapping(block_tables, positions, page_size, seq_ids)  # -1 where the table has no slot
    cache = tq.write_cache(cache, k, v, slots)                           # window caches: + window_slots
    out = tq.paged_decode(q, cache, block_tables, seq_lens)
    out = tq.paged_prefill(q_new, cache, block_tables, seq_lens, query_start_loc)  # causal, new tokens
    out, cache = tq.ragged_paged_attention(q, k, v, cache, kv_lens, block_tables, cu_q_lens)  # write + attend
    out, cache = tq.prompt_attention(q, k, v, cache, block_tables, prompt_lens)   # exact over the prompt
    cache = tq.fill_window(cache, block_tables, prefix_lens)   # shared prefix pages / rollback: windows from pages
    rows = tq.decode_rows(cache, block_tables, positions, seq_lens)   # or prompt_rows / chunk_rows / CacheRows(...)
    out, cache = tq.attend_rows(q, k, v, cache, rows)   # a decoder layer's write + attention, as rows say
    alloc = tq.PageAllocator(num_pages, page_size, max_pages_per_seq)   # host-side pages per sequence
    alloc.allocate(seq_id, num_tokens); alloc.extend(seq_id, new_total); alloc.free(seq_id)
    block_tables = alloc.block_tables(seq_ids)      # int32, -1 (never written or read) past a sequence's pages
    cache = tq.shard_cache(cache, mesh)             # KV heads over "model": jit runs each op per device slice

    prod = tq.TurboQuantProd(head_dim=128, bits=4)   # 3-bit mse codes + 1 QJL bit
    keys = tq.qjl_compress(k, prod)
    scores = tq.qjl_scores(q, keys, prod)            # unbiased <q, k>
    k_hat = tq.qjl_decompress(keys, prod)            # <q, k_hat> == scores
"""
from jax_tq._ffi import kernels_available
from jax_tq.allocator import OutOfPagesError, PageAllocator
from jax_tq._ffi import unavailable_reason as kernels_unavailable_reason
from jax_tq.backend import BackendUnavailableError, get_backend, use_backend
from jax_tq.checks import checked
from jax_tq.cache import PRESETS, CachePreset, PagedKVCache, get_preset, slot_mapping, write_cache
from jax_tq.codec import TurboQuant, TurboQuantProd
from jax_tq.compress import compress, decompress, window_rows
from jax_tq.format import window_slot_mapping
from jax_tq.paged_decode import paged_decode, plan_decode
from jax_tq.paged_prefill import paged_prefill
from jax_tq.qjl import QJLCodes, qjl_compress, qjl_decompress, qjl_scores
from jax_tq.ragged import prompt_attention, ragged_paged_attention
from jax_tq.cache_rows import CacheRows, attend_rows, chunk_rows, decode_rows, prompt_rows
from jax_tq.sharding import cache_partition_specs, shard_cache
from jax_tq.window import fill_window
from jax_tq import nn  # noqa: E402  (flax is imported only when nn needs it)

__version__ = "0.2.0"

__all__ = [
    "BackendUnavailableError",
    "CacheRows",
    "OutOfPagesError",
    "PageAllocator",
    "CachePreset",
    "PRESETS",
    "PagedKVCache",
    "QJLCodes",
    "TurboQuant",
    "TurboQuantProd",
    "attend_rows",
    "cache_partition_specs",
    "checked",
    "chunk_rows",
    "compress",
    "decode_rows",
    "decompress",
    "fill_window",
    "get_backend",
    "get_preset",
    "kernels_available",
    "kernels_unavailable_reason",
    "paged_decode",
    "paged_prefill",
    "plan_decode",
    "prompt_attention",
    "prompt_rows",
    "qjl_compress",
    "qjl_decompress",
    "qjl_scores",
    "ragged_paged_attention",
    "shard_cache",
    "slot_mapping",
    "use_backend",
    "window_rows",
    "window_slot_mapping",
    "write_cache",
]
