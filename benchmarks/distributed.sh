#!/bin/bash
# Issue 9 on GPUs: examples/train_distributed.py, tree training under DDP / FSDP2 (root, per layer) on
# 1 and 2 GPUs, and the per-path baseline (the unmodified model on each path, DDP) on 2 GPUs.
# Usage (repo root, CUDA machine): bash benchmarks/distributed.sh JOB...   JOB in tree1 ddp2 fsdp2
# fsdp_layer2 perpath2 perpath1; logs and RESULT lines in $OUT (default /tmp/dist_out).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
OUT=${OUT:-/tmp/dist_out}
mkdir -p "$OUT"
DATA=$OUT/trees.jsonl
[ -f "$DATA" ] || python3 examples/train_distributed.py --make-data "$DATA" --num-trees 64 --data-scale 64 \
    --config qwen3_0_6b
COMMON="--data $DATA --config qwen3_0_6b --dtype bfloat16 --normalize token_mean --trees-per-step 16
        --steps ${STEPS:-10} --warmup 3 --capacity 8192 --pad-to 8192"
run() {  # name nproc args...
    local name=$1 n=$2; shift 2
    echo "== $name"
    timeout "${TMO:-400}" torchrun --standalone --nproc-per-node "$n" examples/train_distributed.py $COMMON "$@" \
        > "$OUT/$name.log" 2>&1
    echo "rc=$?"
    grep -E "^step|RESULT" "$OUT/$name.log" | tail -4
    grep -E "Error|error" "$OUT/$name.log" | tail -5
}
for job in "$@"; do
    case $job in
        tree1) run tree1 1 --wrap ddp ;;
        ddp2) run ddp2 2 --wrap ddp ;;
        fsdp2) run fsdp2 2 --wrap fsdp ;;
        fsdp_layer2) run fsdp_layer2 2 --wrap fsdp_layer ;;
        perpath2) run perpath2 2 --baseline per_path ;;
        perpath1) run perpath1 1 --baseline per_path ;;
        *) echo "unknown job $job"; exit 2 ;;
    esac
done
