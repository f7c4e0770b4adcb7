"""The backward launcher: scheme choice, row-statistics buffers and the kernels' launches.

Backward schemes (``Options.backward``): ``split`` = a dQ kernel looping over key tiles
(for d <= 64 it also computes D = rowsum(dO * O) for its rows), then a dK/dV kernel looping
over query tiles (no atomics, P recomputed twice; on Hopper, for d = 128 and TMA-readable
layouts, the dK/dV kernel is the Gluon one of ``gluon_dkdv``, and on small grids or with
2048 keys or more the dQ kernel that of ``gluon_dq``);
``fused`` = the same two loops in one launch, program t doing key tile t and query tile t;
``atomic`` = one dK/dV kernel that also adds dQ into a float32 buffer with atomics;
``onepass`` = on Hopper at head dims 64 and 128 (16-bit, TMA-readable, with the keys
``gluon_bwd.enough_keys`` asks for, no window or packing) one warp-specialized Gluon kernel
for dK, dV and dQ, dQ summed into a float32 buffer by TMA reduce-adds (``gluon_bwd``),
elsewhere what ``auto`` picks;
``auto`` (default) = fused for causal 16-bit inputs on small grids (about one wave of
programs, e.g. batch 1 with few heads and long sequences), else onepass where it applies,
else split. On small causal grids the split kernels also halve their grid-axis tiles
(``configs.for_small_grid``).

Calls with features (grouped-query heads, windows, packed sequences) take the split
backward (the fused and atomic kernels lack them) unless the one-pass kernel applies; of
those, only grouped-query calls may run the Gluon kernels (which lack windows and packing);
the packed launcher (``launch_varlen.backward_varlen``) shares ``_stats_buffers`` and
``_backward_launches``. ``backward`` keeps its scheme choice per launch-plan key
(``_BWD_SCHEMES``, emptied with the plans). ``launch.backward`` is this ``backward``.
"""

from __future__ import annotations

import torch

from . import configs as C
from . import fastlaunch
from ._device import head_group_args, require_runnable, sm_count, tma_usable
from ._device import kernels as _kernels
from .features import PLAIN, Features, Varlen, feature_args, features
from .launch_common import (
    _bhn_strides,
    _check_grid,
    _dot_precision,
    _interpreter_bf16,
    _run,
    _small_grid,
    _strides,
    _unit_last_stride,
    out_like,
    triton_cdiv,
)
from .launch_plans import (
    _launch_planned,
    _layout_key,
    call_key,
    forget_plan,
    keyed_cache,
    remember_call,
    replay_call,
)
from .options import get_options


def _gluon_dkdv(*args, **kwargs) -> bool:
    """``gluon_dkdv.try_dkdv`` (imported on first CUDA backward: it imports Triton's Gluon)."""
    from . import gluon_dkdv

    return gluon_dkdv.try_dkdv(*args, **kwargs)


def _gluon_bwd():
    """The ``gluon_bwd`` module (the one-pass backward; imported like ``_gluon_dkdv``)."""
    from . import gluon_bwd

    return gluon_bwd


def _gluon_dq():
    """The ``gluon_dq`` module (imported on first CUDA backward, like ``_gluon_dkdv``)."""
    from . import gluon_dq

    return gluon_dq


def _gluon_reads_stats(q: torch.Tensor) -> bool:
    """Whether a Gluon kernel may read this backward's row statistics (CUDA, a head dim in a
    Gluon DEFAULTS table): they then stay in separate contiguous buffers, as its row TMA
    needs."""
    if not q.is_cuda:
        return False
    from . import gluon_dkdv, gluon_dq

    return q.shape[-1] in gluon_dkdv.DEFAULTS or q.shape[-1] in gluon_dq.DEFAULTS


def _stats_by_tma(
    q: torch.Tensor,
    kind: str | None,
    n_q: int,
    n_k: int,
    block_d: int,
    elem: int,
    small: bool,
    features: bool = False,
) -> bool:
    """Whether the Triton dK/dV kernel (``kind`` 'dkdv' or 'atomic') will bring L and D by
    TMA, so that ``_stats_buffers`` packs them: configs.STATS_TMA, its default config asks
    for TMA and q allows it, and no Gluon kernel may read them. (Packed rows read by pointers
    cost registers instead: d = 32, 72 B of stack against 56.)"""
    opts = get_options()
    if kind is None or not C.STATS_TMA or opts.autotune or _gluon_reads_stats(q):
        return False
    cfg = C.default_config(
        kind, n_q, n_k, block_d, elem, small, tile_configs=opts.tile_configs, features=features
    )
    return cfg.tma and tma_usable(q)


def _stats_buffers(
    lse: torch.Tensor, n_q: int, packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The backward's (B, H, rows) float32 row statistics: L (natural log), buffers for L in
    log2 units and for D (written by the kernel that computes D), and the row stride of the
    last two. L is lse itself (made contiguous) where n_q is a multiple of
    configs.STATS_ROWS, else a copy padded to one (L = +inf, D = 0 in the padding).

    ``packed``: the last two are the [..., 0, :] and [..., 1, :] views of one (B, H, 2, rows)
    buffer (stride 2 * rows), so that the dK/dV kernel brings a query tile's L and D by one
    TMA copy; else two contiguous buffers (stride rows)."""
    lse = lse.contiguous()
    rows = triton_cdiv(n_q, C.STATS_ROWS) * C.STATS_ROWS
    if fastlaunch.tracing():  # never packed: traced kernels load by pointers, not TMA
        return _traced_stats_buffers(lse, n_q, rows)
    if rows == n_q:  # the common case, kept to one allocation
        if packed:
            lse2, delta = lse.new_empty((*lse.shape[:-1], 2, rows)).unbind(-2)
            return lse, lse2, delta, 2 * rows
        lse2, delta = lse.new_empty((2, *lse.shape)).unbind(0)
        return lse, lse2, delta, rows
    # Each buffer is made by one concatenation with constant padding rows: filled and
    # sliced in place they cost 4.6x the unpadded buffers' host time (48 against 11 us on
    # an H100 host), by concatenation 2.8x (35 against 12 us, another machine start).
    lead, pad = lse.shape[:-1], rows - n_q
    tail = _padding_rows(lse, pad)  # (2, pad): +inf, then 0
    lse = torch.cat((lse, tail[0].expand(*lead, pad)), -1)
    if packed:
        both = torch.cat((lse.new_empty((*lead, 2, n_q)), tail.expand(*lead, 2, pad)), -1)
        lse2, delta = both.unbind(-2)
        return lse, lse2, delta, 2 * rows
    tail = tail.view(2, *(1,) * len(lead), pad).expand(2, *lead, pad)
    lse2, delta = torch.cat((lse.new_empty((2, *lead, n_q)), tail), -1).unbind(0)
    return lse, lse2, delta, rows


def _traced_stats_buffers(
    lse: torch.Tensor, n_q: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``_stats_buffers`` while traced for torch.compile: L2 and D in buffers of their own,
    padded by filling them rather than by concatenating into views of one buffer. The graph
    turns a kernel's writes into views of a shared buffer into copies of the views and
    scatters back into the buffer; a whole buffer it writes in place."""
    if rows == n_q:
        return lse, torch.empty_like(lse), torch.empty_like(lse), rows
    lead = lse.shape[:-1]
    lse = torch.nn.functional.pad(lse, (0, rows - n_q), value=float("inf"))
    return lse, lse.new_full((*lead, rows), float("inf")), lse.new_zeros((*lead, rows)), rows


# The constant padding rows of ``_stats_buffers`` by (device, length): +inf (L, L in log2
# units), then 0 (D). Made and kept outside CUDA graph capture only (a tensor made while
# capturing lives in the graph's memory pool); traced graphs pad by ``_traced_stats_buffers``.
_PADDING_ROWS: dict[tuple, torch.Tensor] = {}


def _padding_rows(like: torch.Tensor, pad: int) -> torch.Tensor:
    key = (like.device, pad)
    rows = _PADDING_ROWS.get(key)
    if rows is None:
        rows = torch.zeros((2, pad), dtype=torch.float32, device=like.device)
        rows[0] = float("inf")
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            return rows
        _PADDING_ROWS[key] = rows
    return rows


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    only: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients dq, dk, dv (shaped like q, k, v) from dO (B, H, Nq, d) and the saved o, lse
    (k, v with fewer heads and the window as in ``forward``).

    ``only`` (benchmarks): run just that kernel kind ('dkdv', 'dq', 'fused', 'atomic') to
    time it alone; the other outputs are then left unwritten.
    """
    call = None
    if only is None:
        call = call_key((q, k, v, do, o, lse), causal, softmax_scale, window_left, window_right)
    if call is not None:
        remembered = _CALLS.get(call)
        # (a one-pass replay under torch's deterministic mode: the full path, split kernels)
        if remembered is not None and not (
            remembered[1][3] and torch.are_deterministic_algorithms_enabled()
        ):
            replay, (packed, stats_shape, delta_offset, onepass) = remembered
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            addresses = [t.data_ptr() for t in (q, k, v, do, o, lse, dq, dk, dv)]
            if stats_shape is not None:  # one buffer: L in log2 units, then D
                base = lse.new_empty(stats_shape).data_ptr()
                addresses += (base, base + delta_offset)
            else:  # padded rows: the same buffers as the first call (``_stats_buffers``)
                stats = _stats_outputs(lse, q.shape[2], packed)[1]
                addresses += (t.data_ptr() for t in stats)
            if onepass:
                dq_acc = _onepass_accumulator(q)
                addresses.append(dq_acc.data_ptr())
            if replay_call(_CALLS, call, replay, addresses, 6):
                if onepass:
                    dq.copy_(dq_acc)
                return dq, dk, dv
        if not all(t.stride(-1) == 1 for t in (q, k, v, do, o)) or not lse.is_contiguous():
            call = None  # the launches read copies: nothing to replay on the caller's tensors
    require_runnable(q)
    if _interpreter_bf16(q):
        grads = backward(
            do.float(), q.float(), k.float(), v.float(), o.float(), lse, causal, softmax_scale,
            window_left, window_right,
        )  # fmt: skip
        return tuple(out_like(t).copy_(g) for t, g in zip((q, k, v), grads))
    dq, dk, dv = out_like(q), out_like(k), out_like(v)
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    feat = None
    if window_left != -1 or window_right != -1 or k.shape[1] != h:
        feat = features(h, k.shape[1], causal, window_left, window_right, n_q, n_k)
    if b * h == 0 or n_q == 0 or n_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # A non-contiguous dO (e.g. the stride-0 ones of o.sum().backward()) is copied once:
    # the kernels need unit-stride rows to vectorize their loads.
    do, q, k, v, o = (_unit_last_stride(t) for t in (do, q, k, v, o))
    inputs = (q, k, v, do, o, lse)
    key = None
    if q.is_cuda and only is None:
        key = _layout_key(inputs, "bwd", causal, softmax_scale, feat)
    plan = _BWD_SCHEMES.get(key) if key is not None else None
    if plan is None:
        plan = _backward_scheme(q, k, causal, feat, v, do)
        if key is not None:
            if len(_BWD_SCHEMES) >= 4096:
                _BWD_SCHEMES.clear()
            _BWD_SCHEMES[key] = plan
    scheme, _, _, packed = plan
    (lse_c, lse2, delta, stride_rows), stats = _stats_outputs(lse, n_q, packed)
    # The one-pass kernel adds dQ into a zeroed float32 buffer, one of the plan's buffers, so
    # its launches replay like the split ones; the zeroing and the conversion into dq are
    # torch ops around them. dQ's sums arrive in no fixed order: torch's deterministic mode
    # gets the split kernels (not replayed: the plan under this key is the one-pass one).
    onepass = (
        scheme == "onepass" and only is None and not torch.are_deterministic_algorithms_enabled()
    )
    dq_acc, extra_outputs = dq, ()
    if scheme == "atomic":
        dq_acc = torch.zeros((b, h, n_q, C.block_d_for(d)), dtype=torch.float32, device=q.device)
    elif onepass:
        dq_acc = _onepass_accumulator(q)
        extra_outputs = (dq_acc,)
    ran = []

    def launch_jit() -> None:
        ran.append(
            _backward_launches(
                do, q, k, v, o, lse_c, lse2, delta, stride_rows, dq, dk, dv, dq_acc, causal,
                softmax_scale, plan, only, feat,
            )
        )  # fmt: skip

    if scheme == "atomic" or (scheme == "onepass" and not onepass):
        key = None  # atomic: float32 accumulator of padded width, converted per call
    _launch_planned(key, inputs, (dq, dk, dv, *stats, *extra_outputs), launch_jit)
    if onepass and ran and ran[0] != "onepass":
        # Its first compile failed (warned) and the split kernels wrote dq: plan this key again.
        forget_plan(key)
        _BWD_SCHEMES.pop(key, None)
        return dq, dk, dv
    if scheme == "atomic":
        dq.copy_(dq_acc[..., :d])
        return dq, dk, dv
    if onepass:
        dq.copy_(dq_acc)
    if call is not None:
        recipe = (*_stats_recipe(lse, lse_c, lse2, delta, packed), onepass)
        remember_call(_CALLS, call, key, recipe)
    return dq, dk, dv


def _onepass_accumulator(q: torch.Tensor) -> torch.Tensor:
    """The zeroed float32 (B, H, n_q, d) buffer the one-pass kernel adds dQ into."""
    return torch.zeros(q.shape, dtype=torch.float32, device=q.device)


def _stats_outputs(
    lse: torch.Tensor, n_q: int, packed: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, ...]]:
    """``_stats_buffers``, and the buffers of it a backward launch writes or reads besides
    its inputs, in the launch plan's order: L2, D and, where it is a copy, L."""
    lse_c, lse2, delta, stride_rows = _stats_buffers(lse, n_q, packed)
    stats = (lse2, delta) if lse_c is lse else (lse2, delta, lse_c)
    return (lse_c, lse2, delta, stride_rows), stats


def _stats_recipe(lse, lse_c, lse2, delta, packed: bool) -> tuple:
    """How a remembered backward makes its row statistics again: (packed, the shape of the
    one buffer holding L2 then D, D's byte offset in it), or (packed, None, None) where the
    rows are padded or L copied (``_stats_outputs`` then runs again; the padding is filled)."""
    base = lse2._base
    if (
        lse_c is lse
        and base is not None
        and delta._base is base
        and lse2.data_ptr() == base.data_ptr()
        and base.is_contiguous()
    ):
        return packed, tuple(base.shape), delta.data_ptr() - lse2.data_ptr()
    return packed, None, None


# Backward scheme choices by launch-plan key, dropped with the plans.
_BWD_SCHEMES: dict[tuple, tuple[str, str | None, bool, bool]] = keyed_cache()
# Repeated backward calls by call key (``launch_plans.call_key``): the replay, and how to
# make its row statistics again (``_stats_recipe``).
_CALLS: dict[tuple, tuple] = keyed_cache()


def _backward_scheme(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    feat: Features | None = None,
    v: torch.Tensor | None = None,
    do: torch.Tensor | None = None,
) -> tuple[str, str | None, bool, bool]:
    """(scheme, the Triton dK/dV kernel kind or None, small dK/dV grid, packed statistics).
    Where the one-pass Gluon backward applies (``_onepass_applies``), ``onepass`` takes it,
    and so does ``auto`` except on the small causal grids it gives the fused backward (one
    wave of 128-key programs would leave the longest causal program alone at the end: not
    measured). Other calls with features (``Features``) take the split backward on
    full-size tiles."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    block_d, elem = C.block_d_for(d), q.element_size()
    _check_grid(triton_cdiv(max(n_q, n_k), 16), "sequence length", 16)
    setting = get_options().backward
    onepass = setting in ("auto", "onepass") and _onepass_applies(q, k, v, do, causal, feat)
    if onepass and setting == "auto" and feat is None:
        n_sms = sm_count(q)
        onepass = (
            C.resolve_backward_scheme("auto", causal, b * h, n_k, block_d, elem, n_sms) == "split"
        )
    if onepass:
        # Its own plan: unpacked row statistics; the dK/dV kind kept for the split kernels
        # that run instead if its first compile fails.
        return "onepass", "dkdv", False, False
    if setting == "onepass":  # where it does not apply, what auto picks
        setting = "auto"
    if feat is not None:
        packed = _stats_by_tma(q, "dkdv", n_q, n_k, block_d, elem, False, features=True)
        return "split", "dkdv", False, packed
    n_sms = sm_count(q)
    scheme = C.resolve_backward_scheme(setting, causal, b * h, n_k, block_d, elem, n_sms)
    kind = {"split": "dkdv", "atomic": "atomic"}.get(scheme)  # the dK/dV kernel's, if Triton's
    small_dkdv = _small_grid(causal, b * h, n_k, n_sms)
    packed = _stats_by_tma(q, kind, n_q, n_k, block_d, elem, small_dkdv)
    return scheme, kind, small_dkdv, packed


def _onepass_applies(q, k, v, do, causal: bool, feat: Features | None) -> bool:
    """Whether the one-pass Gluon backward (``gluon_bwd``) may take this call: CUDA inputs
    it accepts (``gluon_bwd.would_run``) and no window (grouped-query heads are fine)."""
    if v is None or do is None or not q.is_cuda or (feat is not None and feat.window):
        return False
    return _gluon_bwd().would_run(q, k, v, do, causal)


def _backward_launches(
    do, q, k, v, o, lse, lse2, delta, stride_rows, dq, dk, dv, dq_target,
    causal: bool, softmax_scale: float, plan: tuple, only: str | None,
    feat: Features | None = None, varlen: Varlen | None = None,
) -> str:  # fmt: skip
    """The backward's kernels through Triton's dispatch (``backward`` allocated every
    buffer; ``dq_target``: dq, or the float32 accumulator of the atomic and one-pass
    schemes); returns the scheme that ran (``split`` where the one-pass kernel did not).
    ``feat``, ``varlen``: the Triton dQ and dK/dV kernels with those features (split
    scheme only)."""
    scheme, kind, small_dkdv, packed = plan
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    kern = _kernels()
    block_d = C.block_d_for(d)
    elem = q.element_size()
    n_sms = sm_count(q)
    plain = feat is None and varlen is None
    # The Gluon kernels know grouped-query heads, not windows or packed sequences.
    gluon_ok = varlen is None and (feat is None or not feat.window)
    # Grid rows and tile-fitting lengths: per (batch, head) and the lengths, or for packed
    # sequences per (sequence, head) and the longest ones.
    bh, bh_kv, len_q, len_k = b * h, b * h_kv, n_q, n_k
    if varlen is not None:
        bh, bh_kv, len_q, len_k = varlen.batch * h, varlen.batch * h_kv, varlen.max_q, varlen.max_k
    ragged = varlen is not None
    extra = {} if plain else feature_args(feat, *(varlen[:2] if ragged else ()))

    def preprocess() -> None:  # D = rowsum(dO * O), and L in log2 units
        pre_block = 64
        fastlaunch.launch(
            kern.attn_bwd_preprocess_kernel, (b * h, triton_cdiv(n_q, pre_block)),
            o, do, delta, lse, lse2, *_bhn_strides(o), *_bhn_strides(do), h, n_q,
            lse.shape[-1], stride_rows, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_block,
        )  # fmt: skip

    if scheme == "onepass":
        # dQ's sums arrive in no fixed order: torch's deterministic mode gets the split kernels.
        if only is None and varlen is None and not torch.are_deterministic_algorithms_enabled():
            preprocess()
            bwd = _gluon_bwd()
            if bwd.try_onepass(q, k, v, do, lse2, delta, dq_target, dk, dv, causal, softmax_scale):
                return "onepass"
        # Deterministic mode, its first compile failed (warned), or one kernel is timed
        # alone: the split kernels (which compute D again if it was: the same values).
        scheme, dq_target = "split", dq
    # The split backward runs its dQ kernel first; up to C.FUSED_DELTA_MAX_D the Triton
    # one computes D (and L in log2 units) itself: one launch fewer. Elsewhere both come
    # from preprocess(). The Triton dK/dV kernel reads L in log2 units (lse2).
    dq_first = scheme == "split" and only in (None, "dq")
    fuse_delta = dq_first and block_d <= C.FUSED_DELTA_MAX_D
    if not fuse_delta and only is None:
        preprocess()
    elif not fuse_delta:  # one kernel timed alone: D's values do not matter, L's do
        delta.zero_()
        lse2.copy_(lse * kern.LOG2E).masked_fill_(lse == float("-inf"), float("inf"))
    common = {
        "Q": q, "K": k, "V": v, "DO": do, "LSE": lse, "DELTA": delta,
        **_strides("q", q, ragged), **_strides("k", k, ragged), **_strides("v", v, ragged),
        **_strides("do", do, ragged),
        "n_heads": h, "n_q": n_q, "n_k": n_k, "stride_stats": lse.shape[-1],
        "qk_scale": softmax_scale * kern.LOG2E, "sm_scale": softmax_scale,
        "SEQ_BUCKET": C.seq_bucket(max(len_q, len_k)), "HEAD_DIM": d, "BLOCK_D": block_d,
        "CAUSAL": causal, "DOT_PRECISION": _dot_precision(q.dtype),
    }  # fmt: skip
    dkdv_out = {
        "DK": dk, "DV": dv, "DQ": dq_target,
        **_strides("dk", dk, ragged), **_strides("dv", dv, ragged),
        **_strides("dq", dq_target, ragged),
        "PADDED_STATS": lse.shape[-1] != n_q, "PACKED_STATS": packed,
    }  # fmt: skip
    if scheme == "fused":

        def grid_fused(cfg):
            n_tiles = max(triton_cdiv(n_k, cfg.block_n), triton_cdiv(n_q, cfg.block_n))
            return (b * h, n_tiles)

        _run(
            "fused", kern.attn_bwd_fused_kernel, grid_fused,
            {**common, **dkdv_out, "stride_rows": stride_rows},
            n_q, n_k, block_d, elem,
        )  # fmt: skip
        return scheme

    if dq_first:
        # Hopper, d = 128: the Gluon kernel (gluon_dq) does dQ when it applies.
        gluon_dq_ran = False
        if gluon_ok and q.is_cuda and _gluon_dq().would_run(q, k, v, do, dq):
            if fuse_delta:
                preprocess()  # the Gluon kernel reads D
            gluon_dq_ran = _gluon_dq().run_default(
                q, k, v, do, lse, delta, dq, causal, softmax_scale
            )
        if not gluon_dq_ran:  # (after a failed Gluon compile it recomputes D: the same)

            def grid_queries(cfg):
                return (bh, triton_cdiv(len_q, cfg.block_m))

            dq_args = {
                **common, "LSE2": lse2, "stride_rows": stride_rows, "DQ": dq,
                **_strides("dq", dq, ragged), "Out": o, **_strides("o", o, ragged),
                "FUSE_DELTA": fuse_delta, **PLAIN, **extra,
            }  # fmt: skip
            if ragged:
                dq_args.update(head_group=bh, GROUPED=False)
            else:
                dq_args.update(head_group_args(k, bh, n_k, block_d))
            _run(
                "dq", kern.attn_bwd_dq_kernel, grid_queries, dq_args, len_q, len_k, block_d,
                elem, small_grid=plain and _small_grid(causal, bh, n_q, n_sms), ragged=ragged,
                features=not plain,
            )  # fmt: skip

    def grid_keys(cfg):
        return (bh_kv, triton_cdiv(len_k, cfg.block_n))

    # Hopper, d = 128: the Gluon kernel (gluon_dkdv) does dK, dV when it applies.
    gluon_ran = (
        gluon_ok
        and kind == "dkdv"
        and only in (None, kind)
        and q.is_cuda
        and _gluon_dkdv(q, k, v, do, lse2, delta, dk, dv, causal, softmax_scale, lse_log2=True)
    )
    if only in (None, kind) and not gluon_ran:
        dkdv_args = {
            **common, **dkdv_out, "LSE": lse2, "LSE_LOG2": True,
            "ATOMIC_DQ": scheme == "atomic", "n_heads": h_kv, **PLAIN, **extra,
        }  # fmt: skip
        if ragged:
            dkdv_args.update(head_group=bh_kv, GROUPED=False)
        else:
            dkdv_args.update(head_group_args(q, bh_kv, n_q * (h // h_kv), block_d))
        _run(
            kind, kern.attn_bwd_dkdv_kernel, grid_keys, dkdv_args, len_q, len_k, block_d,
            elem, small_grid=small_dkdv, ragged=ragged, features=not plain,
        )  # fmt: skip
    return scheme
