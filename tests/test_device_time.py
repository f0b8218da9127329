"""The benchmark's device-time helpers (benchmarks/device_time.py): repetitions told apart by idle
gaps on the GPU timeline, spans from first start to last end."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
device_time = pytest.importorskip("device_time")


def _kernel(ts, dur, name="k"):
    return {"name": name, "ts": float(ts), "dur": float(dur)}


def test_split_runs_separates_repetitions_at_idle_gaps():
    # two repetitions of three kernels; a long kernel overlapping the next start stays in its run
    kernels = [_kernel(0, 10), _kernel(12, 500), _kernel(520, 5),
               _kernel(5000, 7), _kernel(5010, 3), _kernel(5400, 2)]
    runs = device_time.split_runs(kernels, gap_us=1000.0)
    assert [len(r) for r in runs] == [3, 3]
    assert device_time.span_us(runs[0]) == pytest.approx(525.0)
    assert device_time.span_us(runs[1]) == pytest.approx(402.0)


def test_split_runs_measures_gap_from_latest_end():
    # the second kernel ends last; the third starts 900 us after that end (same run), the fourth
    # 1100 us after the third's end (a new run)
    kernels = [_kernel(0, 2000), _kernel(10, 3000), _kernel(3900, 100), _kernel(5100, 1)]
    runs = device_time.split_runs(kernels, gap_us=1000.0)
    assert [len(r) for r in runs] == [3, 1]


def test_device_seconds_per_call_without_gpu_events_is_none():
    if any(d.platform == "gpu" for d in __import__("jax").devices()):
        pytest.skip("a GPU is present: the trace has kernel events")
    assert device_time.device_seconds_per_call(lambda: None, calls_per_run=4, repeats=2) is None


def test_gpu_kernel_events_keeps_stream_lines_only(tmp_path):
    import gzip
    import json
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Kernel,MemcpyD2D)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    events = [
        {"ph": "X", "pid": 2, "tid": 7, "name": "late", "ts": 50.0, "dur": 4.0},
        {"ph": "X", "pid": 2, "tid": 7, "name": "early", "ts": 10.0, "dur": 30.0},
        {"ph": "X", "pid": 2, "tid": 7, "name": "instant", "ts": 60.0, "dur": 0.0},
        {"ph": "X", "pid": 2, "tid": 8, "name": "fusion op line", "ts": 10.0, "dur": 44.0},
        {"ph": "X", "pid": 1, "tid": 3, "name": "host", "ts": 0.0, "dur": 100.0},
    ]
    run_dir = tmp_path / "plugins" / "profile" / "run"
    run_dir.mkdir(parents=True)
    with gzip.open(run_dir / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    kernels, processes = device_time.gpu_kernel_events(str(tmp_path))
    assert [k["name"] for k in kernels] == ["early", "late"]
    assert "/device:GPU:0" in processes
    assert device_time.span_us(kernels) == pytest.approx(44.0)


@pytest.mark.gpu
def test_device_time_on_the_gpu_sees_every_program_kernel():
    """On a GPU: the trace holds the program's kernels, one group per repetition; a repetition's
    span covers its kernels' busy time, and the span per call is below the host-clock time."""
    import time

    import jax
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs a CUDA GPU")
    a0 = jax.random.normal(jax.random.PRNGKey(0), (2048, 2048), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (2048, 2048), jnp.float32) / 64
    calls = 4

    @jax.jit
    def program(a):
        for _ in range(calls):
            a = jnp.tanh(a @ w)  # dependent matrix products: at least one kernel per call
        return a

    def run():
        jax.block_until_ready(program(a0))

    run()
    t0 = time.perf_counter()
    run()
    host = (time.perf_counter() - t0) / calls
    runs = device_time.traced_runs(run, repeats=3)
    assert runs is not None and len(runs) == 3
    for r in runs:
        assert len(r) >= calls
        assert device_time.span_us(r) >= 0.99 * sum(e["dur"] for e in r)
    per_call = device_time.device_seconds_per_call(run, calls)
    assert 0 < per_call <= 1.5 * host


def test_phase_trace_report_counts_items_with_fewer_warps(capsys):
    """benchmarks/phase_trace.py's report: with 4 or 8 work items per CTA an item has 4 or 2 warps,
    whose other trace slots stay 0; such items are reported (not dropped as unwritten), from their
    stamped warps only."""
    phase_trace = pytest.importorskip("phase_trace")
    np = pytest.importorskip("numpy")
    stamps = np.zeros((2048, 8, phase_trace.STAMPS), np.uint64)
    sm_ids = np.zeros(2048, np.uint64)
    base = 10_000_000
    for item in range(8):  # one CTA of 8 items with 2 warps each, on SM 3
        for warp in range(2):
            stamps[item, warp] = base + 1000 * np.array([0, 1, 2, 5] + [70 + k / 2 + item + warp for k in range(5)] + [73 + item + warp])
        sm_ids[item] = 3
    phase_trace.report(stamps, sm_ids)
    out = capsys.readouterr().out
    assert "work items traced: 8 on 1 SMs, 2-2 warps each" in out
    assert "kernel span: 81.00 us" in out  # item 7, warp 1: 73 + 7 + 1
    assert "no trace written" not in out
    phase_trace.report(np.zeros_like(stamps), sm_ids)
    assert "no trace written" in capsys.readouterr().out
