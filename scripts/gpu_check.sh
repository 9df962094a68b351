#!/usr/bin/env bash
# picotron on one CUDA GPU, in at most 5 minutes: the machine and its measured ceilings, the CUDA tests,
# and tools/bench.py in bf16 with torch.compile at three fixed sizes; then one Markdown table (docs/gpu.md's
# table takes it as it is). It needs only what such a machine has: torch, triton, tiktoken (no
# flash-attn, no network, no dataset: tools/bench.py times random tokens, the tests write tiny bins).
#
#   scripts/gpu_check.sh                      every section: env tests bench
#   scripts/gpu_check.sh tests bench-1b       the sections named: env, tests, bench (= bench-125m bench-350m
#                                             bench-1b bench-fp8); the env section always runs first
#   scripts/gpu_check.sh --dry-run            every section at a tiny size on the CPU (CUDA hidden): proves
#                                             the script and every command it runs work, in about a minute
#   --out DIR      also copy summary.md and logs.tar.gz (every log, the junit XML, the profile trace) there
#   --budget S     the whole check's seconds (default 300; 900 for a dry run, on a CPU that others share):
#                  each section's own limit is cut to what is left, and a section that would start with too
#                  little left is skipped (the table says so)
#   --work DIR     logs and the compile caches (default /tmp/picotron_gpu_check): a rerun on the same
#                  machine finds torch.compile's and Triton's caches warm
#
# Each section runs under `timeout` (a hang costs its limit, not the session), and its status, time and log
# go to sections.tsv; scripts/gpu_check.py writes the table from those logs.
# It exits 0 when every section that ran passed, 1 when one failed or timed out, and 2 at once where
# torch sees no CUDA GPU (--dry-run is the way to run it on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

DRY_RUN=0 OUT="" BUDGET="" WORK=/tmp/picotron_gpu_check SECTIONS=()
while (($#)); do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT=${2:?--out needs a folder}; shift ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
        --work) WORK=${2:?--work needs a folder}; shift ;;
        env|tests|bench-125m|bench-350m|bench-1b|bench-fp8) SECTIONS+=("$1") ;;
        bench) SECTIONS+=(bench-125m bench-350m bench-1b bench-fp8) ;;
        all) SECTIONS+=(tests bench-125m bench-350m bench-1b bench-fp8) ;;
        -h|--help) usage ;;
        *) echo "gpu_check.sh: unknown section or option '$1' (sections: env tests bench bench-125m bench-350m" \
                "bench-1b bench-fp8; options: --dry-run --out DIR --budget S --work DIR)" >&2; exit 2 ;;
    esac
    shift
done
((${#SECTIONS[@]})) || SECTIONS=(tests bench-125m bench-350m bench-1b bench-fp8)
wanted() { [[ " ${SECTIONS[*]} " == *" $1 "* ]]; }

# -----------------------------------------------------------------------------
# the sizes: sequence 2048, GPT-2's vocabulary (50257, padded to 50304), n_kv_head = n_head, SwiGLU
#
# The batch sizes are fixed ahead, so no device time goes on a search. Each is the largest power of two
# whose predicted peak stays under half of the H200's 139 GiB, the other half left for what the prediction
# misses (the backward's transient gradients, the allocator's fragmentation, the chunked loss's buffers):
#   18 bytes per parameter (fp32 weights, gradients and AdamW's two moments, and bf16 copies of the weights)
#   + 55 * n_embd bytes per token per layer of saved activations (measured on the CPU in eager bf16 with
#     saved_tensors_hooks: SDPA keeps q, k, v, its output and the log-sum-exp; the fp32 residual and norms;
#     autocast's bf16 copy of each linear's input; the SwiGLU's three hidden tensors). Compiled blocks save
#     less (the partitioner recomputes cheap pointwise ops), so this errs high.
#   12 x  768 (124M params):  2.2 GB + 64 x 2048 tokens x 12 x 55 x  768 B = 2.2 + 71 GB = 68 GiB  -> 64
#   24 x 1024 (355M params):  6.4 GB + 16 x 2048 tokens x 24 x 55 x 1024 B = 6.4 + 45 GB = 48 GiB  -> 16
#   24 x 2048 (1.32B params): 24 GB  +  8 x 2048 tokens x 24 x 55 x 2048 B = 24 + 45 GB  = 64 GiB  ->  8
# (the next power of two up would be 134, 90 and 106 GiB). The 1.2B run is also profiled (2 more steps).
#             name   layers heads width batch limit(s)
SIZES=(      "125m   12     12    768   64    60"
             "350m   24     16    1024  16    65"
             "1b     24     16    2048  8     85")
SEQ=2048 VOCAB=50257 WARMUP=3 STEPS=10 PROFILE=2 ENV_LIMIT=40 TESTS_LIMIT=130
DEVICE_ARGS=(--device=cuda --dtype=bfloat16 --compile=True)
if ((DRY_RUN)); then  # the same commands at a tiny size, on the CPU, CUDA hidden
    SIZES=("125m 2 4 64 2 150" "350m 2 4 96 2 150" "1b 3 4 128 2 150")
    SEQ=64 VOCAB=512 WARMUP=1 STEPS=1 PROFILE=1 ENV_LIMIT=150 TESTS_LIMIT=150 BUDGET=${BUDGET:-900}
    DEVICE_ARGS=(--device=cpu --dtype=float32 --compile=False --peak_flops=1e12)
    export CUDA_VISIBLE_DEVICES=""
fi
BUDGET=${BUDGET:-300}
if ((!DRY_RUN)) && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False): this check times a" \
         "CUDA GPU; run it on one, or try the script itself with --dry-run" >&2
    exit 2
fi

STAMP=$(date +%Y%m%d-%H%M%S)
LOGS="$WORK/logs/$STAMP"
mkdir -p "$LOGS" || exit 1
: >"$LOGS/sections.tsv"
# torch.compile's and Triton's caches, kept between the sizes, the tests and reruns on this machine
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor_cache" TRITON_CACHE_DIR="$WORK/triton_cache"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
START=$(date +%s)
RESERVE=10   # seconds kept for the summary

# run_section SECTION CHECK LIMIT LOG COMMAND...: the command under timeout, its output to the console and LOG
run_section() {
    local section=$1 check=$2 limit=$3 log=$4 status
    shift 4
    local left=$((BUDGET - ($(date +%s) - START) - RESERVE))
    if ((left < 20)); then
        printf '%s\t%s\t%s\t%s\t%s\n' "$section" "$check" "skipped: ${left}s of the ${BUDGET}s budget left" 0 "$log" \
            >>"$LOGS/sections.tsv"
        return
    fi
    ((limit > left)) && limit=$left
    echo "=== $section: $check (limit ${limit}s) ==="
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    case $rc in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$section" "$check" "$status" "$(($(date +%s) - t0))" "$log" >>"$LOGS/sections.tsv"
}

run_section env "the machine: GPU, versions, bf16 matmul and copy rates" "$ENV_LIMIT" "$LOGS/env.log" \
    "$PYTHON" scripts/gpu_check.py env $( ((DRY_RUN)) && echo --dry-run)

if wanted tests; then
    run_section tests "pytest -m cuda tests/test_cuda.py" "$TESTS_LIMIT" "$LOGS/tests.log" \
        "$PYTHON" -m pytest -q -m cuda tests/test_cuda.py -rfEs -p no:cacheprovider --junitxml="$LOGS/tests.xml"
fi

for size in "${SIZES[@]}"; do
    read -r name layers heads width batch limit <<<"$size"
    wanted "bench-$name" || continue
    args=(--n_layer="$layers" --n_head="$heads" --n_kv_head="$heads" --n_embd="$width" --batch_size="$batch"
          --block_size="$SEQ" --vocab_size="$VOCAB" --warmup_steps="$WARMUP" --bench_steps="$STEPS" "${DEVICE_ARGS[@]}")
    [[ $name == 1b ]] && args+=(--profile_steps="$PROFILE" --profile_trace="$LOGS/profile_$name.json.gz")
    run_section bench "$layers x $width, batch $batch x $SEQ" "$limit" "$LOGS/bench_$name.log" \
        "$PYTHON" tools/bench.py "${args[@]}"
done

# FP8 (fp8.py, tensorwise) at the 350M size, timed in turn against the same step in bf16 (--compare_fp8): the
# speed-up only a card with FP8 tensor cores shows (compute capability 8.9+; below it fp8 stops at start-up)
if wanted bench-fp8; then
    read -r name layers heads width batch limit <<<"${SIZES[1]}"
    run_section bench "fp8 tensorwise against bf16, $layers x $width, batch $batch x $SEQ" 90 "$LOGS/bench_fp8.log" \
        "$PYTHON" tools/bench.py --n_layer="$layers" --n_head="$heads" --n_kv_head="$heads" --n_embd="$width" \
        --batch_size="$batch" --block_size="$SEQ" --vocab_size="$VOCAB" --warmup_steps="$WARMUP" \
        --bench_steps="$STEPS" "${DEVICE_ARGS[@]}" --fp8=tensorwise --compare_fp8=True
fi

echo "=== summary ($LOGS) ==="
"$PYTHON" scripts/gpu_check.py summary "$LOGS"
rc=$?
if [[ -n $OUT ]]; then
    mkdir -p "$OUT" && cp "$LOGS/summary.md" "$OUT/" && tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
fi
echo "(logs: $LOGS; $(($(date +%s) - START)) s in all)"
exit $rc
