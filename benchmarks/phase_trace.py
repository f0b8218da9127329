"""Where the head_dim-128 decode kernel's time goes: the float16 tensor-core kernel's phase trace.

For each warp of each CTA of one decode call the kernel records %globaltimer (and %smid) at its
start, when its first small reads have landed, when q is staged and its first copies are issued,
when the tables are built (its tile loop starts), when its tile loop ends, at four points of the
epilogue (past its first barrier; o_s written and past the second; the row merged over the warps;
rotated back: the fused per-warp epilogue, which the issue's benchmark runs) and at its end. This
prints, in us from the first CTA's start, percentiles over the CTAs of each phase and of each
epilogue step, the spread of the warps' loop ends inside a CTA, and how the CTAs' end times go with
their SM (whether the two CTAs of an SM end alike). A diagnostic of a GPU build
(benchmarks/profile_kernels.py's inputs, Hadamard codecs). The timer ticks in ~0.26 us steps.

Usage (a build with the trace: JAX_TQ_TRACE_PHASES=ON pip install --no-build-isolation -e .):
  python3 benchmarks/phase_trace.py [32x8192[:splits] ...]
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

import jax_tq as tq
from jax_tq import _ffi
from profile_kernels import decode_inputs

CTAS, WARPS, STAMPS = 2048, 8, 10
PHASES = ("first reads landed", "q staged, copies issued", "tables built", "loop end", "merge: l, barrier 1",
          "merge: o_s, barrier 2", "merged over warps", "rotated back", "end")


def read_trace():
    """(globaltimer ns, SM id), uint64 [CTAS, WARPS, STAMPS] each, of the calls since the last
    read (0 = not written), then cleared."""
    raw = np.frombuffer(_ffi.cuda_module().phase_trace(), np.uint64).reshape(CTAS, WARPS, STAMPS, 2)
    return raw[..., 0], raw[:, 0, 0, 1]


def pct(values, qs=(0, 10, 50, 90, 100)):
    return " ".join(f"p{q}={np.percentile(values, q):7.2f}" for q in qs)


def report(stamps, sm_ids):
    """Print the percentiles of one trace: stamps uint64 [CTAS, WARPS, STAMPS] (0 = not written),
    sm_ids [CTAS]. A work item counts where its warp 0 stamped every phase; of its warps, those
    that stamped every phase (all 8 with one or two items per CTA, 4 or 2 with 4 or 8 items)."""
    warps_written = (stamps > 0).all(axis=2)
    written = warps_written[:, 0]
    t = np.where(warps_written[written][..., None], stamps[written].astype(np.float64), np.nan)
    sm = sm_ids[written]
    if not len(t):
        print("  no trace written (another kernel than the float16 tensor-core one)")
        return
    t = (t - np.nanmin(t[:, :, 0])) / 1e3  # us from the first CTA's start
    start, end = np.nanmin(t[:, :, 0], axis=1), np.nanmax(t[:, :, -1], axis=1)
    warps = warps_written[written].sum(axis=1)
    print(f"  work items traced: {len(t)} on {len(np.unique(sm))} SMs, {int(warps.min())}-{int(warps.max())} warps "
          f"each; kernel span: {end.max():.2f} us")
    print(f"  {'CTA start':26s}{pct(start)}")
    for k, name in enumerate(PHASES, start=1):
        print(f"  {name + ' (latest warp)':26s}{pct(np.nanmax(t[:, :, k], axis=1))}")
    loop_end = t[:, :, 4]
    print(f"  {'loop end spread in a CTA':26s}{pct(np.nanmax(loop_end, axis=1) - np.nanmin(loop_end, axis=1))}")
    print(f"  {'epilogue':26s}{pct(end - np.nanmax(loop_end, axis=1))}")
    latest = np.nanmax(t, axis=1)
    for k in range(5, STAMPS):
        print(f"  {'step to ' + PHASES[k - 1]:26s}{pct(latest[:, k] - latest[:, k - 1])}")
    by_sm = {}
    for s_id, e in zip(sm, end):
        by_sm.setdefault(int(s_id), []).append(e)
    spread = np.array([max(v) - min(v) for v in by_sm.values() if len(v) > 1])
    if len(spread):
        print(f"  SMs with several work items: {len(spread)}; end spread on an SM {pct(spread)}")
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
    if not hasattr(_ffi.cuda_module(), "phase_trace"):
        raise SystemExit("this build has no phase trace: reinstall with JAX_TQ_TRACE_PHASES=ON")
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
