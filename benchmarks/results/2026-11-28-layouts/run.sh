#!/usr/bin/env bash
# The layouts past one node, planned: `deepcompile plan` for Llama-3-70B and Mixtral-8x7B on
# 4 x 8 and 16 x 8 H100 (seq 1024, batch 1 per GPU, GAS 1/4/16), passes="auto", every layout
# (shard, hsdp, hpz) and what Config.layout="auto" picks; then the same on 4 x 8 with a
# 100 Gb/s NIC per GPU (a quarter of the default's). Run from the project root; each plan takes
# 5-15 min on 2 shared cores. PY: the Python to run (default: python).
set -eu
here=$(dirname "$0")
py=${PY:-python}
for nodes in 4 16; do
  for model in llama-3-70b mixtral-8x7b; do
    $py -m deepcompile plan --model $model --gpu h100 --nodes $nodes --gpus-per-node 8 \
      --seq 1024 --gas 1 4 16 --passes auto --peers '' --out "$here/$model-${nodes}x8"
  done
done
for model in llama-3-70b mixtral-8x7b; do
  $py -m deepcompile plan --model $model --gpu h100 --nodes 4 --gpus-per-node 8 \
    --seq 1024 --gas 1 4 16 --passes auto --peers '' --assume net.nic_bw=12.5e9 \
    --out "$here/$model-4x8-nic100"
done
