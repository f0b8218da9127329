"""benchmarks/bench_sharded.py (issue 34's decode step on several devices) on 2 host CPU devices: the
sharded chain equals the one-device chain and its compiled program has no collective. Runs in a
subprocess (the device count is fixed at JAX start)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", ["k4v4", "none"])
def test_sharded_decode_chain_equals_one_device_without_collectives(preset):
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import bench_sharded as b; "
            f"r = b.main(['--shape', '4x80', '--heads', '4/2', '--head-dim', '64', '--preset', '{preset}', "
            "'--steps', '3', '--reps', '1', '--devices', '2']); "
            "assert not r['collectives'], r['collectives']; assert r['diff'] < 1e-5, r['diff']; print('ok')")
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
