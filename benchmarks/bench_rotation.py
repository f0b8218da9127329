"""The query / output rotation of paged_decode on its own: x [num_seqs, num_heads, head_dim] f32
times Pi^T [head_dim, head_dim], at each ``jax.lax.Precision``: GPU time per rotation (device
span of a chain of rotations / their count, benchmarks/device_time.py) and the largest error
against float64, relative to the largest output element.

The decode shapes: num_heads 32, head_dim 128, num_seqs 1, 8, 32, 64, 128.

Usage: python benchmarks/bench_rotation.py
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq

import device_time

NUM_HEADS, HEAD_DIM, CHAIN = 32, 128, 16
PRECISIONS = ("highest", "high", "default")


def rotation_chain(precision):
    """CHAIN dependent rotations of x, as one program (each one's input is the last output)."""
    def run(x, rot):
        for _ in range(CHAIN):
            x = jnp.einsum("shd,ed->she", x, rot, precision=precision)
        return x
    return jax.jit(run)


def relative_error(x, rot, precision):
    got = np.asarray(jnp.einsum("shd,ed->she", x, rot, precision=precision), np.float64)
    want = np.einsum("shd,ed->she", np.asarray(x, np.float64), np.asarray(rot, np.float64))
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def main():
    rot = jnp.asarray(tq.TurboQuant(head_dim=HEAD_DIM, bits=4, seed=0).rotation, jnp.float32)
    print("| num_seqs | precision | us per rotation (GPU) | max error / max output |")
    print("|---:|---|---:|---:|")
    for num_seqs in (1, 8, 32, 64, 128):
        x = jax.random.normal(jax.random.PRNGKey(num_seqs), (num_seqs, NUM_HEADS, HEAD_DIM), jnp.float32)
        for precision in PRECISIONS:
            chain = rotation_chain(precision)
            jax.block_until_ready(chain(x, rot))
            seconds = device_time.device_seconds_per_call(lambda: jax.block_until_ready(chain(x, rot)), CHAIN)
            us = float("nan") if seconds is None else seconds * 1e6
            print(f"| {num_seqs} | {precision} | {us:.2f} | {relative_error(x, rot, precision):.1e} |")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    main()
