"""Where the head_dim-128 split kernel's time goes: v4's phase trace (JAX_TQ_TRACE_PHASES=1).

For each warp of each CTA of one decode call the kernel records %globaltimer (and %smid) at its
start, when its first small reads have landed, when q is staged and its first copies are issued,
when the tables are built (its tile loop starts), when its tile loop ends, and at its end (after
the merge and the fused epilogue). This prints, in us from the first CTA's start, percentiles over
the CTAs of each phase, the spread of the warps' loop ends inside a CTA, and how the CTAs' end
times go with their SM (whether the two CTAs of an SM end alike). A diagnostic of a GPU build
(benchmarks/profile_kernels.py's inputs, Hadamard codecs). The timer ticks in ~0.26 us steps.

Usage: JAX_TQ_TRACE_PHASES=1 python3 benchmarks/phase_trace.py [32x8192[:splits] ...]
"""
from __future__ import annotations

import argparse
import os

import jax
import numpy as np

import jax_tq as tq
from jax_tq import _ffi
from profile_kernels import decode_inputs

CTAS, WARPS, STAMPS = 2048, 8, 6
PHASES = ("first reads landed", "q staged, copies issued", "tables built", "loop end", "end")


def read_trace():
    """(globaltimer ns, SM id), uint64 [CTAS, WARPS, STAMPS] each, of the calls since the last
    read (0 = not written), then cleared."""
    raw = np.frombuffer(_ffi.cuda_module().phase_trace(), np.uint64).reshape(CTAS, WARPS, STAMPS, 2)
    return raw[..., 0], raw[:, 0, 0, 1]


def pct(values, qs=(0, 10, 50, 90, 100)):
    return " ".join(f"p{q}={np.percentile(values, q):7.2f}" for q in qs)


def report(stamps, sm_ids):
    written = (stamps > 0).all(axis=(1, 2))
    t, sm = stamps[written].astype(np.float64), sm_ids[written]
    if not len(t):
        print("  no trace written (a non-v4 kernel, or JAX_TQ_TRACE_PHASES unset)")
        return
    t = (t - t[:, :, 0].min()) / 1e3  # us from the first CTA's start
    start, end = t[:, :, 0].min(axis=1), t[:, :, -1].max(axis=1)
    print(f"  CTAs traced: {len(t)} on {len(np.unique(sm))} SMs; kernel span: {end.max():.2f} us")
    print(f"  {'CTA start':26s}{pct(start)}")
    for k, name in enumerate(PHASES, start=1):
        print(f"  {name + ' (latest warp)':26s}{pct(t[:, :, k].max(axis=1))}")
    loop_end = t[:, :, 4]
    print(f"  {'loop end spread in a CTA':26s}{pct(loop_end.max(axis=1) - loop_end.min(axis=1))}")
    print(f"  {'epilogue':26s}{pct(end - loop_end.max(axis=1))}")
    by_sm = {}
    for s_id, e in zip(sm, end):
        by_sm.setdefault(int(s_id), []).append(e)
    pairs = np.array([sorted(v) for v in by_sm.values() if len(v) == 2])
    if len(pairs):
        print(f"  SMs with two CTAs: {len(pairs)}; their CTAs' end times: earlier {pct(pairs[:, 0])}")
        print(f"  {'':26s}later   {pct(pairs[:, 1])}")
        print(f"  correlation of the two CTAs' ends on an SM: {np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]:.2f}")
        slow = sorted(by_sm, key=lambda k: -max(by_sm[k]))[:16]
        print("  slowest SMs (id: CTA ends):", "; ".join(f"{k}: {', '.join(f'{e:.1f}' for e in by_sm[k])}"
                                                        for k in slow))
        fast = sorted(by_sm, key=lambda k: max(by_sm[k]))[:12]
        print("  fastest SMs (id: CTA ends):", "; ".join(f"{k}: {', '.join(f'{e:.1f}' for e in by_sm[k])}"
                                                        for k in fast))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=["32x8192"], help="NUM_SEQSxSEQ_LEN[:NUM_SPLITS]")
    if os.environ.get("JAX_TQ_TRACE_PHASES") != "1":
        raise SystemExit("set JAX_TQ_TRACE_PHASES=1")
    for spec in ap.parse_args().shapes:
        shape, _, splits = spec.partition(":")
        num_seqs, seq_len = (int(v) for v in shape.split("x"))
        decode = jax.jit(lambda *a, ns=int(splits) if splits else None: tq.paged_decode(*a, num_splits=ns))
        args = decode_inputs(num_seqs, seq_len, jax.random.PRNGKey(0), rotation="hadamard")
        for _ in range(3):
            jax.block_until_ready(decode(*args))
        read_trace()  # drop the warm-up calls' stamps
        jax.block_until_ready(decode(*args))
        print(f"== {spec}")
        report(*read_trace())


if __name__ == "__main__":
    main()
