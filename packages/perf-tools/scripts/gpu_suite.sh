#!/usr/bin/env bash
# The measurements of perf-tools on a GPU machine (H100 / H200; the multi-GPU sections need 2+
# GPUs of one host), in sections.
#
#   OUT=/some/dir bash packages/perf-tools/scripts/gpu_suite.sh                  # call 1
#   SECTIONS="attention compile" OUT=/some/dir bash packages/perf-tools/scripts/gpu_suite.sh
#
# Run from the repository root. Uses the machine's own python3 (torch/triton preinstalled, no
# network): every package's src/ goes on PYTHONPATH, nothing is installed.
# Writes a work tree under $WORK (default /tmp/perf-suite-<sections>) and, at the end, packs it
# into three files in $OUT: suite-<sections>.log, perf-results-<sections>.tar.gz (tables,
# CSV/JSON, plots, logs) and perf-traces-<sections>.tar.gz (profiler traces, snapshots).
# Each command is cut at $RUN_TIMEOUT seconds (default 420) so one stuck run cannot eat the rest.
#
# Sections and rough H100 wall times (estimates unless marked measured; first runs include
# Triton autotuning and torch.compile):
#   bench      all sizes x {fp32, bf16} x {forward, train}, ctx 512, batch 4, eager,
#              3 warm-up + 5 measured steps                                      ~1-1.5 min
#   hf         --compare hf: small fp32 train, xl bf16 train (ours beside HF), then small
#              bf16 at 1024 tokens with HF also run through flashattn_triton's SDPA drop-in,
#              eager and compiled                                                ~2 min
#   profile    small and xl, fp32, naive attention: forward / fwd-bwd / train,
#              2 warm-up + 2 profiled steps                                      ~1.5-2 min
#   mixed      mixed_precision accumulate + toy-dtypes                            ~10 s
#   attention  attention --quick (naive eager vs compiled; flash vs SDPA), then
#              the leaderboard shape                                             ~2-3 min
#   attention_full  the handout's full grids: naive (batch 8, d 16..128, seq 256..16384,
#              eager and compiled) and flash (batch 1, causal, seq 128..65536, d 16..128,
#              bf16 and fp32, ours vs naive vs SDPA flash / cuDNN)                ~5-7 min
#   compile    small fp32 forward+train eager vs compiled; xl bf16 train compiled ~2-4 min
#   speed      xl bf16 and small fp32 (strict with cuBLAS, then TF32, then strict with
#              cuBLASLt) train steps: eager vs compiled x launched kernel by kernel vs one
#              CUDA graph per step                                               ~4-5 min
#   d128       flashattn-triton at head dim 128: the Gluon forward's correctness checks and
#              variant A/B with the package's forward with and without it over the sweep's
#              batch-1 shapes (benchmarks/gluon_fwd_ab.py --sweep), the eager d = 128 sweep,
#              the leaderboard shape at d = 128, the GQA / window feature rows, and the
#              one-pass backward's float64 check and its timing against the split backward
#              and SDPA, its launch order's A/B (onepass_head_group_ab.py), and at d = 64
#              the package against the same with the one-pass kernel held to d = 128
#              (onepass_d64_ab.py final), then the eager and compiled d = 64 sweep
#              (estimate ~14 min: its parts ran in 1-4 min each on one H200)
#   features   flashattn-triton's features against SDPA (perf_tools.attention_features: GQA,
#              varlen, window, decode, KV cache with a length per sequence), the decode
#              key-split rule against the former one (decode_split_rules.py), d = 64's
#              forward and backward apart with the Gluon forward at d = 64, two or three
#              math warpgroups (d64_fwd_bwd_parts.py), and lm_core's decode with SDPA and
#              with flash_attention_kvcache (generate_bench --attention sdpa flash-triton)
#                                                  (one H200: under 6 min in all before
#                                                  the three-warpgroup variants)
#   xlstep     the xl bf16 train step in its fast configuration (blocks compiled, one CUDA
#              graph replayed with node priorities, AdamW during the backward, bf16-held
#              weights, fused loss): SDPA against our attention, then lm_core's SwiGLU, q/k/v
#              RoPE and RMSNorm kernels, the deferred residual add and the node priorities
#              off / on (scripts/kernel_ab.py, two rounds each), then a profile of the step,
#              then the same step in lm_core.train (80 steps, no checkpoint)
#              (measured: its parts ran in 40 s to 2.5 min each on one H200)
#   hostcost   flashattn-triton's benchmarks/host_cost.py (128 x 512, d = 64: us per eager and
#              compiled forward + backward on either autograd thread, launch ops against the
#              public custom ops, the phases of one call, the device thread with gc off and
#              a short interpreter switch interval), then the compiled causal sweep
#              (one H200: the sweep and two host_cost runs without --compiled took 66 s)
#   traced     flashattn-triton's compiled, traced and graphed GPU tests three times over with
#              FLASHATTN_TRITON_TRACED_COMPILE=auto, then lm-core's and perf-tools' compiled,
#              graphed and flash GPU tests with it                 (~100 s a round, 160 s)
#   tracedsteps  traced_compile=auto timed: scripts/model_step_ab.py small (compiled) and xl
#              (blocks compiled), interleaved; the graphed xl bench step; the compiled sweep's
#              short rows with the option off and auto          (parts measured 25-100 s, H100)
#   cppcompiled  flashattn-triton's cpp_launch_compiled (compiled graphs' opaque ops replayed
#              from C++) against traced_compile=auto: its GPU tests, the compiled sweep's
#              rows up to 8192 tokens with each setting, then scripts/model_step_ab.py small
#              (compiled) and xl (blocks compiled), interleaved, xl with each setting's
#              operators profiled                                     (parts: 1-4 min, H100)
#   stepsab    the model steps with SDPA and with our attention (its default options),
#              interleaved in one process (scripts/model_step_ab.py): small at 1024 tokens
#              eager and whole model compiled, xl at 512 eager and each block compiled;
#              and flashattn-triton's compiled GPU tests              (estimate: ~8-10 min, H100)
#   benchrounds  `perf_tools.bench --rounds 3`, SDPA and ours: small at 1024 tokens eager and
#              whole model compiled, xl at 512 eager        (measured: 212 s + 34 s, one H100)
#   benchrounds_xl  the same for xl whole model compiled, two rounds
#              (each round compiles both models again)          (measured: 365 s, one H100)
#   smallmodel the small model at 1024 tokens, bf16 train, SDPA against flash-triton: bench eager
#              and whole-model compiled, each model in its own process, three rounds (--isolate
#              3: the step is host-bound and follows its process), the launchers' host time per
#              call (launch_cost.py), then a profile
#              of each compiled step; with OLD_FA=<folder holding an older
#              flashattn_triton package> the compiled flash-triton row again on that source
#              (e.g. `git archive <commit> packages/flashattn-triton/src | tar -x -C old
#              --strip-components=3`, carried to the machine)                      ~6-8 min
#   fp32gemm   scripts/fp32_gemm.py: every float32 product of a small-model train step,
#              cuBLAS / cuBLASLt / TF32 / Triton ieee, tf32x3, tf32x3 + Kahan    ~2-3 min;
#              then scripts/tf32x3_variants.py: the 3xTF32 GEMM's K loop in five variants,
#              and scripts/tf32x3_gluon_ab.py: Triton alone, Gluon on split operands, all
#              the Gluon GEMM's plans                 (this script alone ~2.7 min, one H200)
#   profile_bf16  perf_tools.profile of the xl bf16 train step with SDPA, 2 warm-up + 2
#              profiled steps, top 12 operators                                  ~1 min
#   trainloop  lm_core.train --compile --cuda-graph (small bf16 batch 8, xl bf16 batch 4;
#              100 steps, log every 10, a checkpoint at 50 and at the end, in $CKPT_ROOT)
#              beside the bench step, and xl without the graph (perf_tools.train_loop).
#              Measured on one H200: small 54 s; each 22 GB save of xl took ~53 s to the
#              disk and ~45 s to /dev/shm, so an xl run needs TRAINLOOP_TIMEOUT of 300 or more
#   memory     2.7B peak memory, ctx 128/256/512, fp32/bf16, forward/train, and a
#              memory snapshot of one bf16 train step (not in the two calls)     ~1 min
#   generate   decode tokens/s (generate_bench): small, then xl, batch 1 and 16, bf16, prompt
#              128 + 256 new tokens; eager / compiled / CUDA graph / both / HF generate with
#              its dynamic and static caches (compilation dominates)            ~5-8 min
# Multi-GPU sections (2 GPUs; NCCL_NVLS_ENABLE=0 is exported):
#   nccl_tests every package's `nccl` tests (what `nox -s nccl_tests` runs)        ~2-4 min
#   allreduce  NCCL all-reduce, 1 MiB .. 1 GiB float32, 2 processes (and 4/6 where there are
#              that many GPUs)                                                      ~1 min
#   ddp        xl, 2 sequences of 512 per rank, fp32: every ddp-kit wrapper, the bucket-size
#              sweep and torch DDP side by side                                     ~2 min
#   zero       xl AdamW memory and step time: DDP, our ShardedOptimizer, torch ZeRO  ~2 min
#   parallel   xl --num-heads 20 (heads split by TP), ctx 512, bf16 train, 4 sequences per step
#              in total: DP (--ddp, batch 2 per rank), FSDP torch (batch 2 per rank), TP 2
#              (batch 4), each eager and compiled (DDP: the whole model and each block;
#              FSDP / TP each block), 3 warm-up + 8 measured steps, the planner's
#              prediction beside each row; one command per layout
#                                                measured: 3.7 min (2x H200, before DDP blocks)
#   sharded_ckpt  scripts/checkpoint_timing.py under torchrun on 2 GPUs: xl bf16, --fsdp ours
#              then torch, 2 steps of 4 x 512 tokens, then DCP save / load and the single-file
#              save timed (one JSON line each in its log). Measured on 2x H200: 7 min,
#              with the trainer's own end-of-run save since dropped, on a ~0.6 GiB/s disk
#              (CKPT_ROOT=/dev/shm/x: checkpoints in RAM instead of $WORK on disk)
#   sharded_ckpt8b  the same at 8B (--fsdp ours, 1 step of 2 x 512 tokens per rank; ~91 GiB of
#              state: the sharded copy is deleted before the single file is written; needs
#              2 GPUs of 141 GB, ~250 GB of host memory for rank 0's gather and ~100 GB of
#              disk)                  more than 5.5 min on 2x H200 (/dev/shm): give it a call
#   init8b     scripts/init_memory.py: the 8B build sharded by our FSDP on 2 GPUs, on the meta
#              device against whole on each GPU first (peak RSS, device memory)
#                                                                      measured: 46 s (2x H200)
#   fsdp_options  scripts/fsdp_options.py: xl, 2 sequences x 4 micro-steps per rank, sync /
#              no_sync / reshard_after_forward=False, ours and torch's FSDP
#                                                                measured: 76-103 s (2x H200)
#   parallel8b the 8B model at 2 x 8192 tokens per step, bf16 train, every block checkpointed,
#              fused loss, SDPA: TP 2 (batch 2) against FSDP torch (batch 1 per rank), eager,
#              the planner's prediction beside each row. NEEDS 2 GPUs OF 141 GB
#                                                                      measured: 55 s (2x H200)
#   step8b     the 8B FSDP (ours) train step of BENCHMARKS.md 7.1, ctx 32768, batch
#              1 per rank, fused loss, every block checkpointed, sdpa then flash-triton, 1
#              warm-up + 3 steps. NEEDS 2 GPUs OF 141 GB (H200): ~69 GB per rank plus the
#              32.5 GB transient of the build; OOM on 80 GB H100s
#                                                                      measured: 89 s (2x H200)
# Default SECTIONS="bench hf profile mixed" (call 1, ~4-5 min); call 2 is "attention compile"
# (~4-7 min). Each call stays under ten minutes; run parallel, sharded_ckpt and step8b each in
# a call of its own.
set -uo pipefail

OUT=${OUT:?set OUT to the directory that should receive the results}
SECTIONS=${SECTIONS:-"bench hf profile mixed"}
# Every section this script runs (its `want NAME` lines): a misspelt name fails here rather
# than running nothing and reporting success.
KNOWN=" $(grep -o 'want [a-z0-9_][a-z0-9_]*' "$0" | cut -d' ' -f2 | sort -u | tr '\n' ' ')"
for section in $SECTIONS; do
  if [[ "$KNOWN" != *" $section "* ]]; then
    echo "SECTIONS: unknown section '$section'; known:$KNOWN" >&2
    exit 2
  fi
done
TAG=$(echo "$SECTIONS" | tr ' ' '_')
RUN_TIMEOUT=${RUN_TIMEOUT:-420}
WORK=${WORK:-/tmp/perf-suite-$TAG}
# where the checkpoint sections write (default: the work tree; a RAM-backed /dev/shm times the
# software path apart from the disk)
CKPT_ROOT=${CKPT_ROOT:-$WORK}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
export PYTHONPATH="$ROOT/packages/lm-core/src:$ROOT/packages/flashattn-triton/src:$ROOT/packages/ddp-kit/src:$ROOT/packages/zero-shard/src:$ROOT/packages/perf-tools/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$WORK" "$OUT"
LOG="$WORK/suite.log"
: >"$LOG"
status=0

run() {  # run NAME CMD...: log the command and its output, keep going on failure
  local name=$1
  shift
  echo "=== [$name] $(date -u +%H:%M:%S) $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$RUN_TIMEOUT" "$@" 2>&1 | tee "$WORK/$name.log" |
    grep -v -E '^\s*$|it/s\]|s/it\]' >>"$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

want() { [[ " $SECTIONS " == *" $1 "* ]]; }

$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
B="$PY -m perf_tools.bench --quiet"

if want bench; then
  run bench $B --size small medium large xl 2.7B --precision fp32 bf16 --mode forward train \
    --context 512 --batch 4 --warmup 3 --steps 5 \
    --csv "$WORK/bench.csv" --json "$WORK/bench.json" --plot "$WORK/bench.png"
fi
if want compile; then
  run compile_small $B --size small --precision fp32 --mode forward train --compile both \
    --context 512 --warmup 3 --steps 5 --csv "$WORK/compile_small.csv" --json "$WORK/compile_small.json"
  run compile_xl $B --size xl --precision bf16 --mode train --compile on \
    --context 512 --warmup 3 --steps 5 --csv "$WORK/compile_xl.csv" --json "$WORK/compile_xl.json"
fi
if want speed; then
  S="--mode train --compile both --cuda-graph both --context 512 --warmup 3 --steps 10"
  run speed_xl $B --size xl --precision bf16 $S --csv "$WORK/speed_xl.csv" --json "$WORK/speed_xl.json"
  run speed_small $B --size small --precision fp32 $S \
    --csv "$WORK/speed_small.csv" --json "$WORK/speed_small.json"
  run speed_small_tf32 $B --size small --precision fp32 --tf32 $S \
    --csv "$WORK/speed_small_tf32.csv" --json "$WORK/speed_small_tf32.json"
  run speed_small_cublaslt $B --size small --precision fp32 --blas cublaslt $S \
    --csv "$WORK/speed_small_cublaslt.csv" --json "$WORK/speed_small_cublaslt.json"
fi
if want hf; then
  run hf_small $B --size small --precision fp32 --mode train --compare hf \
    --context 512 --warmup 3 --steps 5 --csv "$WORK/hf_small.csv" --json "$WORK/hf_small.json"
  run hf_xl $B --size xl --precision bf16 --mode train --compare hf \
    --context 512 --warmup 3 --steps 5 --csv "$WORK/hf_xl.csv" --json "$WORK/hf_xl.json"
  # HF's own model with flashattn_triton's SDPA drop-in, eager and compiled
  run hf_small_dropin $B --size small --precision bf16 --mode train --compare hf \
    --attention sdpa flash-triton --compile both --context 1024 --warmup 3 --steps 10 \
    --csv "$WORK/hf_small_dropin.csv" --json "$WORK/hf_small_dropin.json"
fi
if want profile; then
  run profile $PY -m perf_tools.profile --quiet --size small xl --precision fp32 \
    --mode forward fwd-bwd train --context 512 --warmup 2 --steps 2 --top 12 --out "$WORK/profile"
fi
if want attention; then
  run attention_quick $PY -m perf_tools.attention --quick --quiet \
    --csv "$WORK/attention.csv" --json "$WORK/attention.json" --plot "$WORK/attention.png"
  run attention_leaderboard $PY -m perf_tools.attention leaderboard --quiet \
    --csv "$WORK/leaderboard.csv" --json "$WORK/leaderboard.json"
fi
if want attention_full; then
  run attention_naive $PY -m perf_tools.attention naive --quiet \
    --csv "$WORK/attention_naive.csv" --json "$WORK/attention_naive.json" --plot "$WORK/attention_naive.png"
  run attention_flash $PY -m perf_tools.attention flash --quiet \
    --csv "$WORK/attention_flash.csv" --json "$WORK/attention_flash.json" --plot "$WORK/attention_flash.png"
fi
if want d128; then  # head dim 128: the Gluon forward, the sweep rows, the leaderboard shape
  FA="$ROOT/packages/flashattn-triton/benchmarks"
  run d128_gluon_fwd $PY "$FA/gluon_fwd_ab.py" "$WORK/gluon_fwd_ab.json" --sweep
  run d128_sweep $PY -m perf_tools.attention_sweep --d 128 --modes eager --quiet \
    --rounds 3 --graphed --host --kernels \
    --csv "$WORK/sweep_d128.csv" --json "$WORK/sweep_d128.json" --plot "$WORK/sweep_d128.png"
  run d128_leaderboard $PY "$FA/leaderboard_bench.py" --d 128 \
    --providers ours,sdpa_flash,sdpa_cudnn --schemes split --rep 500
  run d128_features $PY -m perf_tools.attention_features gqa window --quiet \
    --csv "$WORK/features_d128.csv" --json "$WORK/features_d128.json"
  # the one-pass backward (the default from 2048 keys): checked, then timed against split
  run d128_onepass_check $PY "$FA/onepass_bwd.py" check ws --out "$WORK/onepass"
  run d128_onepass_time $PY "$FA/results/current/scripts/onepass_pkg_time.py" "$WORK"
  # around its threshold (gluon_bwd.MIN_KEYS): batch 1 from 1024 keys, and grouped-query heads
  run d128_onepass_min_keys $PY "$FA/results/current/scripts/onepass_pkg_time.py" \
    "$WORK/onepass_min_keys" 1,64,64,1024,1 1,32,32,2048,1 1,16,16,4096,1 1,8,8,8192,1 \
    1,32,32,2048,0 1,16,16,4096,0 1,8,8,8192,0 4,32,8,4096,1 --min-keys 512
  # its launch order: two heads at a time (gluon_bwd.head_group) against the L2 rule alone,
  # GPU time; then d = 64, where it takes long rows (gluon_bwd.enough_keys), against the
  # split backward, and the d = 64 sweep
  run d128_onepass_order $PY "$FA/results/current/scripts/onepass_head_group_ab.py" \
    "$WORK/onepass_head_group_ab.json"
  run d64_onepass_ab $PY "$FA/results/current/scripts/onepass_d64_ab.py" final \
    "$WORK/onepass_d64_ab.json"
  run d64_sweep $PY -m perf_tools.attention_sweep --d 64 --modes eager compiled \
    --rounds 3 --kernels --csv "$WORK/sweep_d64.csv" --json "$WORK/sweep_d64.json" --plot "$WORK/sweep_d64.png"
fi
if want features; then  # flashattn-triton's features and decode, d = 64's parts
  FA="$ROOT/packages/flashattn-triton/benchmarks"
  run features $PY -m perf_tools.attention_features --quiet \
    --csv "$WORK/features.csv" --json "$WORK/features.json"
  run decode_split_rules $PY "$FA/results/current/scripts/decode_split_rules.py" \
    "$WORK/decode_split_rules.json"
  run d64_parts $PY "$FA/results/current/scripts/d64_fwd_bwd_parts.py" "$WORK/d64_parts.json"
  run generate_attention $PY -m perf_tools.generate_bench --sizes small xl --batch-sizes 1 16 \
    --providers compile+cudagraph cudagraph eager --attention sdpa flash-triton --quiet \
    --csv "$WORK/generate_attention.csv"
fi
if want xlstep; then  # the xl step of BENCHMARKS 1.2d / 3.3 and lm_core's kernel A/Bs
  XL="--size xl --precision bf16 --mode train --context 512 --batch 4 --compile blocks
    --cuda-graph on --optimizer-overlap on --matmul-weights bf16 --fused-loss --warmup 3
    --steps 10"
  # shellcheck disable=SC2086
  run xl_attention $PY -m perf_tools.bench $XL --attention sdpa flash-triton --quiet \
    --csv "$WORK/xl_attention.csv"
  for kernels in swiglu qkv_rope rmsnorm defer_add node_priorities; do
    # shellcheck disable=SC2086
    run "xl_${kernels}_ab" $PY "$ROOT/packages/perf-tools/scripts/kernel_ab.py" \
      "$WORK/xl_${kernels}_ab" 2 "$kernels" -- $XL
  done
  # shellcheck disable=SC2086
  run xl_profile $PY -m perf_tools.bench ${XL/--cuda-graph on/} --steps 2 \
    --attention flash-triton --quiet --profile "$WORK/xl_profile"
  run xl_train $PY -m lm_core.train --size xl --context-length 512 --batch-size 4 --bf16 \
    --bf16-weights --compile-blocks --optimizer-overlap --cuda-graph --fused-loss \
    --grad-clip 0 --attention flash-triton --synthetic random --steps 80 --log-every 10 \
    --no-progress
fi
if want hostcost; then  # a lone attention call's host time, ours against SDPA, eager and compiled
  run host_cost $PY "$ROOT/packages/flashattn-triton/benchmarks/host_cost.py" --shape 128x512x64 \
    --compiled --breakdown --handoff
  run sweep_compiled $PY -m perf_tools.attention_sweep --quiet --modes compiled --causal yes \
    --csv "$WORK/sweep_compiled.csv" --json "$WORK/sweep_compiled.json" --plot "$WORK/sweep_compiled.png"
fi
if want traced; then  # flashattn-triton's traced compiled calls (traced_compile=auto) tested
  for i in 1 2 3; do  # three times: a wrong read of unwritten memory need not show every run
    run "traced_tests_$i" env FLASHATTN_TRITON_TRACED_COMPILE=auto $PY -m pytest -q \
      -p no:cacheprovider "$ROOT/packages/flashattn-triton/tests" -m gpu -k "compile or traced or graph"
  done
  run traced_model_tests env FLASHATTN_TRITON_TRACED_COMPILE=auto $PY -m pytest -q \
    -p no:cacheprovider "$ROOT/packages/lm-core/tests" "$ROOT/packages/perf-tools/tests" -m gpu \
    -k "compile or graph or flash"
fi
if want tracedsteps; then  # the same option timed: model steps, graphed xl, short compiled rows
  AB="$PY $ROOT/packages/perf-tools/scripts/model_step_ab.py"
  run traced_small_ab $AB --size small --context 1024 --compile --variants sdpa \
    flash-triton-opaque flash-triton-auto --threads device calling --cpus free --rounds 5 \
    --out "$WORK/traced_small_ab"
  run traced_xl_ab $AB --size xl --context 512 --blocks --variants sdpa flash-triton-auto \
    --threads device --cpus free --rounds 4 --warmup 3 --steps 10 --out "$WORK/traced_xl_ab"
  run traced_xl_graphed env FLASHATTN_TRITON_TRACED_COMPILE=auto $B --size xl --precision bf16 \
    --mode train --context 512 --batch 4 --compile blocks --cuda-graph on --optimizer-overlap on \
    --matmul-weights bf16 --fused-loss --warmup 3 --steps 10 --attention sdpa flash-triton \
    --csv "$WORK/traced_xl_graphed.csv"
  for tc in 0 auto; do
    run "traced_sweep_$tc" env FLASHATTN_TRITON_TRACED_COMPILE=$tc $PY -m perf_tools.attention_sweep \
      --quiet --modes compiled --shapes 128x512 64x1024 32x2048 16x4096 \
      --csv "$WORK/traced_sweep_$tc.csv" --json "$WORK/traced_sweep_$tc.json"
  done
fi
if want cppcompiled; then  # compiled graphs' opaque ops through C++ against traced calls
  run cpp_compiled_tests env FLASHATTN_TRITON_CPP_LAUNCH_COMPILED=1 $PY -m pytest -q \
    -p no:cacheprovider "$ROOT/packages/flashattn-triton/tests" -m gpu -k "cpp_launch or graph"
  for cc in 0 1; do
    run "cpp_compiled_sweep_$cc" env FLASHATTN_TRITON_CPP_LAUNCH_COMPILED=$cc \
      $PY -m perf_tools.attention_sweep --quiet --modes compiled --rounds 3 --host \
      --shapes 128x512 64x1024 32x2048 16x4096 8x8192 \
      --csv "$WORK/cpp_compiled_sweep_$cc.csv" --json "$WORK/cpp_compiled_sweep_$cc.json"
  done
  AB="$PY $ROOT/packages/perf-tools/scripts/model_step_ab.py"
  run cpp_compiled_small_ab $AB --size small --context 1024 --compile --variants sdpa \
    flash-triton-auto flash-triton-cpp --threads device --cpus free --rounds 5 \
    --out "$WORK/cpp_compiled_small_ab"
  # (two xl models: three in one process do not fit 80 GB; --profile: where the host time goes)
  run cpp_compiled_xl_ab $AB --size xl --context 512 --blocks --variants flash-triton-auto \
    flash-triton-cpp --threads device --cpus free --rounds 4 --warmup 3 --steps 10 \
    --profile 3 --out "$WORK/cpp_compiled_xl_ab"
fi
if want stepsab; then  # SDPA against ours in the models, interleaved in one process
  AB="$PY $ROOT/packages/perf-tools/scripts/model_step_ab.py"
  for compiled in "" "--compile"; do
    run "stepsab_small${compiled:+_compiled}" $AB --size small --context 1024 $compiled \
      --variants sdpa flash-triton --threads device --cpus free --rounds 5 \
      --out "$WORK/stepsab_small${compiled:+_compiled}"
  done
  for blocks in "" "--blocks"; do
    run "stepsab_xl${blocks:+_blocks}" $AB --size xl --context 512 $blocks --variants sdpa \
      flash-triton --threads device --cpus free --rounds 4 --warmup 3 --steps 10 \
      --out "$WORK/stepsab_xl${blocks:+_blocks}"
  done
  run stepsab_compiled_tests $PY -m pytest -q -p no:cacheprovider \
    "$ROOT/packages/flashattn-triton/tests" -m gpu -k "compile or traced or opaque"
fi
# the same comparison through perf_tools.bench, in rounds of one process
BR="$B --precision bf16 --mode train --batch 4 --attention sdpa flash-triton --warmup 3 --steps 10"
if want benchrounds; then
  run benchrounds_small $BR --size small --context 1024 --compile both --rounds 3 \
    --csv "$WORK/benchrounds_small.csv" --json "$WORK/benchrounds_small.json"
  run benchrounds_xl_eager $BR --size xl --context 512 --compile off --rounds 3 \
    --csv "$WORK/benchrounds_xl_eager.csv" --json "$WORK/benchrounds_xl_eager.json"
fi
if want benchrounds_xl; then
  run benchrounds_xl_compiled $BR --size xl --context 512 --compile on --rounds 2 \
    --csv "$WORK/benchrounds_xl_compiled.csv" --json "$WORK/benchrounds_xl_compiled.json"
fi
if want smallmodel; then  # small, 1024 tokens: eager / compiled steps and their profiles
  run small1024 $B --size small --precision bf16 --mode train --context 1024 --batch 4 \
    --attention sdpa flash-triton --compile both --isolate 3 --warmup 3 --steps 10 \
    --csv "$WORK/small1024.csv"
  run launch_cost $PY "$ROOT/packages/flashattn-triton/benchmarks/launch_cost.py" \
    --shape 4,12,1024,64 --json "$WORK/launch_cost.json"
  run profile_small1024 $PY -m perf_tools.profile --quiet --size small --precision bf16 \
    --mode train --context 1024 --batch 4 --attention sdpa flash-triton --compile --warmup 3 \
    --steps 2 --top 15 --out "$WORK/profile_small1024"
  if [ -n "${OLD_FA:-}" ]; then
    run small1024_old env PYTHONPATH="$OLD_FA:$PYTHONPATH" $B --size small --precision bf16 \
      --mode train --context 1024 --batch 4 --attention flash-triton --compile on --warmup 3 \
      --steps 10 --csv "$WORK/small1024_old.csv"
  fi
fi
if want fp32gemm; then
  run fp32_gemm $PY "$ROOT/packages/perf-tools/scripts/fp32_gemm.py" --json "$WORK/fp32_gemm.json"
  run tf32x3_variants $PY "$ROOT/packages/perf-tools/scripts/tf32x3_variants.py" \
    "$WORK/tf32x3_variants.json"
  run tf32x3_gluon_ab $PY "$ROOT/packages/perf-tools/scripts/tf32x3_gluon_ab.py" \
    "$WORK/tf32x3_gluon_ab.json"
fi
if want profile_bf16; then
  run profile_bf16 $PY -m perf_tools.profile --quiet --size xl --attention sdpa --precision bf16 \
    --mode train --context 512 --warmup 2 --steps 2 --top 12 --out "$WORK/profile_bf16"
fi
if want nccl_tests; then
  run nccl_tests $PY -m pytest packages/lm-core/tests packages/ddp-kit/tests packages/zero-shard/tests \
    packages/perf-tools/tests -m nccl -q -p no:cacheprovider --junitxml="$WORK/junit-nccl.xml"
fi
if want allreduce; then
  run allreduce $PY -m perf_tools.allreduce --backend nccl --quiet \
    --csv "$WORK/allreduce.csv" --json "$WORK/allreduce.json" --plot "$WORK/allreduce.png"
fi
if want ddp; then
  run ddp $PY -m perf_tools.ddp --quiet --csv "$WORK/ddp.csv" --json "$WORK/ddp.json" --plot "$WORK/ddp.png"
  run ddp_bf16 $PY -m perf_tools.ddp --wrappers flat bucketed torch --bucket-sizes-mb 25 100 \
    --reduce-dtype bf16 --quiet --csv "$WORK/ddp_bf16.csv" --json "$WORK/ddp_bf16.json"
fi
if want zero; then
  run zero $PY -m perf_tools.zero --quiet --csv "$WORK/zero.csv" --json "$WORK/zero.json" --plot "$WORK/zero.png"
fi
if want parallel; then
  P="$B --size xl --num-heads 20 --context 512 --precision bf16 --mode train --nprocs 2"
  P="$P --warmup 3 --steps 8"
  # DDP: eager, the whole model compiled after wrapping, and each block compiled before it
  run parallel_dp $P --batch 2 --ddp --compile off on blocks \
    --csv "$WORK/parallel_dp.csv" --json "$WORK/parallel_dp.json"
  run parallel_fsdp $P --batch 2 --fsdp torch --compile both \
    --csv "$WORK/parallel_fsdp.csv" --json "$WORK/parallel_fsdp.json"
  run parallel_tp $P --batch 4 --tp 2 --compile both \
    --csv "$WORK/parallel_tp.csv" --json "$WORK/parallel_tp.json"
fi
if want sharded_ckpt; then
  for fsdp in ours torch; do  # --batch-size is the trainer's global batch: 2 sequences per rank
    run "sharded_ckpt_$fsdp" $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
      "$ROOT/packages/perf-tools/scripts/checkpoint_timing.py" "$CKPT_ROOT/ckpt_$fsdp" \
      --size xl --bf16 --fsdp "$fsdp" --steps 2 --synthetic random --batch-size 4 \
      --context-length 512 --no-progress  # no --out-dir: the trainer saves nothing itself
    rm -rf "$CKPT_ROOT/ckpt_$fsdp"  # gigabytes of state: timed, not kept
  done
fi
if want sharded_ckpt8b; then
  run sharded_ckpt8b $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
    "$ROOT/packages/perf-tools/scripts/checkpoint_timing.py" "$CKPT_ROOT/ckpt_8b" \
    --size 8B --bf16 --fsdp ours --steps 1 --synthetic random --batch-size 4 \
    --context-length 512 --no-progress
  rm -rf "$CKPT_ROOT/ckpt_8b"
fi
if want init8b; then  # peak host RSS and device memory per rank of the 8B build, meta vs whole
  for build in meta device; do
    run "init8b_$build" $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
      "$ROOT/packages/perf-tools/scripts/init_memory.py" --size 8B --fsdp ours --build "$build"
  done
fi
if want fsdp_options; then  # accumulation without sync, reshard_after_forward=False: xl, 2 GPUs
  for fsdp in ours torch; do
    run "fsdp_options_$fsdp" $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
      "$ROOT/packages/perf-tools/scripts/fsdp_options.py" --size xl --fsdp "$fsdp" \
      --context 512 --batch 2 --accum 4 --warmup 2 --steps 5
  done
fi
if want parallel8b; then
  P="$B --size 8B --context 8192 --nprocs 2 --precision bf16 --mode train --fused-loss"
  P="$P --activation-checkpointing 1 --attention sdpa --warmup 1 --steps 3"
  run parallel8b_tp $P --batch 2 --tp 2 --csv "$WORK/parallel8b_tp.csv" --json "$WORK/parallel8b_tp.json"
  run parallel8b_fsdp $P --batch 1 --fsdp torch \
    --csv "$WORK/parallel8b_fsdp.csv" --json "$WORK/parallel8b_fsdp.json"
fi
if want step8b; then
  RUN_TIMEOUT=${STEP8B_TIMEOUT:-570} run step8b $B --size 8B --context 32768 --batch 1 \
    --nprocs 2 --fsdp ours --precision bf16 --mode train --fused-loss \
    --activation-checkpointing 1 --attention sdpa flash-triton --warmup 1 --steps 3 \
    --csv "$WORK/step8b.csv" --json "$WORK/step8b.json"
fi
if want mixed; then
  run mixed_accumulate $PY -m perf_tools.mixed_precision accumulate --json "$WORK/accumulate.json"
  run mixed_toy $PY -m perf_tools.mixed_precision toy-dtypes --json "$WORK/toy_dtypes.json"
fi
if want generate; then
  for size in small xl; do
    run "generate_$size" $PY -m perf_tools.generate_bench --quiet --sizes "$size" \
      --batch-sizes 1 16 --csv "$WORK/generate_$size.csv" --json "$WORK/generate_$size.json"
  done
fi
trainloop() {  # trainloop NAME SIZE BATCH [FLAGS...]: one train_loop run, its checkpoints deleted
  local name=$1 size=$2 batch=$3
  shift 3
  RUN_TIMEOUT=${TRAINLOOP_TIMEOUT:-$RUN_TIMEOUT} run "$name" $PY -m perf_tools.train_loop --quiet \
    --precision bf16 --compile --size "$size" --batch "$batch" "$@" --out-dir "$CKPT_ROOT/$name" \
    --csv "$WORK/$name.csv" --json "$WORK/$name.json"
  rm -rf "${CKPT_ROOT:?}/$name"
}
if want trainloop; then  # xl's checkpoints are ~22 GB each: CKPT_ROOT needs room for two
  trainloop trainloop_small small 8 --cuda-graph
  trainloop trainloop_xl xl 4 --cuda-graph
  trainloop trainloop_xl_nograph xl 4
fi
if want memory; then
  run memory $B --size 2.7B --precision fp32 bf16 --mode forward train --context 128 256 512 \
    --warmup 2 --steps 2 --csv "$WORK/memory_2.7B.csv" --json "$WORK/memory_2.7B.json"
  run memory_snapshot $B --size 2.7B --precision bf16 --mode train --context 512 --warmup 2 \
    --steps 1 --memory-snapshot "$WORK/snapshot_2.7B_bf16_train.pickle"
fi

cp "$LOG" "$OUT/suite-$TAG.log"
(cd "$WORK" && find . -name 'trace.json.gz' -o -name '*.pickle' >heavy.txt
 tar czf "$OUT/perf-results-$TAG.tar.gz" --exclude='trace.json.gz' --exclude='*.pickle' . &&
 tar czf "$OUT/perf-traces-$TAG.tar.gz" -T heavy.txt)
ls -la "$OUT"
echo "suite finished with status $status"
exit $status
