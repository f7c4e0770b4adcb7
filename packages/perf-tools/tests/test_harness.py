"""The measurement harness: failure rows, release between cells, progress, collective timing."""

from __future__ import annotations

import datetime
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from perf_tools import _dist, harness


def test_failure_status_names_what_happened():
    assert harness.failure_status(torch.OutOfMemoryError("CUDA out of memory")) == "OOM"
    assert harness.failure_status(MemoryError()) == "OOM"
    assert harness.failure_status(RuntimeError("boom\nmore")) == "error: RuntimeError: boom"
    assert harness.failure_status(TimeoutError("ranks [1] hung")) == "timeout: ranks [1] hung"
    assert len(harness.failure_status(ValueError("x" * 500))) == 200

    def classify(exc):
        return harness.unsupported_status(exc) if isinstance(exc, TypeError) else None

    assert harness.failure_status(TypeError("fp32 on flash"), classify) == (
        "unsupported: fp32 on flash"
    )
    assert harness.failure_status(ValueError("bad"), classify) == "error: ValueError: bad"
    # OOM wins over the command's own classification
    assert harness.failure_status(torch.OutOfMemoryError("out of memory"), classify) == "OOM"


def test_failure_status_of_spawned_ranks_is_their_last_traceback_line():
    from ddp_kit.launch import WorkerError

    text = (
        "spawned worker(s) failed:\n--- rank 1 raised:\nTraceback (most recent call last):\n"
        "  File \"x.py\", line 1, in f\nValueError: attention: expected naive, got 'nope'\n"
    )
    assert harness.failure_status(WorkerError(text)) == (
        "error: ValueError: attention: expected naive, got 'nope'"
    )
    oom = text.replace("ValueError: attention", "torch.OutOfMemoryError: CUDA out of memory")
    assert harness.failure_status(WorkerError(oom)) == "OOM"


def test_has_errors():
    assert not harness.has_errors([{"status": "ok"}, {"status": "OOM"}, {"status": "skipped: x"}])
    assert not harness.has_errors([{"status": "unsupported: fp32"}])
    assert harness.has_errors([{"status": "ok"}, {"status": "error: RuntimeError: boom"}])
    assert harness.has_errors([{"status": "timeout: ranks [0] hung"}])


def test_sweep_rows_failures_cleanup_and_progress(capsys):
    steps, cleaned = [], []

    def cell(i):
        if i == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        if i == 2:
            raise RuntimeError("boom")
        return {"ms": float(i)}

    rows = []
    with harness.Sweep(4, "test", device="cpu", advance=steps.append) as sweep:
        for i in range(4):
            rows.append(sweep.measure(lambda i=i: cell(i), cleanup=lambda i=i: cleaned.append(i)))
    assert rows == [
        {"status": "ok", "ms": 0.0},
        {"status": "OOM"},
        {"status": "error: RuntimeError: boom"},
        {"status": "ok", "ms": 3.0},
    ]
    assert cleaned == [0, 1, 2, 3]  # after failures too
    assert steps == [1, 1, 1, 1]
    err = capsys.readouterr().err
    assert "RuntimeError: boom" in err  # an error's traceback goes to stderr
    assert "OutOfMemoryError" not in err  # an OOM is a result, not an error


def _boom():
    raise RuntimeError("boom")


def test_sweep_fatal_failure_stops_after_cleanup():
    cleaned = []
    sweep = harness.Sweep(2, "test", device="cpu", quiet=True, fatal=lambda e: True)
    with pytest.raises(RuntimeError, match="boom"):
        sweep.measure(_boom, cleanup=lambda: cleaned.append(1))
    assert cleaned == [1]


def test_sweep_attempt_for_a_shared_build():
    sweep = harness.Sweep(2, "test", device="cpu", quiet=True)
    assert sweep.attempt(lambda: 7) == (7, None)
    assert sweep.attempt(lambda: 1 / 0) == (None, "error: ZeroDivisionError: division by zero")


def test_release_collects_reference_cycles():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    del a, b
    gc.disable()
    try:
        assert ref() is not None
        harness.release("cpu")
        assert ref() is None
    finally:
        gc.enable()


def test_quiet_progress_prints_nothing(capsys):
    with harness.progress(3, "quiet", quiet=True) as bar:
        bar.update(3)
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""


def test_cells_by_groups_in_first_seen_order():
    groups = list(harness.cells_by(["a1", "b1", "a2", "c1", "b2"], lambda s: s[0]))
    assert groups == [("a", ["a1", "a2"]), ("b", ["b1", "b2"]), ("c", ["c1"])]


def test_time_collective_on_one_gloo_rank(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        x = torch.ones(1024)
        times = _dist.time_collective(lambda: dist.all_reduce(x), 3, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert len(times) == 3
    assert all(t > 0 for t in times)
