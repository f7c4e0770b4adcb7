"""Decode key-split rules against SDPA (bf16, d = 128, one query), interleaved rounds.

    python decode_split_rules.py OUT.json            # the shipped rule against the former one
    python decode_split_rules.py OUT.json --explore  # candidate rules x decode tiles

The shipped rule (``configs.decode_splits``) takes the smallest split count whose waves of
programs are 95% full, programs per SM from the tile's shared memory; the former one made
enough splits for 4 programs per SM. ``--explore`` adds flash-attn's rule (85% full) and
"at most one wave", each with 2- and 3-stage tiles and 128-key tiles.
"""

import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

import flashattn_triton as fa
from flashattn_triton import configs as C
from flashattn_triton.launch_plans import clear_plans
from flashattn_triton.options import use_options

SHIPPED = C.decode_splits


def former(bh, tiles, slots):  # slots = 2 x SMs for the default tile: 4 per SM = 2 x slots
    return max(1, min(-(-(2 * slots) // bh), tiles, C.DECODE_MAX_SPLITS))


def fullness_rule(threshold, slots_scale):
    """Smallest split count whose waves are ``threshold`` full, on ``slots_scale`` x the
    slots the package computes (to model a tile's other occupancy)."""

    def rule(bh, tiles, slots):
        slots = int(slots * slots_scale)
        if bh >= 0.8 * slots:
            return 1
        top = max(1, min(tiles, C.DECODE_MAX_SPLITS))
        full = [bh * s / slots / math.ceil(bh * s / slots) for s in range(1, top + 1)]
        return next(s for s, f in enumerate(full, 1) if f >= threshold * max(full))

    return rule


def one_wave(slots_scale):
    return lambda bh, tiles, slots: max(
        1, min(tiles, C.DECODE_MAX_SPLITS, int(slots * slots_scale) // bh)
    )


VARIANTS = {"shipped": ("", SHIPPED), "former": ("", former)}
EXPLORE = {
    "s3_fa2": ("decode=16,64,4,3", fullness_rule(0.85, 1.0)),
    "s2_fa2": ("decode=16,64,4,2", fullness_rule(0.85, 1.5)),
    "s3_wave": ("decode=16,64,4,3", one_wave(1.0)),
    "s2_wave": ("decode=16,64,4,2", one_wave(1.5)),
    "n128w8s3": ("decode=16,128,8,3", former),
    "n128w8s3_fa2": ("decode=16,128,8,3", fullness_rule(0.85, 0.5)),
}
SHAPES = [
    (1, 32, 8, 65536), (2, 32, 8, 16384), (1, 32, 8, 16384), (4, 32, 8, 32768),
    (1, 32, 32, 8192), (1, 32, 32, 131072), (8, 32, 32, 8192), (8, 32, 8, 65536),
    (8, 32, 32, 65536),
]  # fmt: skip


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def main(out: str, explore: bool) -> None:
    variants = {**VARIANTS, **(EXPLORE if explore else {})}
    rows = []
    for b, h, hkv, nk in SHAPES:
        q = torch.randn(b, h, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=hkv != h)
        times, errs = {}, {}
        for _round in range(3):
            for name, (tiles, rule) in variants.items():
                C.decode_splits = rule
                clear_plans()
                with use_options(tile_configs=tiles):
                    o = fa.flash_attention(q, k, v, True)
                    errs[name] = (o.float() - ref).abs().max().item()
                    times.setdefault(name, []).append(
                        bench(lambda: fa.flash_attention(q, k, v, True))
                    )
                C.decode_splits = SHIPPED
                clear_plans()
            times.setdefault("sdpa", []).append(
                bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != h))
            )
        row = {"shape": f"B{b} H{h}/{hkv} Nk{nk}"}
        row.update({name: round(statistics.median(t), 4) for name, t in times.items()})
        row["max_err"] = max(errs.values())
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], "--explore" in sys.argv[2:])
