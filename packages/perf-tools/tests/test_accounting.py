"""perf_tools.accounting against numbers worked out by hand (the arithmetic is written here)."""

from __future__ import annotations

import json
import math

import pytest

from perf_tools import accounting as acc

# The handout's XXL: 126 blocks of two linears, d_model 16384, d_ff 53248.
XXL_PARAMS = 126 * 2 * 16384 * 53248  # = 219,848,638,464


def test_xxl_parameter_and_state_bytes() -> None:
    assert XXL_PARAMS == 219_848_638_464
    mem = acc.memory(acc.XXL, acc.Dtypes(), batch=1, seq=1)
    assert mem.params == XXL_PARAMS
    assert mem.master == 4 * XXL_PARAMS == 879_394_553_856  # fp32 master weights
    assert mem.grads == 4 * XXL_PARAMS  # fp32 accumulated gradients
    assert mem.optim_state == 2 * 4 * XXL_PARAMS == 1_758_789_107_712  # AdamW m and v, fp32
    assert mem.model_states == 16 * XXL_PARAMS == 3_517_578_215_424
    # 3.5 TB is 43.97 H100s (80 GB) worth of memory.
    assert mem.model_states / 80e9 == pytest.approx(43.97, abs=0.005)


def test_xxl_activations_per_token() -> None:
    # Each block's two linears keep their inputs: d_model + d_ff values per token, in bf16.
    per_token = 126 * (16384 + 53248) * 2
    assert per_token == 17_547_264
    mem = acc.memory(acc.XXL, acc.Dtypes(), batch=4, seq=1024)
    assert mem.activations == 4 * 1024 * per_token


def test_fsdp_per_device_memory_and_smallest_n() -> None:
    mem = acc.memory(acc.XXL, acc.Dtypes(), batch=1, seq=1)
    act = 17_547_264
    # (b): weights, grads, optimizer state and half the activations sharded N ways.
    for n in (1, 16, 38):
        expected = (16 * XXL_PARAMS + act / 2) / n + act / 2
        assert acc.fsdp_bytes(mem, n) == pytest.approx(expected, rel=1e-12)
    # 95 GB (TPU v5p): N >= (16 P + A/2) / (95e9 - A/2) = 37.03 -> 38; 80 GB (H100) -> 44.
    assert (16 * XXL_PARAMS + act / 2) / (95e9 - act / 2) == pytest.approx(37.031, abs=1e-3)
    assert acc.min_devices(mem, 95e9) == 38
    assert acc.min_devices(mem, 80e9) == 44
    assert acc.fsdp_bytes(mem, 38) <= 95e9 < acc.fsdp_bytes(mem, 37)


def test_min_devices_none_when_the_unsharded_half_does_not_fit() -> None:
    # 100k tokens per device: the unsharded half of the activations alone is 877 GB.
    mem = acc.memory(acc.XXL, acc.Dtypes(), batch=100, seq=1000)
    assert mem.activations / 2 == 100 * 1000 * 17_547_264 / 2
    assert acc.min_devices(mem, 95e9) is None


def test_compute_bound_batch_for_fsdp_times_tp() -> None:
    # B >= (X F C / M_X) / (F W - Y C / M_Y) with X=16, Y=4, M_X=2, M_Y=1, W=1.8e11, C=4.6e14.
    num = 16 * 53248 * 4.6e14 / 2  # 1.9595264e20
    den = 53248 * 1.8e11 - 4 * 4.6e14 / 1  # 9.58464e15 - 1.84e15 = 7.74464e15
    assert num / den == pytest.approx(25301.71, abs=0.01)
    out = acc.compute_bound_batch(53248, acc.Mesh())
    assert out["global_tokens"] == pytest.approx(num / den, rel=1e-12)
    assert out["tokens_per_chip"] == pytest.approx(25301.71 / 64, abs=1e-3)  # 395.34
    assert out["tokens_per_fsdp_shard"] == pytest.approx(25301.71 / 16, abs=1e-3)
    # At that batch the forward's math time equals its communication time (the definition).
    b, d, f, c, w = out["global_tokens"], 16384, 53248, 4.6e14, 1.8e11
    t_math = 4 * b * d * f / (64 * c)
    t_comm = 4 * d * f / (4 * w * 2) + 4 * b * d / (16 * w * 1)
    assert t_math == pytest.approx(t_comm, rel=1e-12)


def test_compute_bound_batch_never_when_tp_traffic_dominates() -> None:
    # d_ff 6400 (xl): F W = 1.152e15 < Y C = 1.84e15, so no batch makes it compute-bound.
    assert math.isinf(acc.compute_bound_batch(6400, acc.Mesh())["global_tokens"])


def test_lm_core_xl_parameter_count() -> None:
    # embeddings + head 2 V D, per block 4 D^2 + 3 D F + 2 D, final norm D.
    d, f, layers, vocab = 1600, 6400, 48, 10_000
    expected = 2 * vocab * d + layers * (4 * d * d + 3 * d * f + 2 * d) + d
    assert expected == 1_998_235_200
    assert acc.param_count(acc.preset("xl")) == expected


def test_lm_core_formula_matches_the_real_model() -> None:
    import torch

    from lm_core import MODEL_SIZES, TransformerLM

    for name in ("tiny", "small"):
        with torch.device("meta"):
            model = TransformerLM(MODEL_SIZES[name])
        assert acc.param_count(acc.preset(name)) == sum(p.numel() for p in model.parameters())


def test_communication_volumes() -> None:
    p = 1000
    out = acc.comm_per_step(p, 4, grad_bytes=2, param_bytes=4)
    # Ring all-reduce moves 2 (N-1)/N of the data; reduce-scatter and all-gather (N-1)/N each.
    assert out["ddp_GB"] == 2 * 3 / 4 * 2000
    assert out["zero1_GB"] == 3 / 4 * (2000 + 4000)
    assert out["zero_shard_GB"] == 2 * 3 / 4 * 2000 + 3 / 4 * 4000
    assert out["fsdp_GB"] == 3 / 4 * (2 * 4000 + 2000)


def test_cli_tables_and_json(tmp_path, capsys) -> None:
    out = tmp_path / "acc.json"
    assert acc.main(["--json", str(out), "--devices", "2", "16"]) == 0
    printed = capsys.readouterr().out
    assert "Smallest FSDP degree" in printed
    rows = json.loads(out.read_text())["rows"]
    fits = {r["device_GB"]: r["min_fsdp_devices"] for r in rows if r["table"] == "fits"}
    assert fits == {80.0: 44, 95.0: 38}
    (bound,) = [r for r in rows if r["table"] == "compute_bound"]
    assert bound["global_tokens"] == pytest.approx(25301.71, abs=0.01)
    assert {r["N"] for r in rows if r["table"] == "fsdp"} == {2, 16, 38, 44}


def test_cli_custom_dims_and_errors(tmp_path) -> None:
    out = tmp_path / "c.json"
    argv = ["--d-model", "8", "--d-ff", "32", "--num-layers", "3", "--ffn-only"]
    assert acc.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    (model,) = [r for r in rows if r["table"] == "model"]
    assert model["params"] == 3 * 2 * 8 * 32
    with pytest.raises(SystemExit):
        acc.main(["--d-model", "8"])  # incomplete custom model
    with pytest.raises(SystemExit):
        acc.main(["--size", "huge"])
    with pytest.raises(SystemExit):
        acc.main(["--master-dtype", "fp7"])
    with pytest.raises(SystemExit):
        acc.main(["--sharded-activations", "1.5"])


def test_config_from_args_maps_the_flags_and_names_a_bad_field() -> None:
    argv = ["--size", "xl", "--batch", "2", "--master-dtype", "bf16", "--optim-values", "1"]
    cfg = acc.config_from_args(acc.build_parser().parse_args([*argv, "--tp", "8"]))
    assert (cfg.size, cfg.batch, cfg.seq) == ("xl", 2, 1)
    assert cfg.dtypes == acc.Dtypes(master=2, optim_values=1)
    assert cfg.mesh == acc.Mesh(y=8)
    assert acc.model_from_config(cfg) == acc.preset("xl")
    with pytest.raises(ValueError, match=r"^attention: expected sdpa or naive"):
        acc.AccountingConfig(attention="flash")


def test_config_holds_tuples_and_refuses_bools_and_bare_strs():
    """Lists are held as tuples (the frozen config hashes); a bool is not a device count, a
    bare str not a list of sizes."""
    cfg = acc.AccountingConfig(devices=[1, 2], device_memory_gb=[80.0])
    assert (cfg.devices, cfg.device_memory_gb) == ((1, 2), (80.0,))
    assert hash(cfg) == hash(acc.AccountingConfig(devices=(1, 2), device_memory_gb=(80.0,)))
    bad = [({"devices": [True]}, "devices"), ({"device_memory_gb": "80"}, "device_memory_gb")]
    for change, field in bad:
        with pytest.raises(ValueError, match=f"^{field}: "):
            acc.AccountingConfig(**change)
