"""Where the optimizer time of a graphed train step goes: lm_core's AdamW after the backward,
per unit inside it on the backward's stream, or overlapped on a side stream.

One model, blocks compiled one by one (`lm_core.compile_blocks`), bf16 autocast; each variant
captures the whole step in a CUDA graph (`lm_core.graph_step.capture_cuda_graph`) and prints the
median of `--replays` timed replays (after 3 untimed). Needs a CUDA GPU:

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') \\
        python3 packages/perf-tools/scripts/optimizer_overlap.py --size xl
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

VARIANTS = ("fwd-bwd", "plain", "overlap-inline", "overlap", "overlap-high-priority")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="xl")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the variants differ in CUDA streams and graphs)")
    from lm_core import AdamW, OverlappedOptimizer, compile_blocks, cross_entropy
    from lm_core.graph_step import capture_cuda_graph
    from perf_tools._compile import allow_recompiles
    from perf_tools.models import build_model, random_batch, resolve_config
    from perf_tools.steps import make_step

    allow_recompiles()
    config = resolve_config(args.size, context_length=args.context)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(config, device)
    compile_blocks(model, dynamic=False)
    x, y = random_batch(args.batch, args.context, config.vocab_size, device)
    kwargs = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.size} bf16, "
          f"batch {args.batch}, context {args.context}, blocks compiled, CUDA graph")  # fmt: skip
    for name in args.variants:
        opt = None
        if name == "plain":
            opt = AdamW(model.parameters(), **kwargs)
        elif name != "fwd-bwd":
            # overlap-inline: each unit steps on the backward's own stream, in order
            opt = OverlappedOptimizer(
                model,
                side_stream=name != "overlap-inline",
                stream_priority=-1 if name == "overlap-high-priority" else 0,
                **kwargs,
            )
        mode = "fwd-bwd" if name == "fwd-bwd" else "train"
        step = make_step(model, mode, inputs=x, targets=y, loss_fn=cross_entropy,
                         precision="bf16", optimizer=opt, graph_safe=True)  # fmt: skip
        replay = capture_cuda_graph(step)
        for _ in range(3):
            replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ms = []
        for _ in range(args.replays):
            start.record()
            replay()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        print(f"{name:22s} median {sorted(ms)[len(ms) // 2]:7.2f} ms")
        if isinstance(opt, OverlappedOptimizer):
            opt.remove()
        del replay, step, opt
        for param in model.parameters():
            param.grad = None
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
