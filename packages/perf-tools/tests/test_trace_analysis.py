"""Attribution of work to named ranges, on hand-made profiler events with known answers."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field

import pytest

from perf_tools import trace_analysis as ta

Kernel = namedtuple("Kernel", ["name", "device", "duration"])


@dataclass
class Interval:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class Evt:
    """The FunctionEvent fields trace_analysis reads."""

    name: str
    start: float
    end: float
    device_type: str = "DeviceType.CPU"
    is_user_annotation: bool = False
    kernels: list = field(default_factory=list)
    self_cpu_time_total: float = 0.0

    @property
    def time_range(self) -> Interval:
        return Interval(self.start, self.end)


def ann(name, a, b):
    return Evt(name, a, b, is_user_annotation=True)


def op(name, t, kernels=(), self_us=0.0):
    return Evt(
        name, t, t + 1, kernels=[Kernel(k, 0, d) for k, d in kernels], self_cpu_time_total=self_us
    )


def gpu(name, a, b):
    return Evt(name, a, b, device_type="DeviceType.CUDA")


def _gpu_step():
    """One step: forward [0, 40) with an attention softmax, backward [40, 80), optimizer."""
    events = [
        ann("step", 0, 100),
        ann("forward", 0, 40),
        ann("attention", 5, 30),
        ann("attention/scores", 5, 10),
        ann("attention/softmax", 10, 20),
        ann("backward", 40, 80),
        ann("optimizer", 80, 100),
        op("aten::mm", 6, [("sm90_xmma_gemm_bf16", 30.0)]),
        op("aten::_softmax", 12, [("softmax_warp_forward", 10.0)]),
        op("aten::mm", 35, [("ampere_sgemm_128x64", 20.0)]),
        op("aten::mm", 50, [("nvjet_tst_64x8", 60.0)]),
        op("aten::mul", 60, [("vectorized_elementwise_kernel", 20.0)]),
        op("aten::_fused_adamw_", 90, [("multi_tensor_apply_kernel", 40.0)]),
        op("aten::copy_", 120, [("Memcpy DtoD", 5.0)]),  # after the step: outside the phases
        gpu("sm90_xmma_gemm_bf16", 200, 230),
        gpu("softmax_warp_forward", 230, 240),
        gpu("ampere_sgemm_128x64", 240, 260),
        gpu("nvjet_tst_64x8", 260, 320),
        gpu("vectorized_elementwise_kernel", 320, 340),
        gpu("multi_tensor_apply_kernel", 340, 380),
        gpu("Memcpy DtoD", 380, 385),
        gpu("forward", 200, 260),  # a GPU-side user annotation: not a kernel
    ]
    events[-1].is_user_annotation = True
    return events


def test_gpu_attribution_by_launch_time():
    items, spans, unit = ta.extract(_gpu_step())
    assert unit == "kernel"
    assert sum(i.dur_us for i in items) == 185.0
    index = ta.RangeIndex(spans)
    ranges = {r["range"]: r for r in ta.range_table(items, index, steps=1)}
    assert ranges["forward"]["ms_per_step"] == pytest.approx(60e-3)
    assert ranges["backward"]["ms_per_step"] == pytest.approx(80e-3)
    assert ranges["optimizer"]["ms_per_step"] == pytest.approx(40e-3)
    assert ranges[ta.OUTSIDE]["ms_per_step"] == pytest.approx(5e-3)
    assert ranges["attention"]["ms_per_step"] == pytest.approx(40e-3)
    assert ranges["attention/scores"]["ms_per_step"] == pytest.approx(30e-3)
    assert ranges["attention/softmax"]["top_item"] == "softmax_warp_forward"
    level0 = [r["share_pct"] for r in ranges.values() if r["level"] == 0]
    assert sum(level0) == pytest.approx(100.0)
    assert "step" not in ranges


def test_kernel_table_and_split():
    items, spans, _ = ta.extract(_gpu_step() * 1)
    kernels = ta.kernel_table(items, steps=2)
    assert kernels[0]["name"] == "nvjet_tst_64x8"
    assert kernels[0]["calls_per_step"] == 0.5
    assert kernels[0]["ms_per_step"] == pytest.approx(30e-3)
    assert sum(r["share_pct"] for r in kernels) == pytest.approx(100.0)
    split = ta.split_table(items, ta.RangeIndex(spans), steps=1)
    step = {r["class"]: r for r in split if r["scope"] == "step"}
    assert step["matmul"]["ms_per_step"] == pytest.approx(110e-3)
    assert step["other"]["ms_per_step"] == pytest.approx(75e-3)
    assert sum(r["share_of_scope_pct"] for r in step.values()) == pytest.approx(100.0)
    fwd = {r["class"]: r for r in split if r["scope"] == "forward"}
    assert fwd["matmul"]["share_of_scope_pct"] == pytest.approx(50 / 60 * 100)


def test_kernels_without_a_launching_op_still_count():
    events = [*_gpu_step(), gpu("nccl_kernel", 400, 410)]
    items, _, _ = ta.extract(events)
    orphan = [i for i in items if i.name == ta.NO_LAUNCH]
    assert len(orphan) == 1
    assert orphan[0].dur_us == pytest.approx(10.0)
    assert orphan[0].anchor_us is None


def test_cpu_ops_use_self_time_and_skip_annotations():
    events = [
        ann("forward", 0, 50),
        op("aten::linear", 1, self_us=2.0),
        op("aten::addmm", 2, self_us=30.0),
        op("aten::relu", 40, self_us=8.0),
        ann("backward", 50, 100),
        op("aten::mm", 60, self_us=10.0),
    ]
    items, spans, unit = ta.extract(events)
    assert unit == "cpu op"
    assert sorted(i.name for i in items) == ["aten::addmm", "aten::linear", "aten::mm",
                                             "aten::relu"]  # fmt: skip
    ranges = {r["range"]: r for r in ta.range_table(items, ta.RangeIndex(spans), steps=1)}
    assert ranges["forward"]["ms_per_step"] == pytest.approx(40e-3)
    assert ranges["backward"]["share_pct"] == pytest.approx(20.0)


def test_attention_table_ratios():
    ranges = [
        {"range": "attention/scores", "ms_per_step": 2.0},
        {"range": "attention/softmax", "ms_per_step": 4.0},
        {"range": "attention/weighted_sum", "ms_per_step": 1.0},
    ]
    flops = {"scores": 8e9, "softmax": 1e9, "weighted_sum": 8e9}
    rows = {r["sub_step"]: r for r in ta.attention_table(ranges, flops)}
    assert rows["attention/softmax"]["time_vs_softmax"] == 1.0
    assert rows["attention/scores"]["time_vs_softmax"] == 0.5
    assert rows["attention/scores"]["flops_vs_softmax"] == 8.0
    assert rows["attention/scores"]["tflops"] == pytest.approx(8e9 / 2e-3 / 1e12)
    assert ta.attention_table([], flops) == []


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("ampere_sgemm_128x64_tn", "matmul"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm>", "matmul"),
        ("triton_tem_fused_mm_0", "matmul"),
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),
        ("aten::bmm", "matmul"),
        ("aten::matmul", "matmul"),
        ("aten::linear", "matmul"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>", "other"),
        ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 9>", "other"),
        ("triton_poi_fused_add_mul_0", "other"),
        ("triton_red_fused__to_copy_mean_pow_1", "other"),
        ("aten::_softmax", "other"),
        ("aten::mean", "other"),
        ("aten::embedding", "other"),
        ("aten::empty", "other"),
        ("aten::addcmul_", "other"),
        ("multi_tensor_apply_kernel", "other"),
        ("Memcpy HtoD (Pageable -> Device)", "other"),
        ("flash_fwd_kernel", "attention (fused)"),
        ("attn_fwd_kernel", "attention (fused)"),
        ("attn_bwd_preprocess_kernel", "attention (fused)"),
        ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64", "attention (fused)"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention (fused)"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention (fused)"),
    ],
)
def test_classify(name, cls):
    assert ta.classify(name) == cls


def _chrome_trace() -> dict:
    """A profiled step as `export_chrome_trace` writes it: annotations, launches, kernels."""

    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    return {
        "traceEvents": [
            x("user_annotation", "step", 0, 100),
            x("user_annotation", "forward", 0, 40),
            x("user_annotation", "optimizer", 60, 30),
            x("cpu_op", "aten::mm", 1, 5),
            x("cuda_runtime", "cudaLaunchKernel", 2, 1, correlation=7),
            x("cuda_driver", "cuLaunchKernel", 10, 1, correlation=8),  # a Triton kernel
            x("cuda_runtime", "cudaLaunchKernel", 61, 1, correlation=9),
            x("kernel", "sm90_gemm", 50, 20, correlation=7),  # runs after its range ended
            x("kernel", "triton_fused_rms", 71, 5, correlation=8),
            x("kernel", "multi_tensor_apply_kernel", 120, 30, correlation=9),
            x("gpu_memcpy", "Memcpy DtoD", 160, 4, correlation=99),  # launch not recorded
            x("gpu_user_annotation", "forward", 50, 26),  # GPU-side copy: not a span
            {"ph": "f", "cat": "ac2g", "id": 7, "ts": 2},  # flow events are ignored
        ]
    }


def test_chrome_trace_counts_each_device_event_once_by_launch_time():
    items, spans, unit = ta.extract_trace(_chrome_trace())
    assert unit == "kernel"
    assert sorted(i.name for i in items) == [
        "Memcpy DtoD",
        "multi_tensor_apply_kernel",
        "sm90_gemm",
        "triton_fused_rms",
    ]
    assert sum(i.dur_us for i in items) == 59.0
    assert {s.name for s in spans} == {"step", "forward", "optimizer"}
    ranges = {r["range"]: r for r in ta.range_table(items, ta.RangeIndex(spans), steps=1)}
    assert ranges["forward"]["ms_per_step"] == pytest.approx(25e-3)
    assert ranges["optimizer"]["ms_per_step"] == pytest.approx(30e-3)
    assert ranges[ta.OUTSIDE]["ms_per_step"] == pytest.approx(4e-3)
    level0 = [r["share_pct"] for r in ranges.values() if r["level"] == 0]
    assert sum(level0) == pytest.approx(100.0)
    # the events list alone works too
    again, _, _ = ta.extract_trace(_chrome_trace()["traceEvents"])
    assert again == items


def test_kernel_sequence_lists_each_device_event_once_in_gpu_order():
    """Which kernels a profiled call ran: device events only (no CPU ops, no GPU-side
    annotations), by their start on the GPU, a kernel launched twice listed once."""
    events = _gpu_step()
    events.append(gpu("softmax_warp_forward", 390, 395))  # again, later
    events.insert(0, gpu("triton_early_kernel", 150, 160))  # first on the GPU, listed last
    assert ta.kernel_sequence(events) == [
        "triton_early_kernel", "sm90_xmma_gemm_bf16", "softmax_warp_forward",
        "ampere_sgemm_128x64", "nvjet_tst_64x8", "vectorized_elementwise_kernel",
        "multi_tensor_apply_kernel", "Memcpy DtoD",
    ]  # fmt: skip
    assert ta.kernel_sequence([op("aten::mm", 1)]) == []
