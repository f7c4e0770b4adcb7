"""A/B of a default against its alternative through the real launch path, kernel time only.

Each shape runs both sides interleaved for several rounds (CUDA-graph replay, so host time
is not in it; medians). What is compared:

- ``fwd-tile``: the d = 128 forward table entry against an older tile (default 64,64,4,3,
  the entry before the 128-row TMA tile), swapped in ``configs.DEFAULTS`` in place;
- ``gluon-dkdv`` / ``gluon-dq``: the whole backward with that Gluon kernel against the
  Triton kernel (the kernel's ``DEFAULTS`` emptied);
- ``tile``: any kind's config ``--new`` against ``--old`` (``configs.OVERRIDES``), at head dim
  ``--d``; the forward for ``--kind fwd``, else the whole backward;
- ``head-group``: the launch order by head groups, ``Options.head_group`` ``--new``
  against ``--old`` (e.g. ``auto`` against ``off``), forward (``--kind fwd``) or backward;
- ``source``: this source against another copy of the package's source, ``--old`` a folder
  holding a ``flashattn_triton`` package (e.g. an older commit's, from ``git archive``),
  imported under another name into the same process; forward (``--kind fwd``) or backward.

Shapes are ``B,H,N[,nc][,view]``: ``nc`` non-causal, ``view`` q, k, v seen from a
(B, N, 3, H, d) qkv buffer and dO from (B, N, H, d), as a model passes them.

    python benchmarks/ab_defaults.py gluon-dq 2,8,1000 1,32,32768 2,32,32768,view --out $OUT
    python benchmarks/ab_defaults.py fwd-tile 8,16,512 16,1,16384 --old 64,64,4,3
    python benchmarks/ab_defaults.py tile 16,1,16384 --d 64 --kind dkdv \
        --new 32,64,4,3,tma,reg,r128 --old 32,64,4,3,tma
    git archive <commit> packages/flashattn-triton/src | tar -x -C /tmp/old --strip-components=3
    python benchmarks/ab_defaults.py source 16,1,16384 8,16,1024 --d 64 --old /tmp/old
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

from flashattn_triton.options import get_options, set_options

D = 128  # the head dim the fwd-tile and gluon comparisons are about (--d for ``tile``)
OLD_PACKAGE = "flashattn_triton_old"  # the module name the ``source`` mode imports --old as


def parse_shape(spec: str) -> tuple[int, int, int, bool, bool]:
    """``B,H,N[,nc][,view]`` -> (B, H, N, causal, view)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    flags = set(parts[3:])
    if len(parts) < 3 or not all(p.isdigit() for p in parts[:3]) or not flags <= {"nc", "view"}:
        raise ValueError(f"shape {spec!r}: want B,H,N[,nc][,view]")
    b, h, n = (int(p) for p in parts[:3])
    return b, h, n, "nc" not in flags, "view" in flags


def inputs(b: int, h: int, n: int, view: bool, d: int = D):
    """bf16 q, k, v, dO of (B, H, N, d), contiguous or as views of model-layout buffers."""
    if view:
        x = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
        do = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return q, k, v, do
    return tuple(torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))


def check_source(folder: str) -> Path:
    """The package folder inside ``folder`` (source mode's --old), or ValueError."""
    package = Path(folder) / "flashattn_triton"
    if not (package / "__init__.py").is_file():
        raise ValueError(f"--old {folder!r}: no flashattn_triton/__init__.py in that folder")
    return package


@functools.cache
def load_source(folder: str):
    """The ``launch`` module of the flashattn_triton package in ``folder``, imported as
    OLD_PACKAGE (its relative imports stay inside that copy), next to the installed one."""
    package = check_source(folder)
    spec = importlib.util.spec_from_file_location(
        OLD_PACKAGE, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[OLD_PACKAGE] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{OLD_PACKAGE}.launch")


def sides(what: str, old: str, new: str = "", kind: str = "dkdv", target: dict | None = None):
    """(name, switch) pairs: calling switch() selects that side for the next launches
    (``source``: by setting target["launch"], the launch module that run() calls)."""
    from flashattn_triton import configs, gluon_dkdv, gluon_dq, launch

    if what == "source":
        target = {} if target is None else target
        old_launch = load_source(old)

        def use(module):
            return lambda: target.__setitem__("launch", module)

        return [("this source", use(launch)), (f"source {old}", use(old_launch))]
    if what == "head-group":

        def setting(value):
            return lambda: set_options(head_group=value)

        return [(f"head group {new}", setting(new)), (f"head group {old}", setting(old))]
    if what == "tile":

        def override(spec):
            cfg = configs.TileConfig.parse(spec)
            return lambda: configs.OVERRIDES.__setitem__(kind, cfg)

        return [(f"{kind} {new}", override(new)), (f"{kind} {old}", override(old))]
    if what == "fwd-tile":
        new_cfg, old_cfg = configs.DEFAULTS["fwd"][D], configs.TileConfig.parse(old)

        def table(cfg):
            return lambda: configs.DEFAULTS["fwd"].__setitem__(D, cfg)

        return [
            (f"fwd {new_cfg.spec()}", table(new_cfg)),
            (f"fwd {old_cfg.spec()}", table(old_cfg)),
        ]
    module = gluon_dkdv if what == "gluon-dkdv" else gluon_dq
    saved = dict(module.DEFAULTS)

    def gluon(on: bool):
        def switch():
            module.DEFAULTS.clear()
            module.DEFAULTS.update(saved if on else {})

        return switch

    return [(f"{what} on", gluon(True)), (f"{what} off (Triton)", gluon(False))]


def _restore(what: str, kind: str, saved: tuple, pairs: list) -> None:
    """Leave things as before a comparison: the defaults in place for fwd-tile / gluon-*
    (``pairs``' first side), the caller's override (tile) or head-group setting back."""
    from flashattn_triton import configs

    override, head_group = saved
    if what == "source":
        return
    if what == "tile":
        configs.OVERRIDES.pop(kind, None)
        if override is not None:
            configs.OVERRIDES[kind] = override
    elif what == "head-group":
        set_options(head_group=head_group)
    else:
        pairs[0][1]()


def _check_head_group(value: str) -> None:
    """Raise ValueError unless value is a valid ``Options.head_group`` setting."""
    from flashattn_triton.options import Options

    Options(head_group=value)


def _call(target: dict, name: str, *args):
    """target["launch"].<name>(*args): the launch module of the side selected last."""
    return getattr(target["launch"], name)(*args)


def run(
    what: str, shapes: list[str], old: str, rounds: int, rep: int, *,
    new: str = "", kind: str = "dkdv", d: int = D,
) -> list[dict]:  # fmt: skip
    import triton

    from flashattn_triton import configs, launch

    target = {"launch": launch}
    pairs = sides(what, old, new, kind, target)
    saved = (configs.OVERRIDES.get(kind), get_options().head_group)
    forward_only = what == "fwd-tile" or (
        what in ("tile", "head-group", "source") and kind == "fwd"
    )
    rows = []
    for spec in shapes:
        b, h, n, causal, view = parse_shape(spec)
        torch.manual_seed(0)
        q, k, v, do = inputs(b, h, n, view, d)
        scale = d**-0.5
        o, lse = launch.forward(q, k, v, causal, scale)
        if forward_only:
            fn = functools.partial(_call, target, "forward", q, k, v, causal, scale)
        else:
            fn = functools.partial(_call, target, "backward", do, q, k, v, o, lse, causal, scale)
        times: dict[str, list[float]] = {name: [] for name, _ in pairs}
        for _ in range(rounds):
            for name, switch in pairs:
                switch()
                launch.clear_plans()  # the tables changed in place
                fn()
                torch.cuda.synchronize()
                times[name].append(
                    triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
                )
        _restore(what, kind, saved, pairs)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        (a, ta), (c, tc) = med.items()
        rows.append({"shape": spec, "causal": causal, "view": view, a: ta, c: tc,
                     "speedup": tc / ta, "rounds": times})  # fmt: skip
        print(f"| {spec} | {causal} | {ta:.4f} | {tc:.4f} | {tc / ta:.2f}x |", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "what", choices=("fwd-tile", "gluon-dkdv", "gluon-dq", "tile", "head-group", "source")
    )
    ap.add_argument("shapes", nargs="+", help="B,H,N[,nc][,view] (bf16)")
    ap.add_argument(
        "--old", default="64,64,4,3",
        help="fwd-tile, tile, head-group: to beat; source: the folder of the other source",
    )  # fmt: skip
    ap.add_argument("--new", default="", help="tile, head-group: the candidate")
    ap.add_argument(
        "--kind", default="dkdv", choices=("fwd", "dkdv", "dq"),
        help="tile: the kind overridden; tile, head-group, source: fwd times the forward, "
        "else the backward",
    )  # fmt: skip
    ap.add_argument(
        "--d", type=int, default=D, help="tile, head-group, source: head dim (others: 128)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph budget, ms")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    a = ap.parse_args(argv)
    try:
        for spec in a.shapes:
            parse_shape(spec)
        from flashattn_triton.configs import TileConfig

        if a.what in ("fwd-tile", "tile"):
            TileConfig.parse(a.old)
        if a.what == "tile":
            TileConfig.parse(a.new)
        elif a.what == "head-group":
            for value in (a.new, a.old):
                _check_head_group(value)
        elif a.what == "source":
            check_source(a.old)
        elif a.d != D:
            raise ValueError(f"--d: {a.what} compares d = {D} defaults")
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Gluon kernels: a Hopper one)")
    names = [name for name, _ in sides(a.what, a.old, a.new, a.kind)]
    print(f"| shape | causal | {names[0]} ms | {names[1]} ms | speedup |")
    print("| --- | --- | --- | --- | --- |")
    rows = run(a.what, a.shapes, a.old, a.rounds, a.rep, new=a.new, kind=a.kind, d=a.d)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        per_kind = ("tile", "head-group", "source")
        tag = f"{a.what}_{a.kind}_d{a.d}" if a.what in per_kind else a.what
        (a.out / f"ab_{tag}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
