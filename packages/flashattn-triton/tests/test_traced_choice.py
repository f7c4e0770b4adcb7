"""Which ops a compiled graph calls (``Options.traced_compile``): the traced launchers
(``traced_ops``) or the opaque ones, by option, sizes, device, GPU kind and CUDA-graph hints.
Decided on fake CUDA tensors, so no GPU is needed."""

from __future__ import annotations

import pytest
import torch

import flashattn_triton as fa
from flashattn_triton import traced_ops


def test_cuda_graph_hint_applies_to_auto_only(set_options):
    """``for_cuda_graphs`` and inductor's CUDA graphs turn ``auto``'s traced calls into
    opaque ones; ``True`` (trace every call) and ``False`` are left as they are, and the
    hint ends with its block, nested blocks included."""
    from torch._inductor import config

    for setting in (True, False, "auto"):
        set_options(traced_compile=setting)
        assert not traced_ops._for_cuda_graphs()
        with fa.for_cuda_graphs():
            with fa.for_cuda_graphs():
                assert traced_ops._for_cuda_graphs() is (setting == "auto")
            assert traced_ops._for_cuda_graphs() is (setting == "auto")
        assert not traced_ops._for_cuda_graphs()
        with config.patch({"triton.cudagraphs": True}):
            assert traced_ops._for_cuda_graphs() is (setting == "auto")


def _cuda(*shape: int) -> torch.Tensor:
    """A fake CUDA tensor (no GPU needed): the launch choice reads only sizes and device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda")


@pytest.mark.parametrize(
    ("major", "block_kb", "fits", "limit_kb"),
    [
        (9, 227, True, 222),  # H100, H200
        (10, 227, True, 222),  # B200 (by the rule; untried)
        (8, 163, False, 158),  # A100
        (8, 99, False, 94),  # desktop Ampere / Ada
        (12, 99, False, 94),  # desktop Blackwell
    ],
)
def test_tables_fit_hopper_class_gpus_only(monkeypatch, major, block_kb, fits, limit_kb):
    """``auto`` traces on GPUs of compute capability 9+ with Hopper's 227 KB of shared memory
    per block (the tables' GPUs); traced tiles are fitted to a block's opt-in memory less the
    reserve, never above the tables' limit; CPU tensors are no such GPU."""
    from flashattn_triton import _device, configs

    monkeypatch.setattr(_device, "cuda_major", lambda i: major)
    monkeypatch.setattr(_device, "_cuda_smem_per_block", lambda i: block_kb * 1024)
    t = _cuda(1, 2, 64, 16)
    assert _device.tables_fit(t) is fits
    assert _device.smem_limit(t) == limit_kb * 1024 <= configs.SMEM_LIMIT_BYTES
    cpu = torch.empty(1)
    assert not _device.tables_fit(cpu)
    assert _device.smem_limit(cpu) == configs.SMEM_LIMIT_BYTES


def test_compiled_graphs_use_traced_ops_only_where_they_can(set_options):
    """The choice a compiled graph makes: the traced ops with ``traced_compile`` on (or
    ``auto`` and a small call), static sizes, CUDA tensors and no autotuning (the autotuner
    would time fake tensors); else the opaque ops."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    from flashattn_triton.autograd import _use_traced_ops

    real = _cuda(1, 2, 64, 16)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    sym = mode.from_tensor(
        torch.empty(1, 2, 64, 16), source=ConstantSource("q"), symbolic_context=ctx
    )
    cpu = torch.empty(1, 2, 64, 16)
    # (``cpp_launch_compiled``, on by default, keeps ``auto`` off calls the C++ path serves
    # where its Triton is supported: ``test_cpp_launch_ops``)
    set_options(traced_compile=False, cpp_launch_compiled=False)
    assert not _use_traced_ops(True, real, real)
    for on in (True, "auto"):
        set_options(traced_compile=on, autotune=False)
        assert _use_traced_ops(True, real, real)
        assert not _use_traced_ops(True, sym, real)
        assert not _use_traced_ops(True, cpu, cpu)  # the interpreter's launches need addresses
        set_options(traced_compile=on, autotune=True)
        assert not _use_traced_ops(True, real, real)


def test_auto_traces_calls_up_to_the_work_limit(set_options):
    """``traced_compile="auto"`` traces a call of B * H * Nq * Nk * d (halved when causal)
    up to ``TRACED_MAX_WORK`` and keeps the opaque ops above it; the key length and the
    query heads count (not the key / value heads of grouped-query attention)."""
    from flashattn_triton.autograd import _use_traced_ops
    from flashattn_triton.configs import TRACED_MAX_WORK

    set_options(traced_compile="auto", cpp_launch_compiled=False)  # (see the test above)

    shape = _cuda

    # the small model's call (4 x 12 heads, 1024 tokens, d = 64), causal and not
    q = shape(4, 12, 1024, 64)
    assert _use_traced_ops(True, q, q)
    assert _use_traced_ops(False, q, q)
    # exactly at the limit (2 * 32 x 2048 x 2048 x 64 / 2 = 2**32), then one key more
    q = shape(1, 32, 2048, 64)
    assert TRACED_MAX_WORK == 32 * 2048 * 2048 * 64 // 2
    assert _use_traced_ops(True, q, q)
    assert not _use_traced_ops(False, q, q)
    assert not _use_traced_ops(True, q, shape(1, 32, 2049, 64))
    # grouped-query heads: the work is the query heads'
    assert not _use_traced_ops(True, shape(1, 64, 2048, 64), shape(1, 8, 2048, 64))
    # the 8B model's call stays opaque; a short decode-like query against a long cache too
    assert not _use_traced_ops(True, shape(1, 32, 32768, 128), shape(1, 8, 32768, 128))
    assert _use_traced_ops(True, shape(1, 32, 1, 128), shape(1, 32, 32768, 128))


def test_traced_compile_option_from_env():
    from flashattn_triton.options import from_env

    assert from_env({"FLASHATTN_TRITON_TRACED_COMPILE": "1"}).traced_compile is True
    assert from_env({"FLASHATTN_TRITON_TRACED_COMPILE": "off"}).traced_compile is False
    assert from_env({"FLASHATTN_TRITON_TRACED_COMPILE": " Auto "}).traced_compile == "auto"
    assert from_env({}).traced_compile == fa.Options().traced_compile == "auto"
    with pytest.raises(ValueError, match="FLASHATTN_TRITON_TRACED_COMPILE"):
        from_env({"FLASHATTN_TRITON_TRACED_COMPILE": "maybe"})


@pytest.mark.parametrize("bad", ["sometimes", 1, 0, None, "True"])
def test_traced_compile_option_refuses_other_values(bad):
    with pytest.raises(ValueError, match="traced_compile"):
        fa.Options(traced_compile=bad)
