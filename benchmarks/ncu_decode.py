"""One decode call per shape for Nsight Compute (the first call warms up, the second is profiled).

Usage: ncu --clock-control none -k regex:paged_decode --launch-skip 2 --launch-count 2 \
           --section SpeedOfLight ... python3 benchmarks/ncu_decode.py [32x8192[:splits] ...]
"""
from __future__ import annotations

import argparse

import jax

import jax_tq as tq
from profile_kernels import decode_inputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=["32x8192"], help="NUM_SEQSxSEQ_LEN[:NUM_SPLITS] (default 32x8192)")
    for spec in ap.parse_args().shapes:
        shape, _, splits = spec.partition(":")
        num_seqs, seq_len = (int(v) for v in shape.split("x"))
        decode = jax.jit(lambda *a, ns=int(splits) if splits else None: tq.paged_decode(*a, num_splits=ns))
        args = decode_inputs(num_seqs, seq_len, jax.random.PRNGKey(0))
        for _ in range(2):
            jax.block_until_ready(decode(*args))
    print("ncu_decode: done")


if __name__ == "__main__":
    main()
