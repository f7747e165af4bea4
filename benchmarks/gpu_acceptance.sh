#!/usr/bin/env bash
# Every GPU measurement the open issues ask for, in parts that each fit one 10-minute command
# of the device tool (its budget per session, machine start included, is what its `status` says:
# 15 minutes as of 2026-11-27, so one or two parts a session, in the order below; a session that
# wants the planner's check runs `validate` first). Run from the project root on the GPU
# machine:
#
#     bash benchmarks/gpu_acceptance.sh PART        # PART: one of the names below
#     DRY_RUN=1 bash benchmarks/gpu_acceptance.sh all   # print the commands, run nothing
#
# Results go under $OUT/PART (or gpu-out/PART); commit them as
# benchmarks/results/<date>-<gpu>-PART/ with the log. DeepSpeed (the peers ds-*, deepspeed-*)
# comes from wheels in the checkout's ignored .gpu/ folder (copy ../shared/gpu/wheels/*.whl
# and ../shared/gpu/profile_step.py there); without them those systems report "not installed".
#
#   part        issue  est. min  what
#   tests       12,16  7         tests/ -m gpu (NCCL, streams, memory_allocated, offload) + demo
#   bench       12     9         llama-1b: compile-1proc, ours-z3-all, fsdp2, ds-deepcompile
#                                (DeepSpeed's one-time work is ~350 s of it)
#   offload     16     9         0.95 B Llama under a limit: ours-offload vs FSDP2/DeepSpeed offload
#   host-step   16     6         streamed step vs a host (CPU) step, 1e9 params, scaled to 7-13 B;
#                                llama-1b's AdamW step: per parameter (torch) vs the flat step
#   auto        12     6         llama-1b: compile-1proc, ours-z3-auto (the default passes)
#   big         16     9         7 B Llama on one GPU, ours-offload (tier 1 planned)
#   big-peers   16     10        the same 7 B with DeepSpeed ZeRO-Offload and FSDP2 CPUOffload
#   tier4       16     9         a 2.7 B Llama at batch 1 under an 18 GiB limit (masters must go):
#                                the host step (tier 4) against streaming (tier 3), and auto
#   validate    15     9         deepcompile plan's prediction vs measured, llama-1b, world 1
#   profile     12     4         torch.profiler over 3 steady steps, ours and plain compile
#   attention   12,15  3         llama-1b's SDPA eager and compiled: mask, is_causal, the kernel
#                                (compiled Llama gets an explicit mask before torch 2.14)
#   activations 41     9         activation_budget on CUDA: parity, budget, copy streams and
#                                pinned buffers (tests, fx and Inductor); llama-1b at 1 x 4096
#                                tokens: ours against HF full checkpointing and torch's
#                                activation_memory_budget at the same profiled peak, paired
#   layouts     42     4         2 GPUs (not part of `all`): hsdp, hsdp_zero and hpz over NCCL sub-groups
#                                made at initialize, parity with eager, collectives per group
#   z1          43     9         2 GPUs (not part of `all`): ZeRO-1 against torch.compile(DDP) over
#                                NCCL, paired (benchmarks/paired.py), tiny and small Llama at
#                                batch 1 and 4: the ratio the issue asks for, with its interval
set -u
part=${1:?usage: gpu_acceptance.sh tests|bench|offload|host-step|auto|big|big-peers|tier4|validate|profile|attention|activations|layouts|z1|all}
dry=${DRY_RUN:-0}
root=${OUT:-gpu-out}

py=python3
[[ -n "${PYTHON:-}" ]] && py=$PYTHON

setup() {
  [[ $dry == 1 ]] && return
  local whl=(.gpu/*.whl)
  if [[ -e ${whl[0]} ]]; then
    $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${whl[@]}"
  fi
  export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 MAX_JOBS=16
  export TORCH_CUDA_ARCH_LIST=9.0   # the image's 9.0a is not parsed by DeepSpeed's op builder
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
}

# run SECONDS LOG CMD...: the command under a timeout, its output in LOG and its tail shown
run() {
  local secs=$1 log=$2; shift 2
  if [[ $dry == 1 ]]; then
    printf '%q ' "$@"; echo
    return 0
  fi
  echo "+ $*" | tee -a "$log"
  timeout "$secs" "$@" 2>&1 | tee -a "$log" | tail -25
  echo "rc=${PIPESTATUS[0]}" | tee -a "$log"
}

# the 7 B Llama shape (Llama-2-7B's layers; batch 1 x 1024 tokens), under a 76 GiB limit
BIG=(--layers 32 --hidden 4096 --ffn 11008 --heads 32 --seq 1024 --batch 1 --steps 6 --timed 2
     --limit-gib 76)

one() {
  local p=$1 out=$root/$1
  [[ $dry == 1 ]] || mkdir -p "$out"
  local log=$out/$p.log
  case $p in
    tests)
      run 420 "$log" $py -m pytest tests -m gpu -q -ra -p no:cacheprovider
      run 120 "$log" $py -m deepcompile demo --steps 20 ;;
    bench)
      run 570 "$log" $py -m deepcompile bench --device cuda --workloads llama-1b \
        --systems compile-1proc ours-z3-all fsdp2 ds-deepcompile --launches 1 --steps 5 \
        --timeout 400 --out "$out" ;;
    auto)
      run 570 "$log" $py -m deepcompile bench --device cuda --workloads llama-1b \
        --systems compile-1proc ours-z3-auto --launches 1 --steps 8 --timeout 400 --out "$out" ;;
    offload)
      run 570 "$log" $py benchmarks/offload_gpu.py --steps 8 --timed 3 --timeout 240 --out "$out" ;;
    host-step)
      run 400 "$log" $py benchmarks/host_step.py --out "$out"
      run 170 "$log" $py benchmarks/opt_step.py --workload llama-1b --out "$out" ;;
    big)
      run 570 "$log" $py benchmarks/offload_gpu.py "${BIG[@]}" --systems ours-offload \
        --timeout 540 --out "$out" ;;
    big-peers)
      run 590 "$log" $py benchmarks/offload_gpu.py "${BIG[@]}" \
        --systems deepspeed-offload fsdp2-cpuoffload --timeout 290 --out "$out" ;;
    tier4)
      run 590 "$log" $py benchmarks/offload_gpu.py --layers 32 --hidden 2560 --ffn 6912 \
        --heads 20 --seq 1024 --batch 1 --steps 6 --timed 2 --limit-gib 18 \
        --systems ours-offload-host ours-offload-streamed ours-offload --timeout 190 \
        --out "$out" ;;
    validate)
      # predict for the GPU the machine has (the device tool lends an H100 or an H200)
      local gpu=h100
      if [[ $dry != 1 ]] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -qi h200
      then gpu=h200; fi
      run 570 "$log" $py benchmarks/validation/plan_validate.py --device cuda --gpu $gpu \
        --workloads llama-1b --worlds 1 --systems ours-z3 fsdp2 ds-z3 --launches 2 \
        --out "$out" ;;
    profile)
      if [[ $dry == 1 || -e .gpu/profile_step.py ]]; then
        OUT=$out run 280 "$log" $py .gpu/profile_step.py ours
        OUT=$out run 200 "$log" $py .gpu/profile_step.py plain
      else
        echo "profile: copy ../shared/gpu/profile_step.py into .gpu/ first" >&2; return 2
      fi ;;
    attention)
      run 240 "$log" $py benchmarks/attention_path.py --workload llama-1b --out "$out" ;;
    activations)
      run 200 "$log" $py -m pytest tests/gpu/test_gpu.py -k activation_budget -q -s -ra \
        -p no:cacheprovider
      run 380 "$log" $py benchmarks/activation_budget.py --device cuda --nproc 1 \
        --workload llama-1b --seq 4096 --batch 1 --torch-budget 0.1 --between \
        --systems torch-budget ours --launches 1 --rounds 5 --timeout 360 \
        --out "$out/activation_budget.json" ;;
    layouts)
      # needs 2 GPUs: two "nodes" of one (Config.shard_group_size=1)
      if [[ $dry != 1 ]] && (( $(nvidia-smi -L | wc -l) < 2 )); then
        echo "layouts: needs 2 GPUs" >&2; return 2
      fi
      run 300 "$log" $py -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/layouts_gpu.py --out "$out" ;;
    z1)
      if [[ $dry != 1 ]] && (( $(nvidia-smi -L | wc -l) < 2 )); then
        echo "z1: needs 2 GPUs" >&2; return 2
      fi
      local w
      for w in tiny-llama-b1 tiny-llama small-llama-b1 small-llama; do
        run 140 "$log" $py benchmarks/paired.py --device cuda --nproc 2 --workload $w \
          --systems ddp-compile ours-z1-auto --launches 2 --rounds 20 --timeout 65 \
          --out "$out/$w.json"
      done ;;
    *) echo "unknown part $p" >&2; return 2 ;;
  esac
}

setup
if [[ $part == all ]]; then
  for p in tests bench offload host-step auto big big-peers tier4 validate profile attention \
      activations; do
    one "$p"
  done
else
  one "$part"
fi
