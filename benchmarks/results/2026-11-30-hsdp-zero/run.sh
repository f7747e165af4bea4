#!/usr/bin/env bash
# The planner's layouts side by side with hsdp_zero (deepcompile plan): 4 x 8 H100, one
# 100 Gb/s NIC per GPU, seq 1024, GAS 1, passes="auto", each layout. Run from the repository
# root; each run takes 10-40+ minutes on a 2-core VM (the activation trade's planning). The
# committed Mixtral folder was made with --layouts shard,hsdp_zero,hpz.
set -euo pipefail
out=benchmarks/results/2026-11-30-hsdp-zero
export OMP_NUM_THREADS=1
for model in mixtral-8x7b llama-3-70b; do
  python -m deepcompile plan --model "$model" --gpu h100 --nodes 4 --gpus-per-node 8 \
    --seq 1024 --gas 1 --passes auto --peers '' \
    --layouts shard,hsdp,hsdp_zero,hpz,auto --assume net.nic_bw=12.5e9 \
    --out "$out/$model-4x8-100g-gas1"
done
