"""The 3xTF32 matmul on the GPU: accuracy against float64 and cuBLAS's strict SGEMM on the
small model's product shapes and awkward ones, a model step against torch's fp32 matmul, and
CUDA-graph capture (`nox -s gpu_tests`; skipped elsewhere)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from lm_core import TransformerLM, get_config
from lm_core.matmul import Linear, tf32x3_mm

pytestmark = pytest.mark.gpu

# (M, N, K, layout): the small model's products (T = 2048 tokens, d_model 768, d_ff 3072,
# vocab 10,000) in their real layouts, then shapes that are no multiple of any tile.
SHAPES = [
    (2048, 2304, 768, "nt"),  # qkv forward: x @ W^T
    (2048, 768, 3072, "nn"),  # w2's input gradient: dy @ W
    (768, 3072, 2048, "tn"),  # w2's weight gradient: dy^T @ x
    (2048, 768, 10000, "nn"),  # the head's input gradient (K = 10,000)
    (1000, 999, 1001, "nn"),
    (37, 29, 45, "tt"),
    (1, 64, 7, "nt"),
]


@pytest.fixture(autouse=True)
def _strict_fp32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _operands(m, n, k, layout, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((k, m) if layout[0] == "t" else (m, k), generator=gen, device="cuda")
    b = torch.randn((n, k) if layout[1] == "t" else (k, n), generator=gen, device="cuda")
    b /= k**0.5
    return (a.t() if layout[0] == "t" else a), (b.t() if layout[1] == "t" else b)


def _rel_err(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest TF32 number: what one TF32 tensor-core pass sees."""
    return ((x.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


@pytest.mark.parametrize(("m", "n", "k", "layout"), SHAPES)
def test_as_accurate_as_sgemm(m, n, k, layout):
    a, b = _operands(m, n, k, layout)
    ref = a.double() @ b.double()
    ours = _rel_err(tf32x3_mm(a, b), ref)
    sgemm = _rel_err(a @ b, ref)
    one_pass = _rel_err(_tf32(a).double() @ _tf32(b).double(), ref)  # a single TF32 product
    assert ours < 1e-6, (ours, sgemm)
    assert ours <= 1.5 * sgemm + 1e-7, (ours, sgemm)
    assert ours < one_pass / 100, (ours, one_pass)


def test_tuned_and_direct_launches_agree():
    """The first call with a shape autotunes, the second launches the chosen config through
    Triton's JIT, later ones through the compiled binary: all give the same bits."""
    from lm_core import tf32x3_triton

    a, b = _operands(333, 222, 111, "nn", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the direct launch must not fall back
        results = [tf32x3_mm(a, b) for _ in range(4)]
    assert tf32x3_triton._Launcher.enabled
    for r in results[1:]:
        assert torch.equal(r, results[0])
    assert _rel_err(results[-1], a.double() @ b.double()) < 1e-6


def test_misaligned_views_get_their_own_kernel():
    """An operand that starts 4 bytes past a 16-byte boundary, after aligned ones of the same
    shape and strides: the cached kernel must not assume the alignment."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    big = torch.randn(96, 81, generator=gen, device="cuda")
    b = torch.randn(80, 40, generator=gen, device="cuda")
    aligned = big[:, :80].clone()  # same shape and strides as the view below
    for _ in range(3):
        tf32x3_mm(aligned, b)
    view = big[:, 1:]
    assert view.data_ptr() % 16 != 0
    for _ in range(3):
        c = tf32x3_mm(view, b)
        assert _rel_err(c, view.double() @ b.double()) < 1e-6


def test_no_nan_and_large_values():
    a, b = _operands(300, 200, 500, "nn")
    a = a * 1e18  # large, but products stay finite in float32
    c = tf32x3_mm(a, b)
    assert torch.isfinite(c).all()
    assert _rel_err(c, a.double() @ b.double()) < 1e-6


def test_model_step_matches_torch_fp32():
    torch.manual_seed(0)
    cfg = get_config("tiny", d_model=128, num_heads=4, d_ff=352, vocab_size=1000)
    ref = TransformerLM(cfg).cuda()
    ours = TransformerLM(dataclasses.replace(cfg, matmul="tf32x3")).cuda()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 1000, (4, 64), device="cuda")
    losses = []
    for model in (ref, ours):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def _graphed_step_on_new_input(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """Forward and backward of `layer` (loss: sum of squares) warmed up on a side stream,
    captured in a CUDA graph, then replayed after x is overwritten in place: the output of
    the replay (gradients in layer.weight.grad and x.grad)."""

    def step():
        layer.weight.grad = None
        x.grad = None
        y = layer(x)
        y.square().sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    return y


def test_cuda_graph_replay():
    """Forward and backward captured once (after the autotuning warm-up) replay correctly."""
    torch.manual_seed(0)
    layer = Linear(256, 384, bias=False, matmul="tf32x3").cuda()
    x = torch.randn(100, 256, device="cuda", requires_grad=True)
    y = _graphed_step_on_new_input(layer, x)
    x64, w64 = x.detach().double(), layer.weight.detach().double()
    assert _rel_err(y, x64 @ w64.t()) < 1e-6
    assert _rel_err(layer.weight.grad, 2 * (x64 @ w64.t()).t() @ x64) < 1e-6


def _hopper_gluon() -> bool:
    from lm_core import tf32x3_gluon

    return tf32x3_gluon.usable(torch.device("cuda"))


needs_hopper_gluon = pytest.mark.skipif(
    not torch.cuda.is_available() or not _hopper_gluon(),
    reason="the Gluon GEMM runs on Hopper GPUs with Triton's Gluon",
)


@pytest.fixture
def force_gluon(monkeypatch):
    """Every product of a shape (M, N) in the returned dict launches the Gluon kernel under
    the plan it maps to, whatever the first call's timing would pick."""
    from lm_core import tf32x3_triton

    forced: dict = {}
    real_get = tf32x3_triton._best.get

    class _Best(dict):
        def get(self, key, default=None):
            return forced.get(key[:2]) or real_get(key, default)

    monkeypatch.setattr(tf32x3_triton, "_best", _Best(tf32x3_triton._best))
    return forced


def _plans():
    from lm_core.tf32x3_gluon import Plan

    return {
        "split_a": Plan(),
        "raw_a": Plan(a_raw=True),  # a_kmajor set per operand below
        "split_a_split_k4": Plan(split_k=4),
        "raw_a_split_k2": Plan(a_raw=True, split_k=2),
    }


@needs_hopper_gluon
@pytest.mark.parametrize("plan", ["split_a", "raw_a", "split_a_split_k4", "raw_a_split_k2"])
@pytest.mark.parametrize(("m", "n", "k", "layout"), SHAPES)
def test_gluon_gemm_as_accurate_as_sgemm(force_gluon, m, n, k, layout, plan):
    """The Gluon kernel under each kind of plan on every shape (ragged M, N and K included)
    against float64, SGEMM, and the Triton kernel's 128 x 128 x 32 tiles (the same sums: equal
    to rounding; split K adds the slices' sums, close to rounding)."""
    from lm_core import tf32x3_gluon
    from lm_core import tf32x3_triton as tt

    a, b = _operands(m, n, k, layout, seed=5)
    ref = a.double() @ b.double()
    chosen = _plans()[plan]
    if chosen.a_raw:
        major = tf32x3_gluon.a_major(a)
        if major is None:  # A not readable by TMA as it is: the plan must not be offered
            k_pad = tt._round_up(k, tt.K_ALIGN)
            offered = tf32x3_gluon.plans(m, n, k_pad, major, tf32x3_gluon.sm_count(a.device))
            assert not any(p.a_raw for p in offered), offered
            return
        chosen = dataclasses.replace(chosen, a_kmajor=major == "k")
    force_gluon[(m, n)] = chosen
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither launch may fall back
        calls = [tf32x3_mm(a, b) for _ in range(3)]  # jit launch, then the compiled binary
    assert torch.equal(calls[1], calls[0])
    assert torch.equal(calls[2], calls[0])
    ours, sgemm = _rel_err(calls[0], ref), _rel_err(a @ b, ref)
    assert ours < 1e-6, (ours, sgemm)
    assert ours <= 1.5 * sgemm + 1e-7, (ours, sgemm)
    a_split, b_split = tt.split_pair(a, b.t())
    c = torch.empty(m, n, device="cuda")
    k_pad = a_split.shape[2]
    args = (a_split, b_split, c, m, n, k_pad, a_split[0].numel(), b_split[0].numel(), n)
    grid = (tt._cdiv(m, 128) * tt._cdiv(n, 128),)
    tt.mm_kernel[grid](*args, BM=128, BN=128, BK=32, GROUP_M=8, num_warps=8, num_stages=3)
    if chosen.split_k == 1:  # split K sums in another order: float64 and SGEMM judge it above
        assert _rel_err(calls[0], c.double()) < 1e-7


@needs_hopper_gluon
def test_gluon_gemm_in_a_cuda_graph(force_gluon):
    """Forward and backward of a layer whose three products all take the Gluon kernel,
    captured after the warm-up and replayed on new inputs."""
    from lm_core.tf32x3_gluon import Plan

    torch.manual_seed(0)
    layer = Linear(768, 1000, bias=False, matmul="tf32x3").cuda()
    x = torch.randn(300, 768, device="cuda", requires_grad=True)
    # the forward's A in registers, the input gradient's K in 2 slices, the weight gradient's
    # M-major A in registers
    force_gluon.update({(300, 1000): Plan(a_raw=True), (300, 768): Plan(split_k=2),
                        (1000, 768): Plan(a_raw=True, a_kmajor=False)})  # fmt: skip
    y = _graphed_step_on_new_input(layer, x)
    x64, w64 = x.detach().double(), layer.weight.detach().double()
    assert _rel_err(y, x64 @ w64.t()) < 1e-6
    assert _rel_err(layer.weight.grad, 2 * (x64 @ w64.t()).t() @ x64) < 1e-6
    assert _rel_err(x.grad, 2 * (x64 @ w64.t()) @ w64) < 1e-6


@needs_hopper_gluon
def test_first_call_keeps_the_faster_kernel():
    """On a step-sized product the first call times the Triton kernel and the Gluon plans and
    remembers one; later calls take it and give the first call's bits (its result is the
    kept kernel's)."""
    from lm_core import tf32x3_gluon
    from lm_core import tf32x3_triton as tt

    a, b = _operands(768, 768, 2048, "tn", seed=6)  # a weight gradient: M-major A, 36 tiles
    offered = tf32x3_gluon.plans(768, 768, 2048, "m", tf32x3_gluon.sm_count(a.device))
    assert tf32x3_gluon.Plan(a_raw=True, a_kmajor=False, split_k=4) in offered
    first = tf32x3_mm(a, b)
    chosen = tt._best[(768, 768, 2048, a.device, "m")]
    assert chosen in offered if isinstance(chosen, tf32x3_gluon.Plan) else hasattr(chosen, "kwargs")
    for _ in range(2):
        assert torch.equal(tf32x3_mm(a, b), first)
