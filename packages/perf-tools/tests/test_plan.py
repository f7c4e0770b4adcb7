"""perf_tools.plan: the closed forms against brute-force sums of ring steps, and the CLI.

The brute force moves chunks around a ring rank by rank (and sums real values for the
reduce-scatter), one step at a time, and adds up each step's time (every rank sends one chunk
of S/n bytes on its own link at once); a strategy's communication is then every collective it
issues in a step (per parameter tensor, per FSDP unit, per block and pass), simulated and
summed. The closed forms must equal these sums.
"""

from __future__ import annotations

import json
import math

import pytest

from perf_tools import accounting, plan
from perf_tools import plan_model as pm

TINY = accounting.ModelDims("t", d_model=64, d_ff=192, num_layers=3, vocab_size=1000, num_heads=4)


# ------------------------------------------------------------------ ring brute force
def ring_all_gather(nbytes: float, n: int, bw: float) -> float:
    """Rank r starts with chunk r; at step s it forwards chunk (r - s) mod n to rank r + 1."""
    have = [{r} for r in range(n)]
    t = 0.0
    for step in range(n - 1):
        sends = [((r + 1) % n, (r - step) % n) for r in range(n)]
        for r, (_, chunk) in enumerate(sends):
            assert chunk in have[r]
        for dst, chunk in sends:
            have[dst].add(chunk)
        t += (nbytes / n) / bw
    assert all(h == set(range(n)) for h in have)
    return t


def ring_reduce_scatter(nbytes: float, n: int, bw: float) -> float:
    """Rank r holds value r * 10 + c of chunk c; at step s it sends its running sum of chunk
    (r - s - 1) mod n to rank r + 1, which adds its own. Rank r ends with chunk r summed."""
    acc = [[r * 10 + c for c in range(n)] for r in range(n)]
    t = 0.0
    for step in range(n - 1):
        sends = [((r + 1) % n, (r - step - 1) % n, acc[r][(r - step - 1) % n]) for r in range(n)]
        for dst, chunk, value in sends:
            acc[dst][chunk] += value
        t += (nbytes / n) / bw
    for r in range(n):
        assert acc[r][r] == sum(q * 10 + r for q in range(n))
    return t


def ring_all_reduce(nbytes: float, n: int, bw: float) -> float:
    return ring_reduce_scatter(nbytes, n, bw) + ring_all_gather(nbytes, n, bw)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_ring_closed_forms_equal_step_by_step_sums(n):
    for nbytes in (1.0, 3e6, 7.25e9):
        bw = 4.5e11
        assert pm.all_gather_time(nbytes, n, bw) == pytest.approx(ring_all_gather(nbytes, n, bw))
        assert pm.reduce_scatter_time(nbytes, n, bw) == pytest.approx(
            ring_reduce_scatter(nbytes, n, bw)
        )
        assert pm.all_reduce_time(nbytes, n, bw) == pytest.approx(ring_all_reduce(nbytes, n, bw))
        assert pm.all_reduce_time(nbytes, n, bw) == pytest.approx(
            2 * (n - 1) / n * nbytes / bw, abs=0.0
        )


# ------------------------------------------------------------------ strategies brute force
def units(m: accounting.ModelDims) -> list[list[int]]:
    """Parameter tensors (elements) grouped as FSDP units: embedding, each block, root."""
    d, f = m.d_model, m.d_ff
    block = [3 * d * d, d * d, 2 * d * f, d * f, d, d]  # qkv, output, w13, w2, two norms
    return [[m.vocab_size * d], *([block] * m.num_layers), [d, m.vocab_size * d]]


def brute_force_comm(layout: pm.Layout, work: pm.Workload, hw: pm.Hardware, micro: int) -> float:
    m, b = work.model, work.dtypes.comm
    n = layout.devices
    tensors = units(m)
    assert sum(map(sum, tensors)) == accounting.param_count(m)
    total = 0.0
    if layout.strategy == "dp":  # every gradient all-reduced once per step
        for unit in tensors:
            for size in unit:
                total += ring_all_reduce(size * b, n, hw.bandwidth(n))
        return total
    if layout.dp > 1:  # per micro-step and unit: gather (fwd), gather (bwd), reduce-scatter
        bw = hw.bandwidth(n)
        for _ in range(micro):
            for unit in tensors:
                shard_of_tp = sum(unit) * b / layout.tp
                total += 2 * ring_all_gather(shard_of_tp, layout.dp, bw)
                total += ring_reduce_scatter(shard_of_tp, layout.dp, bw)
    if layout.tp > 1:  # per block: attention and FFN outputs (fwd), their inputs' grads (bwd)
        act = work.global_tokens / layout.dp * m.d_model * work.dtypes.activation
        for _ in range(m.num_layers):
            for _pass in ("forward", "backward"):
                for _sub in ("attention", "ffn"):
                    total += ring_all_reduce(act, layout.tp, hw.bandwidth(layout.tp))
    return total


HW = pm.Hardware("test", flops=1e15, memory=80e9, intra_bw=4e11, inter_bw=5e10, gpus_per_node=4)


@pytest.mark.parametrize(
    "layout",
    [
        pm.Layout("dp", 4, 1),
        pm.Layout("dp", 12, 1),  # crosses nodes: the slow link
        pm.Layout("fsdp", 3, 1),
        pm.Layout("fsdp", 8, 1),
        pm.Layout("tp", 1, 2),
        pm.Layout("tp", 1, 4),
        pm.Layout("fsdp x tp", 3, 2),  # TP in a node, FSDP across
        pm.Layout("fsdp x tp", 2, 2),  # all in one node
    ],
    ids=lambda lay: f"{lay.strategy}-{lay.dp}x{lay.tp}",
)
@pytest.mark.parametrize("micro", [1, 3])
def test_strategy_comm_equals_sum_of_its_collectives(layout, micro):
    work = pm.Workload(TINY, global_tokens=96 * 128, seq=128)
    closed = sum(pm.comm_terms(layout, work, HW, micro).values())
    assert closed == pytest.approx(brute_force_comm(layout, work, HW, micro), rel=1e-12)


def test_ffn_only_tp_has_one_allreduce_per_ffn_and_pass():
    # The handout's XXL: each block is W1 (column parallel) then W2 (row parallel); one
    # all-reduce of the (G, D) activations in forward, one of their gradient in backward.
    work = pm.Workload(accounting.XXL, global_tokens=4096, seq=2048)
    terms = pm.comm_terms(pm.Layout("tp", 1, 4), work, HW)
    per = pm.all_reduce_time(4096 * 16384 * 2, 4, HW.intra_bw)
    assert terms["tp_allreduce"] == pytest.approx(2 * 126 * per)


def test_largest_compute_bound_n_matches_the_closed_form():
    # One bandwidth everywhere: comm/compute = k (N - 1) P b C / (W F_step) for DP (k = 2)
    # and FSDP (k = 3), so N_max = floor(1 + W F_step / (k P b C)).
    hw = pm.Hardware("flat", flops=1e15, memory=80e9, intra_bw=1e11, inter_bw=1e11)
    work = pm.Workload(accounting.preset("xl"), global_tokens=2**24, seq=1024)
    p_bytes, f_step = work.params * 2, work.step_flops()
    for strategy, k in (("dp", 2), ("fsdp", 3)):
        expected = math.floor(1 + hw.intra_bw * f_step / (k * p_bytes * hw.flops))
        assert 1 < expected < work.sequences
        got = pm.max_compute_bound(strategy, work, hw)
        assert got["max_N"] == expected
        assert got["limited_by"] == "comm"
    # TP: comm / compute does not depend on the batch; xl has 25 heads (divisors 1, 5, 25)
    tp = pm.max_compute_bound("tp", work, hw)
    assert tp["max_N"] in (1, 5, 25)
    for t in (1, 5, 25):
        lay = pm.Layout("tp", 1, t)
        bound = sum(pm.comm_terms(lay, work, hw).values()) <= f_step / (t * hw.flops)
        assert bound == (t <= tp["max_N"])


def test_activations_reuse_the_accounting_and_split_under_tp():
    m, seq = accounting.preset("small"), 512
    work = pm.Workload(m, global_tokens=8 * seq, seq=seq)
    tokens = 2 * seq
    expected = accounting.activation_elements(m, tokens, seq) * 2
    expected += accounting.lse_bytes(m, tokens, "sdpa")
    assert pm.activation_bytes(work, tokens, 1, checkpointed=False) == pytest.approx(expected)
    d, f, v, h, layers = m.d_model, m.d_ff, m.vocab_size, m.num_heads, m.num_layers
    tp4 = tokens * (layers * ((4 * d + (6 * d + 4 * f) / 4) * 2 + 4 * h / 4) + (2 * d + v / 4) * 2)
    assert pm.activation_bytes(work, tokens, 4, checkpointed=False) == pytest.approx(tp4)
    ckpt = tokens * (layers * d * 2 + (10 * d + 4 * f) * 2 + 4 * h + (2 * d + v) * 2)
    assert pm.activation_bytes(work, tokens, 1, checkpointed=True) == pytest.approx(ckpt)


def test_layouts_cover_every_factorization_and_check_divisibility():
    work = pm.Workload(TINY, global_tokens=96 * 128, seq=128)
    grids = [(lay.strategy, lay.dp, lay.tp) for lay in pm.layouts(12, work)]
    assert grids == [
        ("dp", 12, 1),
        ("fsdp", 12, 1),
        ("tp", 1, 12),
        ("fsdp x tp", 6, 2),
        ("fsdp x tp", 4, 3),
        ("fsdp x tp", 3, 4),
        ("fsdp x tp", 2, 6),
    ]
    assert "tp=3" in pm.invalid_reason(pm.Layout("fsdp x tp", 4, 3), work)
    assert pm.invalid_reason(pm.Layout("fsdp x tp", 3, 4), work) is None
    assert "sequences" in pm.invalid_reason(pm.Layout("fsdp", 97, 1), work)


def test_memory_per_device_and_recommendation():
    work = pm.Workload(accounting.preset("8B"), global_tokens=2**22, seq=8192)
    rows = pm.plan_rows([8, 64], work, pm.HARDWARE["H100"])
    params = work.params
    for r in rows:
        shard = 1 if r["strategy"] == "dp" else r["N"]
        assert r["weights_GB"] == pytest.approx(4 * params / shard / 1e9)
        assert r["optim_GB"] == pytest.approx(8 * params / shard / 1e9)
        act = r["act_ckpt_GB"] if r["ckpt"] else r["act_GB"]
        assert r["total_GB"] == pytest.approx(16 * params / shard / 1e9 + act)
        assert r["fits"] == (r["total_GB"] <= 0.9 * 80)  # 10% left for buffers
    for n in (8, 64):
        at_n = [r for r in rows if r["N"] == n]
        best = [r for r in at_n if r["recommended"]]
        assert len(best) == 1
        assert best[0]["fits"]
        assert best[0]["step_overlap_ms"] == min(r["step_overlap_ms"] for r in at_n if r["fits"])
    # 8B does not fit replicated on an 80 GB GPU (130 GB of fp32 states and moments)
    assert not any(r["fits"] for r in rows if r["strategy"] == "dp")


def test_cli_writes_table_csv_json_and_plot(tmp_path, capsys):
    out = tmp_path / "plan"
    argv = ["--size", "8B", "--seq", "8192", "--global-batch", "4M", "--devices", "8,64"]
    argv += ["--csv", str(out) + ".csv", "--json", str(out) + ".json"]
    argv += ["--plot", str(out) + ".png", "--quiet"]
    assert plan.main(argv) == 0
    text = capsys.readouterr().out
    assert "fsdp x tp" in text
    assert "N=64:" in text
    payload = json.loads((tmp_path / "plan.json").read_text())
    tables = {r["table"] for r in payload["rows"]}
    assert tables == {"setup", "plan", "max_n"}
    assert (tmp_path / "plan.csv").read_text().startswith("table,")
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_cli_custom_model_and_hardware_overrides(capsys):
    argv = ["--d-model", "1024", "--d-ff", "4096", "--num-layers", "4", "--ffn-only"]
    argv += ["--flops", "4.6e14", "--bandwidth", "1.8e11", "--memory", "95", "--devices", "1:4"]
    argv += ["--quiet"]
    assert plan.main(argv) == 0
    assert "overridden" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "--devices"),
        (["--devices", "8:4"], "A <= B"),
        (["--global-batch", "lots"], "--global-batch"),
        (["--gpu", "V100"], "--gpu"),
        (["--d-model", "512"], "--d-model, --d-ff and --num-layers"),
        (["--size", "huge"], "--size"),
        (["--usable-memory", "1.5"], "--usable-memory"),
    ],
)
def test_cli_errors_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        plan.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_from_args_maps_the_flags_and_names_a_bad_field():
    argv = ["--devices", "64,8", "8:16", "--gpu", "h200-sxm", "--memory", "95", "--seq", "512"]
    cfg = plan.config_from_args(plan.build_parser().parse_args(argv))
    assert cfg.devices == (8, 16, 64)  # sorted, each N once
    assert (cfg.gpu, cfg.memory, cfg.seq, cfg.global_batch) == ("H200", 95.0, 512, 4 * 2**20)
    with pytest.raises(ValueError, match=r"^usable_memory: expected a fraction in \(0, 1\]"):
        plan.PlanConfig(usable_memory=1.5)


def test_config_refuses_bools_and_bare_strs():
    """A bool is not a device count, a bare str not a list of them."""
    assert plan.PlanConfig(devices=[16, 8, 8]).devices == (8, 16)
    for devices in ([8, True], "8"):
        with pytest.raises(ValueError, match=r"^devices: "):
            plan.PlanConfig(devices=devices)
