"""The Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), float32, small.

Tolerance: the interpreter computes in float32 with numpy (no tf32 rounding), so results
match a float64 reference to float32 rounding: < 1e-5 relative (measured ~1e-6).
Small tile overrides force several tiles per sequence, so the causal split into unmasked and
diagonal tiles, ragged last tiles and tile skipping all run.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from flashattn_testutil import reference_fwd_bwd, rel_err, run_fwd_bwd, saved_lse

from flashattn_triton import (
    FlashAttention2Triton,
    configs,
    flash_attention,
    launch,
    launch_backward,
    launch_common,
    options,
)

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available() or not launch.interpreting(),
        reason="needs TRITON_INTERPRET=1 on a machine without a GPU (set by tests/conftest.py)",
    ),
    # log2(0) = -inf is the intended L of rows that see no key; numpy warns about it.
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
]

SMALL_TILES = {
    "fwd.fp32": configs.TileConfig(32, 16, 4, 2),
    "dkdv.fp32": configs.TileConfig(16, 32, 4, 2),
    "dq.fp32": configs.TileConfig(32, 16, 4, 2),
    "fused.fp32": configs.TileConfig(16, 32, 4, 2, block_n2=16),
    "atomic.fp32": configs.TileConfig(16, 32, 4, 2),
}


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(configs, "OVERRIDES", dict(SMALL_TILES))


def _inputs(lead, n_q, n_k, d, dtype=torch.float32):
    q = torch.randn(*lead, n_q, d, dtype=dtype)
    k = torch.randn(*lead, n_k, d, dtype=dtype)
    v = torch.randn(*lead, n_k, d, dtype=dtype)
    do = torch.randn(*lead, n_q, d, dtype=dtype)
    return q, k, v, do


def _check(q, k, v, do, causal, tol=1e-5):
    ref = reference_fwd_bwd(q, k, v, do, causal)
    out = run_fwd_bwd(FlashAttention2Triton.apply, q, k, v, do, causal)
    for name in ("o", "dq", "dk", "dv"):
        assert torch.isfinite(out[name]).all(), name
        assert rel_err(out[name], ref[name]) < tol, (name, rel_err(out[name], ref[name]))
    o = FlashAttention2Triton.apply(q.detach().requires_grad_(), k, v, causal)
    lse = saved_lse(o, q)
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isneginf(lse), ~fin), "rows without keys must have L = -inf"
    assert torch.allclose(lse[fin].double(), ref["lse"][fin], rtol=0, atol=1e-5)


CASES = [
    # lead, Nq, Nk, d, causal
    ((2,), 1, 1, 16, True),
    ((2,), 97, 97, 16, True),
    ((1,), 130, 130, 32, False),
    ((2,), 40, 70, 16, True),  # causal Nq < Nk (bottom-right)
    ((2,), 70, 40, 16, True),  # causal Nq > Nk: empty rows
    ((1,), 33, 65, 24, False),  # d padded 24 -> 32
]


@pytest.mark.parametrize(("lead", "n_q", "n_k", "d", "causal"), CASES)
def test_split_backward_small_tiles(lead, n_q, n_k, d, causal, small_tiles):
    _check(*_inputs(lead, n_q, n_k, d), causal)


@pytest.mark.parametrize(
    ("n_q", "n_k", "causal", "d"),
    [(97, 97, True, 16), (70, 40, True, 16), (33, 50, False, 16), (70, 70, True, 96)],
)
def test_split_backward_gets_delta_from_the_dq_kernel(
    n_q, n_k, causal, d, monkeypatch, set_options
):
    """The split backward launches dQ first; up to FUSED_DELTA_MAX_D that kernel stores D =
    rowsum(dO * O) for the dK/dV kernel (no preprocessing launch), above it D comes from the
    preprocessing kernel. Either way dK, dV (which read D) match the reference."""
    set_options(backward="split")
    monkeypatch.setattr(configs, "OVERRIDES", dict(SMALL_TILES))
    kern = launch._kernels()
    pre = kern.attn_bwd_preprocess_kernel
    pre_grids = []

    class Spy:
        def __getitem__(self, grid):
            pre_grids.append(grid)
            return pre[grid]

    monkeypatch.setattr(kern, "attn_bwd_preprocess_kernel", Spy())
    kinds = []
    run = launch._run

    def spy_run(kind, *args, **kwargs):
        kinds.append(kind)
        return run(kind, *args, **kwargs)

    for module in (launch, launch_backward):  # the forward's kernels, the backward's
        monkeypatch.setattr(module, "_run", spy_run)
    _check(*_inputs((2,), n_q, n_k, d), causal)
    assert kinds[:3] == ["fwd", "dq", "dkdv"], kinds
    fused = configs.block_d_for(d) <= configs.FUSED_DELTA_MAX_D
    assert len(pre_grids) == (0 if fused else 1), pre_grids  # _check runs one backward


@pytest.mark.parametrize("scheme", ["fused", "atomic"])
@pytest.mark.parametrize(
    ("n_q", "n_k", "causal"), [(97, 97, True), (70, 40, True), (33, 50, False)]
)
def test_other_backward_schemes(scheme, n_q, n_k, causal, small_tiles, monkeypatch, set_options):
    set_options(backward=scheme)
    _check(*_inputs((2,), n_q, n_k, 16), causal)


@pytest.mark.parametrize(
    ("n_q", "n_k", "causal"), [(97, 97, True), (70, 40, True), (33, 50, False)]
)
def test_small_grid_path(n_q, n_k, causal, monkeypatch):
    """With one SM every causal grid here is small: the launches say so (tiles adapted by
    configs.for_small_grid) and the results still match the reference; non-causal grids do
    not count as small."""
    for module in (launch, launch_backward):
        monkeypatch.setattr(module, "sm_count", lambda t: 1)
    monkeypatch.setattr(configs, "SMALL_GRID_MIN_SEQ", 1)
    seen = []
    run = launch._run

    def spy(kind, *args, **kwargs):
        seen.append((kind, kwargs.get("small_grid", False)))
        return run(kind, *args, **kwargs)

    for module in (launch, launch_backward):
        monkeypatch.setattr(module, "_run", spy)
    _check(*_inputs((2,), n_q, n_k, 16), causal)
    kinds = {kind for kind, _ in seen}
    assert kinds == {"fwd", "dkdv", "dq"}  # float32: the split backward
    assert all(small == causal for _, small in seen), seen


@pytest.mark.parametrize("flags", [("tma",), ("ws",), ("tma", "ws"), ("reg",), ("tma", "reg")])
@pytest.mark.parametrize(
    ("n_q", "n_k", "d", "causal"), [(97, 97, 16, True), (70, 40, 24, True), (33, 50, 16, False)]
)
def test_tma_and_warp_spec_paths(flags, n_q, n_k, d, causal, monkeypatch):
    """The TMA-descriptor loads (ragged rows and padded head dims read as zeros), the
    warp-specialize loop flag and register A operands give the same results as the pointer
    path (``reg`` is ignored by the forward)."""
    tiles = {
        kind: replace(cfg, tma="tma" in flags, ws="ws" in flags, reg="reg" in flags)
        for kind, cfg in SMALL_TILES.items()
        if kind.split(".")[0] in ("fwd", "dkdv", "dq")
    }
    monkeypatch.setattr(configs, "OVERRIDES", tiles)
    q, k, v, do = _inputs((2,), n_q, n_k, d)
    if "tma" in flags:
        assert launch.tma_usable(q)
    _check(q, k, v, do, causal)


@pytest.mark.parametrize(
    ("n_q", "n_k", "causal"), [(97, 97, True), (70, 40, True), (33, 50, False)]
)
def test_atomic_backward_with_tma_reduction(n_q, n_k, causal, monkeypatch, set_options):
    """The atomic backward with ``tma``: Q and dO stream through TMA descriptors; the
    interpreter has no TMA reductions, so dQ falls back to element atomics (the reduction
    itself is checked by the GPU tests)."""
    monkeypatch.setattr(
        configs, "OVERRIDES", {"atomic.fp32": replace(SMALL_TILES["atomic.fp32"], tma=True)}
    )
    set_options(backward="atomic")
    _check(*_inputs((2,), n_q, n_k, 24), causal)


def test_onepass_setting_off_hopper_runs_what_auto_picks(set_options):
    """``backward="onepass"`` where the one-pass Gluon kernel cannot run (here: the CPU)
    takes the scheme ``auto`` would, with the same results."""
    set_options(backward="onepass")
    _check(*_inputs((2,), 70, 70, 16), True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_onepass_plan_falls_back_to_split(deterministic, monkeypatch, set_options):
    """A backward planned as one-pass (faked: the kernel needs a Hopper GPU) whose kernel
    does not run (a failed compile) gives the split kernels' results; in torch's
    deterministic mode the one-pass kernel is not even tried."""
    from flashattn_triton import launch_backward

    tried = []

    class FakeOnepass:
        @staticmethod
        def try_onepass(*args):
            tried.append(args[0].shape)
            return False

    monkeypatch.setattr(launch_backward, "_onepass_applies", lambda *a: True)
    monkeypatch.setattr(launch_backward, "_gluon_bwd", lambda: FakeOnepass)
    set_options(backward="auto")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        _check(*_inputs((2,), 70, 70, 16), True)
    finally:
        torch.use_deterministic_algorithms(was)
    assert len(tried) == (0 if deterministic else 1)


@pytest.mark.parametrize("group", ["1", "2", "3"])
@pytest.mark.parametrize("causal", [True, False])
def test_head_grouped_launch_order(group, causal, small_tiles, monkeypatch, set_options):
    """Programs launched a few heads at a time (5 heads: the last group is partial) still
    cover every tile of every head exactly once, forward and backward."""
    set_options(head_group=group)
    _check(*_inputs((5,), 70, 70, 16), causal)


def test_head_group_setting(set_options):
    mb = 1 << 20
    assert configs.head_group(64, 8 * mb, 50 * mb) == 3  # half of L2 / 8 MB per head
    assert configs.head_group(64, 8 * mb, 0) == 64  # L2 unknown: plain order
    assert configs.head_group(16, 4 * mb, 50 * mb) == 16  # 64 MB: under four times L2
    assert configs.head_group(50, 4 * mb, 50 * mb) == 50  # 200 MB: still plain
    assert configs.head_group(51, 4 * mb, 50 * mb) == 6  # 204 MB
    assert configs.head_group(16, 64 * mb, 50 * mb) == 1
    for spec, want in (("off", 16), ("3", 3), (3, 3), ("40", 16)):
        setting = options.Options(head_group=spec).head_group
        assert configs.head_group(16, 4 * mb, 50 * mb, setting) == want
    for bad in ("0", "fast", "-2", 0, True):
        with pytest.raises((ValueError, TypeError), match="head_group"):
            set_options(head_group=bad)
        with pytest.raises(ValueError, match="FLASHATTN_TRITON_HEAD_GROUP"):
            options.from_env({"FLASHATTN_TRITON_HEAD_GROUP": str(bad)})


def test_head_group_args_off_gpu(monkeypatch, set_options):
    """No L2 size off-GPU: auto keeps the plain order; a forced count still groups."""
    x = torch.zeros(2, 3, 10, 16)
    set_options(head_group="auto")
    assert launch.head_group_args(x, 6, 10, 16) == {"head_group": 6, "GROUPED": False}
    set_options(head_group="4")
    assert launch.head_group_args(x, 6, 10, 16) == {"head_group": 4, "GROUPED": True}


@pytest.mark.parametrize("packed", [False, True])
def test_row_stats_padding(packed):
    """The backward's L / L in log2 units / D rows: as is for whole multiples of STATS_ROWS,
    else padded with L = +inf in both forms (P = 0 in padding rows, never NaN) and D = 0,
    the real L kept. Packed, the last two are the halves of one (B, H, 2, rows) buffer."""
    rows = configs.STATS_ROWS
    lse = torch.randn(2, 3, rows)
    same, lse2, delta, stride = launch_backward._stats_buffers(lse, rows, packed)
    assert same.data_ptr() == lse.data_ptr()
    assert lse2.shape == delta.shape == lse.shape
    assert stride == (2 * rows if packed else rows) == lse2.stride(1) == delta.stride(1)
    lse = torch.randn(2, 3, 97)
    padded, lse2, delta, stride = launch_backward._stats_buffers(lse, 97, packed)
    assert padded.shape == lse2.shape == delta.shape == (2, 3, rows)
    assert torch.equal(padded[..., :97], lse)
    assert torch.isposinf(padded[..., 97:]).all()
    assert torch.isposinf(lse2[..., 97:]).all()
    assert not delta[..., 97:].any()
    both = launch_common._packed_rows(lse2, delta)
    if packed:
        assert both.shape == (6, 2, rows)
        lse2.copy_(torch.randn_like(lse2))
        delta.copy_(torch.randn_like(delta))
        assert torch.equal(both[:, 0], lse2.reshape(6, rows))
        assert torch.equal(both[:, 1], delta.reshape(6, rows))
    else:
        assert both is None


@pytest.mark.parametrize("scheme", ["split", "atomic"])
@pytest.mark.parametrize(
    ("n_q", "n_k", "causal"), [(97, 97, True), (256, 256, True), (70, 40, False)]
)
def test_packed_row_stats_by_pointers(
    scheme, n_q, n_k, causal, small_tiles, monkeypatch, set_options
):
    """Packed L / D rows (``launch_backward._stats_buffers``) read by pointers, not TMA (a
    dK/dV config without ``tma`` whose statistics were packed anyway): their row strides are
    twice the unpacked ones, padded (97) or not (256)."""
    set_options(backward=scheme)
    monkeypatch.setattr(launch_backward, "_stats_by_tma", lambda *args: True)
    _check(*_inputs((2,), n_q, n_k, 16), causal)


@pytest.mark.parametrize(("n_q", "n_k"), [(70, 40), (33, 33)])
def test_dkdv_alone_gets_log2_row_stats(n_q, n_k, small_tiles):
    """``launch.backward(..., only="dkdv")`` (the benchmarks' kernel-alone timing) has no
    kernel before it to write L in log2 units: the host does, so dV = P^T dO still matches
    the reference, rows without keys (n_k < n_q, causal: L = -inf) included. (D is zero
    there, so dK is not the gradient: only the time counts.)"""
    q, k, v, do = _inputs((2,), n_q, n_k, 16)
    ref = reference_fwd_bwd(q, k, v, do, True)
    q4, k4, v4, do4 = (t.unsqueeze(1) for t in (q, k, v, do))
    o, lse = launch.forward(q4, k4, v4, True, 16**-0.5)
    _, _, dv = launch.backward(do4, q4, k4, v4, o, lse, True, 16**-0.5, only="dkdv")
    assert rel_err(dv.squeeze(1), ref["dv"]) < 1e-5


def test_tma_needs_aligned_strides():
    x = torch.randn(2, 3, 10, 17)[..., :16]  # row stride 17 floats = 68 bytes
    assert not launch.tma_usable(x)
    assert launch.tma_usable(torch.randn(2, 3, 10, 16))


def test_tile_config_spec_round_trip():
    specs = ("128,64,4,3", "32,128,8,3,tma", "128,64,8,3,tma,ws", "32,128,8,4,64")
    for spec in (*specs, "32,64,4,3,tma,reg,r128", "64,64,4,2,r168"):
        assert configs.TileConfig.parse(spec).spec() == spec
    assert configs.TileConfig.parse("32,64,4,3,r128,reg").maxnreg == 128
    for bad in ("128,64,4,3,fast", "32,64,4,3,r128,r96", "32,64,4,3,rx"):
        with pytest.raises(ValueError, match="m,n,warps,stages"):
            configs.TileConfig.parse(bad)
    for bad in ("32,64,4,3,r300", "32,64,4,3,r8"):
        with pytest.raises(ValueError, match="register cap"):
            configs.TileConfig.parse(bad)


@pytest.mark.parametrize(("n", "d", "causal"), [(100, 32, True), (64, 64, True), (50, 16, False)])
def test_default_tiles(n, d, causal):
    _check(*_inputs((1, 2), n, n, d), causal)


def test_bfloat16_through_interpreter():
    q, k, v, do = _inputs((2,), 40, 40, 16, torch.bfloat16)
    ref = reference_fwd_bwd(q, k, v, do, True)
    out = run_fwd_bwd(FlashAttention2Triton.apply, q, k, v, do, True)
    for name in ("o", "dq", "dk", "dv"):  # bf16 output rounding, 2^-9 relative
        assert rel_err(out[name], ref[name]) < 1e-2, name


def test_layouts_leading_dims_and_stride0_grad():
    """(B, N, H, d) buffers seen as (B, H, N, d), 5-D inputs, and o.sum().backward()."""
    b, n, h, d = 2, 37, 3, 16
    x = torch.randn(b, n, 3, h, d)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, d) strided views
    ref = reference_fwd_bwd(q, k, v, torch.ones(b, h, n, d), True)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    o = flash_attention(qq, kk, vv, causal=True, backend="triton")
    assert o.shape == (b, h, n, d)
    o.sum().backward()  # dO is an expanded stride-0 tensor
    assert rel_err(o, ref["o"]) < 1e-5
    for t, name in ((qq.grad, "dq"), (kk.grad, "dk"), (vv.grad, "dv")):
        assert rel_err(t, ref[name]) < 1e-5, name
    q5, k5, v5, do5 = _inputs((2, 2, 1), 20, 20, 16)
    out = run_fwd_bwd(lambda *a: flash_attention(*a, backend="triton"), q5, k5, v5, do5, False)
    ref5 = reference_fwd_bwd(q5, k5, v5, do5, False)
    assert all(rel_err(out[n], ref5[n]) < 1e-5 for n in out)


def test_softmax_scale_and_3d_lse_shape():
    q, k, v, do = _inputs((3,), 21, 21, 16)
    o = FlashAttention2Triton.apply(q.requires_grad_(), k, v, False, 0.7)
    assert saved_lse(o, q).shape == (3, 21)
    ref = reference_fwd_bwd(q, k, v, do, False, 0.7)
    assert rel_err(o, ref["o"]) < 1e-5


def test_empty_sequences():
    q, k, v, _ = _inputs((2,), 0, 5, 16)
    assert flash_attention(q, k, v, backend="triton").shape == (2, 0, 16)
    q, k, v, do = _inputs((2,), 4, 0, 16)
    out = run_fwd_bwd(lambda *a: flash_attention(*a, backend="triton"), q, k, v, do, False)
    assert torch.equal(out["o"], torch.zeros_like(out["o"]))
    assert torch.equal(out["dq"], torch.zeros_like(out["dq"]))


def test_torch_compile_fullgraph_no_graph_break():
    """Dynamo traces flash_attention and FlashAttention2Triton.apply into one graph."""

    def layer(q, k, v):
        return flash_attention(q * 2.0, k, v, causal=True, backend="triton").relu()

    q, k, v, do = _inputs((1, 2), 24, 24, 16)
    eager = run_fwd_bwd(lambda a, b, c, causal: layer(a, b, c), q, k, v, do, True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = run_fwd_bwd(lambda a, b, c, causal: compiled(a, b, c), q, k, v, do, True)
    for name in eager:
        assert rel_err(got[name], eager[name]) < 1e-6, name
    apply = torch.compile(FlashAttention2Triton.apply, fullgraph=True, backend="aot_eager")
    qq = q.reshape(2, 24, 16).requires_grad_()
    apply(qq, k.reshape(2, 24, 16), v.reshape(2, 24, 16), True).sum().backward()
    assert torch.isfinite(qq.grad).all()


def test_custom_ops_pass_opcheck():
    q, k, v, do = _inputs((1, 2), 20, 20, 16)
    torch.library.opcheck(torch.ops.flashattn_triton.fwd.default, (q, k, v, True, 0.25))
    o, lse = torch.ops.flashattn_triton.fwd(q, k, v, True, 0.25)
    torch.library.opcheck(torch.ops.flashattn_triton.bwd.default, (do, q, k, v, o, lse, True, 0.25))


def test_launch_ops_pass_opcheck():
    """The ops compiled graphs call: the public ops' schemas, fakes that match the launchers."""
    q, k, v, do = _inputs((1, 2), 20, 12, 16)
    torch.library.opcheck(torch.ops.flashattn_triton.fwd_launch.default, (q, k, v, True, 0.25))
    o, lse = torch.ops.flashattn_triton.fwd_launch(q, k, v, True, 0.25)
    torch.library.opcheck(
        torch.ops.flashattn_triton.bwd_launch.default, (do, q, k, v, o, lse, True, 0.25)
    )


def test_compiled_graphs_call_the_launch_ops(monkeypatch):
    """Under torch.compile the autograd.Function's graphs call the plain launch ops, not the
    public custom ops (whose Python wrappers cost host time on every call)."""
    from flashattn_triton import launch, ops

    def fail(*args, **kwargs):
        raise AssertionError("compiled graph went through the public custom op")

    monkeypatch.setattr(ops, "attention_fwd", fail)
    monkeypatch.setattr(ops, "attention_bwd", fail)
    q, k, v, do = _inputs((1, 2), 24, 24, 16)

    def attend(a, b, c, causal):
        return flash_attention(a, b, c, causal, backend="triton")

    eager = run_fwd_bwd(attend, q, k, v, do, True)
    # the launch ops look the launchers up per call: a wrapper set now (a profiler's, as
    # benchmarks/step_breakdown.py sets) runs inside the compiled graph
    calls = []
    for name in ("forward", "backward"):
        launcher = getattr(launch, name)
        wrapper = functools.partial(lambda f, n, *a: calls.append(n) or f(*a), launcher, name)
        monkeypatch.setattr(launch, name, wrapper)
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    got = run_fwd_bwd(compiled, q, k, v, do, True)
    for name in eager:
        assert rel_err(got[name], eager[name]) < 1e-6, name
    assert calls == ["forward", "backward"]


def test_eager_calls_bypass_the_custom_ops(monkeypatch):
    """Eager mode calls the launchers directly (the op dispatcher costs host time); the custom
    ops are for torch.compile (see test_torch_compile_fullgraph_no_graph_break)."""
    from flashattn_triton import ops

    def fail(*args, **kwargs):
        raise AssertionError("eager call went through the custom op")

    for name in ("attention_fwd", "attention_bwd", "fwd_launch", "bwd_launch"):
        monkeypatch.setattr(ops, name, fail)
    _check(*_inputs((2,), 40, 40, 16), True)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "window", "return_lse"),
    [
        ((2, 3), (2, 3), (-1, -1), False),
        ((4,), (2,), (-1, -1), False),
        ((1, 2), (1, 2), (5, 0), True),
    ],
)
def test_calls_without_grad_skip_the_autograd_function(
    monkeypatch, q_heads, kv_heads, window, return_lse
):
    """Under no_grad (or with inputs that need no grad) flash_attention launches without an
    autograd.Function (host time per decode step) and returns what the recorded call does."""
    from flashattn_triton import api

    q = torch.randn(*q_heads, 9, 16)
    k, v = torch.randn(*kv_heads, 21, 16), torch.randn(*kv_heads, 21, 16)
    kwargs = {"causal": True, "window_size": window, "return_lse": return_lse, "backend": "triton"}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    recorded = flash_attention(*leaves, **kwargs)

    def fail(*args, **kwargs):
        raise AssertionError("a call without grad went through an autograd.Function")

    for fn in (api.CheckedFlashAttention, api.WindowedFlashAttention):
        monkeypatch.setattr(fn, "apply", fail)
    with torch.no_grad():
        got_no_grad = flash_attention(*leaves, **kwargs)
    got_plain = flash_attention(q, k, v, **kwargs)  # grad mode on, nothing requires grad
    for got in (got_no_grad, got_plain):
        pairs = zip(got, recorded, strict=True) if return_lse else [(got, recorded)]
        for a, b in pairs:
            assert a.grad_fn is None
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
