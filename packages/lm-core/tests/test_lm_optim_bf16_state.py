"""AdamW(state_dtype=torch.bfloat16): bf16 moments beside fp32 weights (lm_core.optim_lowp and
its Triton kernel, run on CPU by Triton's interpreter), against torch's AdamW and an fp64
emulation; the default (fp32 states) against torch's AdamW bitwise; state dicts across dtypes."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from lm_core import AdamW, OverlappedOptimizer, TransformerLM, get_config
from lm_core import optim_lowp as lowp

BF16 = torch.bfloat16
KW = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
SHAPES = [(33, 7), (50,), (3, 2, 4)]
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel in its interpreter"
)


def _params(seed: int = 0, dtype=torch.float32, shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _grads(params, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def _train(make, params, steps=6, seed=1):
    opt = make(params)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _grads(params, gen)
        opt.step()
    return opt


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 ulps of b (both bf16; same-sign neighbours differ by 1)."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return (ia - ib).abs()


# ----------------------------------------------------------------------------- the default


@pytest.mark.parametrize(("fused", "ref_kw"), [(False, {"foreach": True}), (True, {"fused": True})])
def test_default_states_are_torchs_adamw_bitwise(fused, ref_kw):
    """state_dtype's default (fp32) leaves the update as it was: torch's AdamW to the bit."""
    ours, ref = _params(), _params()
    opt = _train(lambda ps: AdamW(ps, fused=fused, **KW), ours)
    _train(lambda ps: torch.optim.AdamW(ps, **ref_kw, **KW), ref)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    assert opt.state_dtype == torch.float32
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    # nothing new in the state dict: it loads into torch's AdamW as before
    assert set(opt.state_dict()["param_groups"][0]) == {
        *("lr", "betas", "eps", "weight_decay", "fused", "params")
    }


# ----------------------------------------------------------------------------- numerics


def test_bf16_states_have_their_dtype_and_other_params_keep_theirs():
    dtypes = (torch.float32, BF16, torch.float64)
    p32, p16, p64 = (torch.nn.Parameter(torch.randn(8, dtype=d)) for d in dtypes)
    opt = _train(lambda ps: AdamW(ps, state_dtype=BF16, **KW), [p32, p16, p64], steps=2)
    assert {n: opt.state[p32][n].dtype for n in lowp.MOMENTS} == dict.fromkeys(lowp.MOMENTS, BF16)
    assert opt.state[p64]["exp_avg"].dtype == torch.float64  # only fp32 weights get bf16 moments
    assert opt.state[p16]["exp_avg_sq"].dtype == BF16
    assert p32.dtype == torch.float32
    assert opt.state[p32]["step"].item() == 2.0
    assert opt.state[p32]["step"].device.type == "cpu"  # host bias corrections off CUDA


def _emulated(params, steps, rounding_seed=None):
    """torch's AdamW in float64 with the moments rounded to bf16 (nearest) after each step:
    what bf16 states mean, computed independently of lm_core."""
    ref = [torch.nn.Parameter(p.detach().double()) for p in params]
    opt = torch.optim.AdamW(ref, foreach=False, **KW)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ref:
            p.grad = torch.randn(p.shape, generator=gen).double()
        opt.step()
        for st in opt.state.values():
            for n in lowp.MOMENTS:
                st[n].copy_(st[n].to(BF16).double())
    return ref, opt


def test_nearest_rounding_is_adamw_with_moments_rounded_each_step():
    """The bf16-state update = fp64 AdamW whose moments are rounded to bf16 after every step
    (fp32 vs fp64 arithmetic aside: a moment within 1e-6 of a rounding tie may land one bf16
    ulp apart, so >= 99% must agree exactly and all within 1 ulp; weights to fp32 precision)."""
    ours = _params()
    opt = _train(lambda ps: AdamW(ps, state_dtype=BF16, state_rounding="nearest", **KW), ours)
    ref, ref_opt = _emulated(_params(), 6)
    same = total = 0
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r.detach(), rtol=1e-5, atol=1e-6)
        for n in lowp.MOMENTS:
            ulps = _ulps(opt.state[p][n], ref_opt.state[r][n].to(BF16))
            assert ulps.max() <= 1, n
            same += int((ulps == 0).sum())
            total += ulps.numel()
    assert same >= 0.99 * total


def test_bf16_states_stay_close_to_fp32_states():
    """Six steps at lr 1e-2: the weights move up to ~6e-2; bf16 moments (8 significant bits)
    perturb each update by about 2^-8 relative, so the weights must agree with fp32 states
    to well under 1% of that movement (1e-3), and must differ (the option does something)."""
    for rounding in lowp.ROUNDINGS:
        ours, ref = _params(), _params()
        _train(lambda ps, r=rounding: AdamW(ps, state_dtype=BF16, state_rounding=r, **KW), ours)
        _train(lambda ps: AdamW(ps, **KW), ref)
        diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
        assert 0 < diff < 1e-3, (rounding, diff)


def test_stochastic_rounding_is_unbiased_between_the_two_neighbours():
    lo = torch.tensor(1.0, dtype=BF16)
    hi = torch.tensor(1.0 + 2**-7, dtype=BF16)  # the next bf16 above 1
    for frac in (0.1, 0.5, 0.9):
        x = torch.full((100_000,), 1.0 + frac * 2**-7)
        out = lowp.round_to_bf16(x, "stochastic", step=3, which=0)
        assert set(out.float().unique().tolist()) <= {lo.item(), hi.item()}
        up = (out == hi).float().mean().item()
        assert abs(up - frac) < 0.01, (frac, up)  # 100k draws: std 0.0016
        assert abs(out.float().mean().item() - x[0].item()) < 2**-7 * 0.01
    # negative values round in magnitude the same way; NaN and infinities pass through
    neg = lowp.round_to_bf16(-x, "stochastic", 3, 0)
    assert torch.equal(neg, -out)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    got = lowp.round_to_bf16(special, "stochastic", 1, 1).float()
    assert got[0].isnan()
    assert got[1:].tolist() == [float("inf"), -float("inf"), 0.0]
    # other bits at another step or for the other moment; the same bits again for the same
    a = lowp.stochastic_bits(torch.Size([1000]), 5, 0, torch.device("cpu"))
    assert torch.equal(a, lowp.stochastic_bits(torch.Size([1000]), 5, 0, torch.device("cpu")))
    for step, which in ((6, 0), (5, 1)):
        b = lowp.stochastic_bits(torch.Size([1000]), step, which, torch.device("cpu"))
        assert (a == b).float().mean() < 0.01


def test_round_to_nearest_freezes_a_slowly_decaying_moment_and_stochastic_does_not():
    """Why stochastic is the default: v * 0.999 is within half a bf16 ulp of v, so round to
    nearest never lets v decay; stochastic rounding decays it as fp32 does, on average."""
    v = torch.full((10_000,), 1.0)
    frozen = lowp.round_to_bf16(v * 0.999, "nearest", 1, 1).float()
    assert torch.equal(frozen, v)
    x = v.to(BF16)
    for t in range(1, 101):
        x = lowp.round_to_bf16(x.float() * 0.999, "stochastic", t, 1)
    assert abs(x.float().mean().item() - 0.999**100) < 0.005  # 0.905 in fp32


def test_overlapped_optimizer_with_bf16_states_is_one_adamw_bitwise():
    """The random bits depend on (step, element, moment) only, so stepping per unit during
    the backward gives the plain optimizer's result to the bit."""
    results = []
    for overlapped in (False, True):
        torch.manual_seed(0)
        model = TransformerLM(get_config("tiny", num_layers=2, attention="naive"))
        if overlapped:
            opt = OverlappedOptimizer(model, state_dtype=BF16, **KW)
        else:
            opt = AdamW(model.parameters(), state_dtype=BF16, **KW)
        ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
        for _ in range(3):
            logits = model(ids[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.step()
            if not overlapped:
                opt.zero_grad(set_to_none=True)
        results.append((copy.deepcopy(model.state_dict()), opt.state_dict()))
    (w0, s0), (w1, s1) = results
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    for i, entry in s0["state"].items():
        for n in lowp.MOMENTS:
            assert entry[n].dtype == BF16
            assert torch.equal(entry[n], s1["state"][i][n])


# ----------------------------------------------------------------------------- the kernel


@needs_interpreter
@pytest.mark.parametrize("rounding", lowp.ROUNDINGS)
def test_triton_kernel_is_the_pytorch_update(rounding):
    """fused=True runs the Triton kernel (here in its CPU interpreter), fused=False the
    PyTorch ops: the moments agree to the bit (same fp32 math, same rounding bits), the
    weights to fp32 rounding (the kernel's bias corrections are fp32, as torch's fused)."""
    kernel, torch_ops = _params(), _params()
    make = lambda f: lambda ps: AdamW(ps, fused=f, state_dtype=BF16, state_rounding=rounding, **KW)
    opt_k = _train(make(True), kernel, steps=4)
    opt_t = _train(make(False), torch_ops, steps=4)
    for a, b in zip(kernel, torch_ops):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
        for n in lowp.MOMENTS:
            assert torch.equal(opt_k.state[a][n], opt_t.state[b][n]), n


@needs_interpreter
def test_triton_kernel_edge_cases():
    """A tensor learning rate (read on the device, as under a CUDA graph), beta1 = 0, a
    strided parameter, an empty one: the kernel agrees with the PyTorch update."""
    kw = {**KW, "betas": (0.0, 0.99)}
    base = torch.randn(6, 10, generator=torch.Generator().manual_seed(4))
    results = []
    for fused, lr in ((True, torch.tensor(1e-2)), (False, 1e-2)):
        strided = torch.nn.Parameter(base.clone().t())  # (10, 6), not contiguous
        empty = torch.nn.Parameter(torch.zeros(0, 3))
        opt = AdamW([strided, empty], fused=fused, state_dtype=BF16, **kw)
        opt.param_groups[0]["lr"] = lr  # as lm_core.graph_step.DeviceLR sets it
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            _grads([strided, empty], gen)
            opt.step()
        results.append((strided, opt.state[strided]))
    (a, sa), (b, sb) = results
    assert not a.is_contiguous()
    assert not sa["exp_avg"].is_contiguous()
    torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    for n in lowp.MOMENTS:
        assert torch.equal(sa[n], sb[n])


def test_kernel_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert lowp.backend(None, cpu) == lowp.backend(False, cuda) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"fused=True, state_dtype=torch.bfloat16"):
        lowp.backend(True, cpu)
    p = [torch.nn.Parameter(torch.zeros(3))]
    p[0].grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        AdamW(p, fused=True, state_dtype=BF16).step()


@pytest.mark.parametrize("bad", [torch.float16, torch.float64, "bf16", None])
def test_bad_state_dtype_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"state_dtype must be torch\.float32 or torch\.bfloat16"):
        AdamW(_params(), state_dtype=bad)


def test_bad_rounding_is_refused_naming_it():
    with pytest.raises(ValueError, match="state_rounding must be one of"):
        AdamW(_params(), state_dtype=BF16, state_rounding="up")


def test_graph_capture_needs_the_kernel_for_bf16_states():
    from lm_core import graph_step as gs

    cuda = torch.device("cuda")  # a feature check: no GPU is touched
    p = [torch.nn.Parameter(torch.zeros(3))]
    gs.check_optimizer(AdamW(p, state_dtype=BF16), cuda)  # fused=None: the Triton kernel
    with pytest.raises(RuntimeError, match="keeps bf16 moments"):
        gs.check_optimizer(AdamW(p, fused=False, state_dtype=BF16), cuda)


# ----------------------------------------------------------------------------- state dicts


def _continue(opt, params, steps=2, seed=9):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _grads(params, gen)
        opt.step()


def test_bf16_state_dict_round_trip_continues_bitwise():
    a, b = _params(), _params()
    opt_a = _train(lambda ps: AdamW(ps, state_dtype=BF16, **KW), a, steps=3)
    _train(lambda ps: AdamW(ps, state_dtype=BF16, **KW), b, steps=3)
    sd = opt_a.state_dict()
    assert all(sd["state"][0][n].dtype == BF16 for n in lowp.MOMENTS)  # saved as they are
    opt_b = AdamW(b, state_dtype=BF16, **KW)
    loaded = copy.deepcopy(sd)
    opt_b.load_state_dict(loaded)
    # like torch's: tensors of the right dtype and device are kept, not copied
    assert opt_b.state[b[0]]["exp_avg"] is loaded["state"][0]["exp_avg"]
    _continue(opt_a, a)
    _continue(opt_b, b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert opt_b.state[b[0]]["step"].item() == 5


def test_state_dicts_convert_between_fp32_and_bf16_states():
    """fp32 states load into a bf16-state optimizer rounded to nearest; bf16 states load
    into an fp32-state one (and into torch's AdamW) exactly; both then train on."""
    p32, p16 = _params(), _params()
    opt32 = _train(lambda ps: AdamW(ps, **KW), p32, steps=3)
    opt16 = _train(lambda ps: AdamW(ps, state_dtype=BF16, **KW), p16, steps=3)

    into16 = AdamW(p32, state_dtype=BF16, **KW)
    into16.load_state_dict(opt32.state_dict())
    into32 = AdamW(p16, **KW)
    into32.load_state_dict(opt16.state_dict())
    torch_ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in p16], **KW)
    sd = copy.deepcopy(opt16.state_dict())
    for g in sd["param_groups"]:
        g.pop("fused")
    torch_ref.load_state_dict(sd)
    for i, (p, q) in enumerate(zip(p32, p16)):
        for n in lowp.MOMENTS:
            assert torch.equal(into16.state[p][n], opt32.state[p][n].to(BF16))
            assert into32.state[q][n].dtype == torch.float32
            assert torch.equal(into32.state[q][n], opt16.state[q][n].float())
            assert torch.equal(torch_ref.state[torch_ref.param_groups[0]["params"][i]][n],
                               opt16.state[q][n].float())  # fmt: skip
        assert into16.state[p]["step"].item() == 3
    _continue(into16, p32)
    _continue(into32, p16)
    assert into16.state[p32[0]]["exp_avg"].dtype == BF16
    assert into32.state[p16[0]]["exp_avg"].dtype == torch.float32
    assert into16.state[p32[0]]["step"].item() == into32.state[p16[0]]["step"].item() == 5


def test_checkpoint_file_round_trip_with_bf16_states(tmp_path):
    from lm_core import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = TransformerLM(get_config("tiny"))
    opt = AdamW(model.parameters(), state_dtype=BF16, **KW)
    ids = torch.randint(0, 256, (2, 9))
    model(ids).float().pow(2).mean().backward()
    opt.step()
    save_checkpoint(tmp_path / "ck.pt", model, opt, step=1)
    fresh = TransformerLM(get_config("tiny"))
    for dtype in (BF16, torch.float32):
        opt2 = AdamW(fresh.parameters(), state_dtype=dtype, **KW)
        load_checkpoint(tmp_path / "ck.pt", fresh, opt2)
        for p, q in zip(model.parameters(), fresh.parameters()):
            assert opt2.state[q]["exp_avg_sq"].dtype == dtype
            assert torch.equal(opt2.state[q]["exp_avg_sq"].to(BF16), opt.state[p]["exp_avg_sq"])


def test_deepcopy_keeps_the_state_dtype():
    opt = AdamW(_params(), state_dtype=BF16, state_rounding="nearest")
    clone = copy.deepcopy(opt)
    assert (clone.state_dtype, clone.state_rounding) == (BF16, "nearest")


# ----------------------------------------------------------------------------- the trainer

FAST = ["--size", "tiny", "--context-length", "32", "--batch-size", "4", "--no-progress"]


def test_trainer_flag_and_toml_key(tmp_path, capsys):
    from lm_core.train import parse_args
    from lm_core.train_config import ConfigError, TrainConfig

    assert parse_args(FAST).optim.state_dtype == "fp32"
    assert parse_args([*FAST, "--optimizer-state-dtype", "bf16"]).optim.state_dtype == "bf16"
    with pytest.raises(SystemExit):
        parse_args([*FAST, "--optimizer-state-dtype", "fp16"])
    assert "--optimizer-state-dtype" in capsys.readouterr().err
    toml = tmp_path / "run.toml"
    toml.write_text('[optim]\nstate_dtype = "bf16"\n')
    assert TrainConfig.from_toml(toml).optim.state_dtype == "bf16"
    assert parse_args(["--config", str(toml), *FAST]).optim.state_dtype == "bf16"
    toml.write_text('[optim]\nstate_dtype = "int8"\n')
    with pytest.raises(ConfigError, match=r"optim\.state_dtype") as err:
        TrainConfig.from_toml(toml)
    assert err.value.key == "optim.state_dtype"


def test_trainer_trains_with_bf16_states_and_resumes_a_sharded_checkpoint(tmp_path):
    """Through `python -m lm_core.train`: bf16 moments in the optimizer and in the sharded
    (DCP) checkpoint; 3 + 2 resumed steps equal 5 uninterrupted ones bitwise; the same
    checkpoint resumes with fp32 states (converted on load)."""
    from lm_core.train import main

    bf16 = [*FAST, "--optimizer-state-dtype", "bf16", "--checkpoint-format", "dcp"]
    whole = main([*bf16, "--steps", "5", "--cosine-steps", "5"])
    assert {s[n].dtype for s in whole.optimizer.state.values() for n in lowp.MOMENTS} == {BF16}
    main([*bf16, "--steps", "3", "--cosine-steps", "5", "--out-dir", str(tmp_path / "a")])
    ckpt = str(tmp_path / "a" / "checkpoint.dcp")
    resumed = main([*bf16, "--steps", "5", "--cosine-steps", "5", "--resume", ckpt])
    for (k, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    as_fp32 = main([*FAST, "--steps", "4", "--cosine-steps", "5", "--resume", ckpt])
    assert {s["exp_avg_sq"].dtype for s in as_fp32.optimizer.state.values()} == {torch.float32}


@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=needs_interpreter)], ids=["torch-ops", "kernel"]
)
def test_dtensor_parameters_on_two_ranks(fused):
    """DTensor parameters (sharded and replicated, as --fsdp torch and --tp make them): each
    rank updates its shards in place, and the full weights and bf16 moments equal those of
    the same update on plain tensors bit for bit (rounded to nearest: the bits of stochastic
    rounding follow the shard's element indices)."""
    spawn = pytest.importorskip("ddp_kit.launch").spawn
    import lm_dist_workers

    env = {"TRITON_INTERPRET": "1"} if fused else None
    for result in spawn(lm_dist_workers.dtensor_bf16_adamw, 2, args=(fused,), env=env):
        dist, plain = result
        for key, value in plain.items():
            assert value.dtype == (torch.float32 if key[0] == "p" else BF16), key
            assert torch.equal(dist[key], value), key
