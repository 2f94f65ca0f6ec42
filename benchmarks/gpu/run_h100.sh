#!/usr/bin/env bash
# Run Octavo's GPU checks and benchmarks on the device machine (NVIDIA H100/H200).
#   bash benchmarks/gpu/run_h100.sh [setup] [tests] [conformance] [bench] [bench-offline]
#                                    [bench-offline-sync] [bench-offline-mp] [bench-async]
#                                    [latency] [latency-ab] [latency-trees] [latency-sync]
#                                    [latency-mp] [profile]
#                                    [profile-b1] [profile-8b]
#                                    [w1-timeline] [w1-timeline-async] [w1-timeline-cold]
#                                    [profile-sync] [profile-cprofile] [decode-attn-sweep]
#                                    [bench-moe] [moe-kernel] [moe-kernel-sweep] [bench-structured]
#                                    [quant-tests] [quant-kernels] [quant-kernels-sweep] [bf16-gemv]
#                                    [quant-configs] [dense-gemv]
#                                    [quant-latency] [quant-w1] [quant-w1-kv]
#                                    [int4-mma] [int4-chain]
#                                    [bench-swap] [profile-structured] [profile-host] [bench-serve]
#                                    [bench-serve-multi] [bench-structured-gil]
#                                    [bench-structured-process] [bench-structured-trees]
#                                    [w1-timeline-structured]
#                                    [spec-tests] [bench-spec] [bench-spec-draft]
#                                    [bench-spec-eagle3]
#                                    [lora-tests] [bench-lora] [bench-lora-q05] [bench-lora-l8b]
# Needs the wheels the GPU image lacks in .whl/ (see docs/benchmarks.md); logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/octavo-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=/tmp/qwen2.5-0.5b-random
MOE_MODEL=/tmp/qwen3-30b-a3b-config  # config + tokenizer only: --load-format dummy
# Qwen2.5-0.5B's shape with SmolLM2's tokenizer (a vocabulary that spells JSON), from
# .bench-assets/smollm2-tokenizer (benchmarks/gpu/export_tokenizer.py, carried from here).
JSON_MODEL=/tmp/qwen2.5-0.5b-smollm2-vocab
# Llama-3-8B shape, config + tokenizer only: run with --load-format dummy (random weights made
# on the GPU); the GPTQ one's config asks for 4-bit group-128 weights.
L8B=/tmp/llama3-8b-config
L8B_GPTQ=/tmp/llama3-8b-gptq-config
# Llama-3.2-1B shape (Llama-3's vocabulary), config + tokenizer only: the draft of bench-spec-draft.
L1B=/tmp/llama3.2-1b-config
# W1 with every request constrained to a JSON schema, then the same requests unconstrained
# (bench-structured and its A/B stages; the caller redirects its output).
structured_w1() {
  octavo bench throughput --model $JSON_MODEL --dtype bfloat16 --num-prompts 256 \
    --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
    --max-num-seqs 256 --async-engine --structured json "$@"
}
# Runs "$1 NAME DIR" for each source tree of AB_TREES="NAME=DIR ..." (DIR holds core/ and
# backends/ of one revision: `.`, or `git archive REV core backends | tar -x -C .ab/REV` made
# on the workstation and carried) in the order AB_ORDER (default: the names, twice), each
# after installing its core and CUDA backend editable; `.` is installed again at the end.
over_trees() {
  local -A tree_of=()
  local names=() arg name
  for arg in ${AB_TREES:?AB_TREES=\"NAME=DIR ...\" names the trees}; do
    tree_of[${arg%%=*}]=${arg#*=}
    names+=("${arg%%=*}")
  done
  for name in ${AB_ORDER:-${names[*]} ${names[*]}}; do
    [ -n "${tree_of[$name]:-}" ] || { echo "unknown tree $name"; exit 1; }
    python3 -m pip install -q --no-deps --no-build-isolation -e "${tree_of[$name]}/core" \
      -e "${tree_of[$name]}/backends/cuda" || exit 1
    "$1" "$name" "${tree_of[$name]}"
  done
  python3 -m pip install -q --no-deps --no-build-isolation -e ./core -e ./backends/cuda
}
# The model arguments of a batch-1 latency run ($1: 05b, 8b, 8b-fp8 or 8b-int4) into $args.
latency_args() {
  case $1 in
    05b) args=(--model $MODEL) ;;
    8b) args=(--model $L8B --load-format dummy --max-model-len 4096) ;;
    8b-fp8) args=(--model $L8B --load-format dummy --max-model-len 4096 --quantization fp8) ;;
    8b-int4) args=(--model $L8B_GPTQ --load-format dummy --max-model-len 4096) ;;
    *) echo "unknown model entry $1 (05b, 8b, 8b-fp8, 8b-int4)"; return 1 ;;
  esac
}
# Waits until the server started in the background as $1 (its pid) answers /health on port $2.
wait_health() {
  python3 - "$1" "$2" <<'PY' || return 1
import os, sys, time, urllib.request
pid, port = int(sys.argv[1]), sys.argv[2]
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited while starting")
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit("the server did not answer /health in 240 s")
PY
}
make_l8b() {
  [ -d $L8B ] || python3 benchmarks/gpu/make_random_model.py --shape llama3-8b --config-only \
    --out $L8B || exit 1
  [ -d $L8B_GPTQ ] || python3 benchmarks/gpu/make_random_model.py --shape llama3-8b \
    --config-only --quant-config gptq --out $L8B_GPTQ || exit 1
}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(setup tests bench latency)

for stage in "${stages[@]}"; do
  case $stage in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
      python3 -m pip install -q --no-deps --no-build-isolation -e ./core -e ./backends/cuda || exit 1
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      # The host's CPU topology: whether its vCPUs are hardware threads sharing cores (the
      # engine thread beside a busy grammar thread on one core is a guess for the JSON runs'
      # spread; docs/benchmarks.md, "The H100 again").
      lscpu | grep -E "^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))" || true
      echo "cpu0 shares its core with: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>/dev/null)"
      python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
      octavo backends
      ;;
    conformance)
      # The backend conformance kit that ships with the core, against the CUDA backend.
      python3 -m pytest -q -p no:cacheprovider --octavo-backend cuda \
        --pyargs octavo.testing.conformance 2>&1 | tee "$OUT/conformance.log" | tail -25
      ;;
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu backends/cuda/tests tests/kernels tests/worker 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
      ;;
    bench)
      # W1 through AsyncLLM (engine core in its own process, as `octavo serve` runs it), then
      # HF transformers generate on the same token ids in static batches of 256, same process.
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      octavo bench throughput --model $MODEL --dtype bfloat16 --num-prompts 256 \
        --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
        --max-num-seqs 256 --async-engine --compare-hf --hf-batch-size 256 \
        2>"$OUT/bench-throughput.err" | tee "$OUT/bench-throughput.log"
      tail -3 "$OUT/bench-throughput.err"
      ;;
    bench-offline)
      # W1 through LLM.generate (engine core in this process), Octavo only.
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      octavo bench throughput --model $MODEL --dtype bfloat16 --num-prompts 256 \
        --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
        --max-num-seqs 256 2>>"$OUT/bench-offline.err" | tee -a "$OUT/bench-offline.log"
      tail -3 "$OUT/bench-offline.err"
      ;;
    bench-swap)
      # W1 (LLM.generate) with the KV pool forced to a quarter of what the workload can use
      # (256 x 2048 tokens = 32768 blocks of 16; 8192 here): preemption by recompute, then by
      # swapping to 16 GiB of pinned host memory. Output tok/s and preemptions of each.
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      for mode in recompute swap; do
        echo "== preemption mode $mode"
        octavo bench throughput --model $MODEL --dtype bfloat16 --num-prompts 256 \
          --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
          --max-num-seqs 256 --num-gpu-blocks-override 8192 --preemption-mode $mode \
          --swap-space 16 2>"$OUT/bench-swap-$mode.err" | tee "$OUT/bench-swap-$mode.log"
        tail -3 "$OUT/bench-swap-$mode.err"
      done
      ;;
    bench-offline-sync)
      # As bench-offline, one step at a time (no async scheduling): what the overlap buys.
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      octavo bench throughput --model $MODEL --dtype bfloat16 --num-prompts 256 \
        --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
        --max-num-seqs 256 --no-async-scheduling 2>"$OUT/bench-offline-sync.err" \
        | tee "$OUT/bench-offline-sync.log"
      tail -3 "$OUT/bench-offline-sync.err"
      ;;
    bench-offline-mp)
      # As bench-offline, with the one rank in a worker process (the mp executor of -tp/-pp).
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      octavo bench throughput --model $MODEL --dtype bfloat16 --num-prompts 256 \
        --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
        --max-num-seqs 256 --distributed-executor-backend mp 2>>"$OUT/bench-offline-mp.err" \
        | tee -a "$OUT/bench-offline-mp.log"
      tail -3 "$OUT/bench-offline-mp.err"
      ;;
    bench-async)
      # W1 through AsyncLLM, Octavo only.
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      octavo bench throughput --model $MODEL --dtype bfloat16 --num-prompts 256 \
        --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
        --max-num-seqs 256 --async-engine 2>"$OUT/bench-async.err" | tee "$OUT/bench-async.log"
      tail -3 "$OUT/bench-async.err"
      ;;
    latency)
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      octavo bench latency --model $MODEL --dtype bfloat16 --input-len 128 --output-len 256 \
        --num-iters 3 2>"$OUT/bench-latency.err" | tee "$OUT/bench-latency.log"
      tail -3 "$OUT/bench-latency.err"
      ;;
    latency-ab)
      # Batch-1 ms per output token with an A/B switch on and off in turns, one process each
      # (AB_ENV names it, e.g. OCTAVO_PDL, OCTAVO_ROTARY_CACHE_WRITE,
      # OCTAVO_SKINNY_IN_KERNEL_SUM; AB_VALUES its two values, default "1 0", e.g.
      # AB_ENV=OCTAVO_SKINNY_CONFIG_DIR AB_VALUES="$OUT/tables core/src/octavo/kernels/triton/configs";
      # AB_MODELS="05b 8b 8b-fp8 8b-int4", default 05b; each value twice, ~25 s a run on the
      # 0.5B shape, ~45 s on the 8B).
      [ -n "${AB_ENV:-}" ] || { echo "latency-ab needs AB_ENV=NAME"; exit 1; }
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      make_l8b
      for which in ${AB_MODELS:-05b}; do
        latency_args "$which" || exit 1
        read -r value_a value_b <<< "${AB_VALUES:-1 0}"
        for value in "$value_a" "$value_b" "$value_a" "$value_b"; do
          ms=$(env "$AB_ENV=$value" octavo bench latency "${args[@]}" --dtype bfloat16 \
            --input-len 128 --output-len 256 --num-iters 3 2>>"$OUT/latency-ab.err" \
            | python3 -c "import json, sys; print([json.loads(l) for l in sys.stdin if l.startswith('{')][-1]['ms_per_output_token'])")
          echo "$which $AB_ENV=$value: $ms ms per output token" | tee -a "$OUT/latency-ab.log"
        done
      done
      ;;
    latency-trees)
      # Batch-1 ms per output token of several source trees in turn, one fresh process a run:
      # AB_TREES="NAME=DIR ..." as bench-structured-trees takes them (DIR holds core/ and
      # backends/ of one revision, e.g. `git archive REV core backends | tar -x -C .ab/REV`
      # on the workstation, carried), AB_MODELS as latency-ab (default 8b), AB_ORDER (default:
      # the names, twice); `.` is installed again at the end.
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      make_l8b
      latency_of_tree() {
        for which in ${AB_MODELS:-8b}; do
          latency_args "$which" || exit 1
          ms=$(octavo bench latency "${args[@]}" --dtype bfloat16 --input-len 128 \
            --output-len 256 --num-iters 3 2>>"$OUT/latency-trees.err" \
            | python3 -c "import json, sys; print([json.loads(l) for l in sys.stdin if l.startswith('{')][-1]['ms_per_output_token'])")
          echo "$which tree $1: $ms ms per output token" | tee -a "$OUT/latency-trees.log"
        done
      }
      over_trees latency_of_tree
      ;;
    latency-sync)
      # As latency, one step at a time (no async scheduling).
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      octavo bench latency --model $MODEL --dtype bfloat16 --input-len 128 --output-len 256 \
        --num-iters 3 --no-async-scheduling 2>"$OUT/bench-latency-sync.err" \
        | tee "$OUT/bench-latency-sync.log"
      tail -3 "$OUT/bench-latency-sync.err"
      ;;
    latency-mp)
      # As latency, with the one rank in a worker process (the mp executor).
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      octavo bench latency --model $MODEL --dtype bfloat16 --input-len 128 --output-len 256 \
        --num-iters 3 --distributed-executor-backend mp 2>"$OUT/bench-latency-mp.err" \
        | tee "$OUT/bench-latency-mp.log"
      tail -3 "$OUT/bench-latency-mp.err"
      ;;
    profile)
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      python3 benchmarks/gpu/profile_steps.py --model $MODEL 2>&1 | tee "$OUT/profile.log" | tail -40
      python3 benchmarks/gpu/profile_steps.py --model $MODEL --num-requests 1 2>&1 \
        | tee "$OUT/profile-batch1.log" | tail -40
      ;;
    profile-cprofile)
      # Where the engine thread's CPU goes in a steady decode step at ~229 running (in-process,
      # async scheduling): its CPU time per step beside wall and GPU time, then 40 steps under
      # cProfile (functions of most own time), unconstrained and JSON-constrained (~3 min; #15).
      [ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
        --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL
      for flag in "" "--structured json"; do
        python3 benchmarks/gpu/profile_steps.py --model $JSON_MODEL --cprofile 45 $flag 2>&1 \
          | tee -a "$OUT/profile-cprofile.log" | grep -E "plain window|unprofiled|profiled:"
      done
      ;;
    decode-attn-sweep)
      # The decode attention kernels at W1's steady state (229 sequences, contexts 200-2048,
      # the 0.5B shape, graph-sized launches) over split policies and launch configs, then the
      # 8B shape (~4 min).
      (cd benchmarks/gpu && python3 bench_decode_attention.py 2>"$OUT/decode-attn-sweep.err" \
        | tee "$OUT/decode-attn-sweep.log" | grep -v '^{"bench"' | tail -40)
      # The Llama-3-8B shape (32 heads, 8 KV heads, head_dim 128) at W1's 226 running.
      (cd benchmarks/gpu && python3 bench_decode_attention.py --num-seqs 226 --num-heads 32 \
        --num-kv-heads 8 --head-dim 128 2>>"$OUT/decode-attn-sweep.err" \
        | tee "$OUT/decode-attn-sweep-8b.log" | grep -v '^{"bench"' | tail -40)
      ;;
    profile-b1)
      # Batch-1 decode kernels (which ones, how long, how many per step): 0.5B bf16, and the
      # Llama-3-8B shape in bf16, with fp8 weights and GPTQ int4 (dummy weights).
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      make_l8b
      for spec in "$MODEL bf16 auto" "$L8B bf16 dummy" "$L8B fp8 dummy" "$L8B_GPTQ int4 dummy"; do
        set -- $spec
        quant=(); [ "$2" = fp8 ] && quant=(--quantization fp8)
        python3 benchmarks/gpu/profile_steps.py --model "$1" --load-format "$3" "${quant[@]}" \
          --num-requests 1 --output-len 300 --warmup-steps 40 --steps 40 --row-limit 30 2>&1 \
          | tee "$OUT/profile-b1-$(basename "$1")-$2.log" | tail -48
      done
      ;;
    profile-8b)
      # W1's steady decode on the Llama-3-8B shape (dummy weights): GPU-busy fraction of a step.
      make_l8b
      python3 benchmarks/gpu/profile_steps.py --model $L8B --load-format dummy 2>&1 \
        | tee "$OUT/profile-8b.log" | tail -24
      ;;
    w1-timeline)
      # Every step of a whole W1 run (0.5B, in-process engine) timed and grouped: prefill/mixed
      # steps and decode steps by running requests (bands of 32); where W1's seconds go (~1 min).
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      python3 benchmarks/gpu/w1_timeline.py --model $MODEL 2>"$OUT/w1-timeline.err" \
        | tee "$OUT/w1-timeline.log" | tail -14
      ;;
    w1-timeline-async)
      # The same W1 run through AsyncLLM (engine core in its own process), each step timed as
      # its message reaches the front end; both processes' CPU time per step (~1 min).
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      python3 benchmarks/gpu/w1_timeline.py --model $MODEL --async-engine \
        2>"$OUT/w1-timeline-async.err" | tee "$OUT/w1-timeline-async.log" | tail -14
      ;;
    w1-timeline-cold)
      # w1-timeline and w1-timeline-async without the warm-up run, as `octavo bench throughput`
      # measures: the first-call costs of a fresh process land in the timed run (~2 min).
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      python3 benchmarks/gpu/w1_timeline.py --model $MODEL --no-warmup --print-steps 24 --list-compiles \
        2>"$OUT/w1-timeline-cold.err" | tee "$OUT/w1-timeline-cold.log" | tail -60
      python3 benchmarks/gpu/w1_timeline.py --model $MODEL --async-engine --no-warmup \
        --print-steps 24 2>"$OUT/w1-timeline-async-cold.err" \
        | tee "$OUT/w1-timeline-async-cold.log" | tail -38
      ;;
    profile-sync)
      # As profile, one step at a time (no async scheduling).
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      python3 benchmarks/gpu/profile_steps.py --model $MODEL --no-async-scheduling 2>&1 \
        | tee "$OUT/profile-sync.log" | tail -12
      python3 benchmarks/gpu/profile_steps.py --model $MODEL --num-requests 1 \
        --no-async-scheduling 2>&1 | tee "$OUT/profile-batch1-sync.log" | tail -12
      ;;
    profile-host)
      # The engine core's host work per steady decode step on this machine's CPU: a tiny Llama
      # on the CPU backend, 256 requests, per-phase µs, unconstrained and JSON (~2 min; #15).
      for flag in "" "--structured json"; do
        python3 benchmarks/cpu/profile_host_steps.py --windows 5 --clock cpu $flag 2>/dev/null \
          | tee -a "$OUT/profile-host.log" | tail -16
      done
      ;;
    bench-moe)
      # W1 on a Qwen3-30B-A3B-shaped MoE (61 GB of bf16 weights, random, made on the GPU by
      # --load-format dummy), through AsyncLLM like `bench`; no HF comparison (no 30B HF model
      # fits beside it).
      [ -d $MOE_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen3-30b-a3b \
        --config-only --out $MOE_MODEL
      octavo bench throughput --model $MOE_MODEL --load-format dummy --dtype bfloat16 \
        --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
        --max-num-seqs 256 --gpu-memory-utilization 0.92 --async-engine \
        2>"$OUT/bench-moe.err" | tee "$OUT/bench-moe.log"
      tail -3 "$OUT/bench-moe.err"
      ;;
    moe-kernel)
      # The fused MoE kernel alone at Qwen3-30B-A3B's layer shape against its weight-read floor.
      python3 benchmarks/kernels/bench_fused_moe.py 2>&1 | tee "$OUT/moe-kernel.log" | tail -14
      ;;
    moe-kernel-sweep)
      # As moe-kernel, plus a search over launch configs (to tune default_moe_config).
      python3 benchmarks/kernels/bench_fused_moe.py --sweep --skip-native \
        2>"$OUT/moe-kernel-sweep.err" | tee "$OUT/moe-kernel-sweep.log" | tail -14
      ;;
    bench-structured)
      # W1 with every request constrained to a JSON schema (octavo.testing.json_schemas), then
      # the same requests unconstrained with the same output lengths, same engine, one run.
      [ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
        --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL
      structured_w1 2>"$OUT/bench-structured.err" | tee "$OUT/bench-structured.log"
      tail -3 "$OUT/bench-structured.err"
      ;;
    bench-structured-gil)
      # bench-structured's command six times, alternating the grammar thread's settings:
      # before the sixth round (loop:0 = OCTAVO_GRAMMAR_ACCEPT=loop with Python's 5 ms GIL
      # switch interval), the default (loop:200 = a 200 µs switch interval while the grammar
      # thread works) and the parallel accept (parallel:200), one lease (~9 min; GIL_CONFIGS
      # overrides the list); the grammars on the engine core's threads (OCTAVO_GRAMMAR_PROCESS=0).
      [ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
        --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL
      for cfg in ${GIL_CONFIGS:-loop:0 loop:200 parallel:200 loop:0 loop:200 parallel:200}; do
        echo "== OCTAVO_GRAMMAR_ACCEPT=${cfg%%:*} OCTAVO_GRAMMAR_SWITCH_INTERVAL_US=${cfg##*:}" \
          | tee -a "$OUT/bench-structured-gil.log"
        OCTAVO_GRAMMAR_PROCESS=0 OCTAVO_GRAMMAR_ACCEPT=${cfg%%:*} \
          OCTAVO_GRAMMAR_SWITCH_INTERVAL_US=${cfg##*:} \
          structured_w1 2>>"$OUT/bench-structured-gil.err" \
          | tee -a "$OUT/bench-structured-gil.log" | tail -4
      done
      ;;
    bench-structured-process)
      # The grammars on the engine core's threads (OCTAVO_GRAMMAR_PROCESS=0) or in a process of
      # their own (1, with the accept through llguidance's pool or a loop): bench-structured's
      # command alternating them, then profile_steps.py's plain window for each setting
      # (~8 min; PROCESS_CONFIGS and PROFILE_CONFIGS override the lists).
      [ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
        --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL
      # A config is process:accept[:spin µs[:threads[:grammar CPUs[:engine CPUs]]]]
      # (OCTAVO_GRAMMAR_SPIN_US, OCTAVO_GRAMMAR_THREADS, OCTAVO_GRAMMAR_CPUS, and the CPUs
      # `taskset -c` gives the benchmark's own process and the engine core; CPU lists as
      # taskset takes them, e.g. 1:parallel:::8-15:0-7; empty: the engine's default);
      # PROFILE_REQUESTS sets profile_steps.py's --num-requests (default 256).
      for cfg in ${PROCESS_CONFIGS:-1:parallel 0:parallel 1:loop 1:parallel 0:parallel 1:loop}; do
        IFS=: read -r proc accept spin threads gcpus ecpus <<< "$cfg"
        python3 benchmarks/gpu/host_probe.py | tee -a "$OUT/bench-structured-process.log"
        echo "== OCTAVO_GRAMMAR_PROCESS=$proc OCTAVO_GRAMMAR_ACCEPT=$accept" \
          "OCTAVO_GRAMMAR_SPIN_US=${spin:-default} OCTAVO_GRAMMAR_THREADS=${threads:-default}" \
          "OCTAVO_GRAMMAR_CPUS=${gcpus:-any} engine CPUs ${ecpus:-any}" \
          "(at $(date +%s.%N))" | tee -a "$OUT/bench-structured-process.log"
        (export OCTAVO_GRAMMAR_PROCESS=$proc OCTAVO_GRAMMAR_ACCEPT=$accept
         [ -z "$spin" ] || export OCTAVO_GRAMMAR_SPIN_US=$spin
         [ -z "$threads" ] || export OCTAVO_GRAMMAR_THREADS=$threads
         [ -z "$gcpus" ] || export OCTAVO_GRAMMAR_CPUS=$gcpus
         # This subshell's CPUs, which the benchmark and the engine core inherit.
         [ -z "$ecpus" ] || taskset -cp "$ecpus" $BASHPID >/dev/null
         structured_w1) 2>>"$OUT/bench-structured-process.err" \
          | tee -a "$OUT/bench-structured-process.log" | grep -E "ratio|grammar :|engine  :|host    :"
      done
      for cfg in ${PROFILE_CONFIGS:-1:parallel 0:parallel 1:loop}; do
        IFS=: read -r proc accept spin <<< "$cfg"
        echo "== profile: OCTAVO_GRAMMAR_PROCESS=$proc OCTAVO_GRAMMAR_ACCEPT=$accept" \
          "OCTAVO_GRAMMAR_SPIN_US=${spin:-default} --num-requests ${PROFILE_REQUESTS:-256}" \
          | tee -a "$OUT/bench-structured-process.log"
        (export OCTAVO_GRAMMAR_PROCESS=$proc OCTAVO_GRAMMAR_ACCEPT=$accept
         [ -z "$spin" ] || export OCTAVO_GRAMMAR_SPIN_US=$spin
         python3 benchmarks/gpu/profile_steps.py --model $JSON_MODEL --structured json \
           --num-requests ${PROFILE_REQUESTS:-256}) 2>&1 \
          | tee -a "$OUT/bench-structured-process.log" | grep -E "plain window|unprofiled"
      done
      ;;
    bench-structured-mp)
      # bench-structured with the one rank in a worker process (--distributed-executor-backend
      # mp). A config is ahead[:spin µs]: OCTAVO_PREPARE_AHEAD (1: the next step sent to the
      # rank and prepared there while the grammars finish; 0: sent after the sampling) and
      # OCTAVO_WORKER_SPIN_US (empty: the default); MP_CONFIGS overrides the list.
      [ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
        --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL
      for cfg in ${MP_CONFIGS:-1 0 1 0}; do
        IFS=: read -r ahead spin <<< "$cfg"
        python3 benchmarks/gpu/host_probe.py | tee -a "$OUT/bench-structured-mp.log"
        echo "== --distributed-executor-backend mp OCTAVO_PREPARE_AHEAD=$ahead" \
          "OCTAVO_WORKER_SPIN_US=${spin:-default} (at $(date +%s.%N))" \
          | tee -a "$OUT/bench-structured-mp.log"
        (export OCTAVO_PREPARE_AHEAD=$ahead
         [ -z "$spin" ] || export OCTAVO_WORKER_SPIN_US=$spin
         structured_w1 --distributed-executor-backend mp) 2>>"$OUT/bench-structured-mp.err" \
          | tee -a "$OUT/bench-structured-mp.log" | grep -E "^(json|free|ratio|grammar|engine|host) "
      done
      ;;
    bench-structured-trees)
      # bench-structured's command over several source trees in turn, one fresh process a run,
      # each after host_probe.py: AB_TREES="NAME=DIR ..." (DIR holds core/ and backends/ of one
      # revision: `.`, or one made on the workstation with `git archive REV core backends |
      # tar -x -C .ab/REV` and carried); each run installs its tree's core and CUDA backend
      # editable first, and `.` is installed again at the end. AB_ORDER (default: the names,
      # twice) sets the order; AB_ARGS adds arguments (e.g. "--distributed-executor-backend mp").
      [ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
        --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL
      structured_of_tree() {
        python3 benchmarks/gpu/host_probe.py | tee -a "$OUT/bench-structured-trees.log"
        echo "== tree $1 ($2) ${AB_ARGS:-} (at $(date +%s.%N))" \
          | tee -a "$OUT/bench-structured-trees.log"
        structured_w1 ${AB_ARGS:-} 2>>"$OUT/bench-structured-trees-$1.err" \
          | tee -a "$OUT/bench-structured-trees.log" | grep -E "^(json|free|ratio|grammar|engine|host) "
      }
      over_trees structured_of_tree
      ;;
    w1-timeline-structured)
      # bench-structured's pair of runs REPEAT times (default 5) on one AsyncLLM engine, each
      # run's per-step messages timed by group beside the grammar counters (w1_timeline.py).
      [ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
        --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL
      python3 benchmarks/gpu/w1_timeline.py --model $JSON_MODEL --structured json \
        --async-engine --repeat ${REPEAT:-5} 2>"$OUT/w1-timeline-structured.err" \
        | tee "$OUT/w1-timeline-structured.log" | grep -v '^{"bench"'
      tail -3 "$OUT/w1-timeline-structured.err"
      ;;
    profile-structured)
      # Where a constrained step's time goes: per-phase step profile (benchmarks/gpu/
      # profile_steps.py) with and without every request JSON-constrained, then the grammar
      # engine alone at 256 rows with 4, 8 and 14 mask threads on this host (~4 min).
      [ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
        --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL
      for flag in "" "--structured json"; do
        python3 benchmarks/gpu/profile_steps.py --model $JSON_MODEL $flag 2>&1 \
          | tee -a "$OUT/profile-structured.log" | tail -14
      done
      for threads in 4 8 14; do
        python3 benchmarks/cpu/bench_grammar_masks.py --tokenizer .bench-assets/smollm2-tokenizer \
          --rows 256 --threads $threads --steps 40 2>&1 | tail -1
      done
      ;;
    quant-tests)
      # Quantized weights and the fp8 KV cache on the GPU: Triton int4/GGUF GEMMs and fp8 KV
      # kernels at Llama-3-8B shapes, and end to end through the CUDA backend (~6 min).
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_triton_quant_gemm.py \
        tests/kernels/test_triton_skinny_gemm.py tests/kernels/test_triton_fp8_kv_cache.py \
        backends/cuda/tests/test_cuda_quantization.py \
        2>&1 | tee "$OUT/quant-tests.log" | tail -25
      ;;
    quant-kernels)
      # The small-M kernels (fp8 w8a16, int4 GPTQ) alone at Llama-3-8B's layer shapes, M = 1,
      # 4, 16, against bf16, the large-M paths and the weight-read floors (~3 min).
      python3 benchmarks/gpu/bench_quant_gemv.py 2>&1 | tee "$OUT/quant-kernels.log" | tail -30
      ;;
    dense-gemv)
      # cuBLAS vs the one-row dense GEMV that reads its weights before it waits (PDL), each
      # after an RMS norm, and in a layer-like chain (0.5B and 8B shapes; ~3 min).
      (cd benchmarks/gpu && python3 bench_dense_gemv.py) 2>"$OUT/dense-gemv.err" \
        | tee "$OUT/dense-gemv.log" | tail -14
      ;;
    bf16-gemv)
      # cuBLAS vs a Triton skinny kernel for bf16 weights at one row (0.5B and 8B shapes).
      (cd benchmarks/gpu && python3 bench_bf16_gemv.py) 2>&1 | tee "$OUT/bf16-gemv.log" | tail -12
      ;;
    quant-kernels-sweep)
      # As quant-kernels at M = 1, plus a search over launch configs (to tune default_config
      # in octavo/kernels/triton/{fp8,int4}_gemv.py; ~6 min).
      python3 benchmarks/gpu/bench_quant_gemv.py --rows 1 --sweep \
        2>"$OUT/quant-kernels-sweep.err" | tee "$OUT/quant-kernels-sweep.log" | tail -20
      ;;
    quant-configs)
      # The skinny kernels' config table for this GPU (octavo.kernels.triton.skinny_gemm):
      # the sweep's best config per Llama-3-8B projection and row bucket in $ROWS (default 1;
      # kernels in $SWEEP_KERNELS, default fp8,int4; each call timed after an RMS norm, as in
      # a decode step, so that loads issued before the PDL wait count; fp8 at one row also
      # each config with the late trigger and tiles summed over runs, ~6 min alone;
      # ~5 min per new row bucket's compiles), added to the repo's table, written to $OUT.
      # SWEEP_ARGS: more arguments, e.g. --candidates-only (the tuner's candidates alone).
      table=$(python3 -c "import torch; from octavo.kernels.triton.skinny_gemm import \
config_table_path; print(config_table_path(torch.cuda.get_device_name()))")
      cp "$table" "$OUT/" 2>/dev/null || true
      OCTAVO_SKINNY_CONFIG_TABLES=0 python3 benchmarks/gpu/bench_quant_gemv.py \
        --rows "${ROWS:-1}" --shapes qkv,o,gate_up,down --sweep --after-norm \
        --sweep-kernels "${SWEEP_KERNELS:-fp8,int4}" ${SWEEP_ARGS:-} \
        --write-configs "$OUT/$(basename "$table")" \
        2>"$OUT/quant-configs.err" | tee "$OUT/quant-configs.log" | tail -12
      ;;
    int4-mma)
      # The CUDA backend's tensor-core int4 GEMV (octavo_cuda.int4_mma, #17, on by default):
      # its tests against the reference, the gptq models end to end through it, batch-1 8B
      # int4 with it on and off (bf16 in the same lease), then each 8B projection against
      # int4_gemv after a norm, the best configs written to $OUT's copy of the config table
      # (~8 min; ROWS=1,2,4,8 for every row bucket of the table).
      python3 -m pytest -q -p no:cacheprovider -m gpu backends/cuda/tests/test_cuda_int4_mma.py \
        backends/cuda/tests/test_cuda_quantization.py -k "int4_mma or gptq" \
        > "$OUT/int4-mma-tests.log" 2>&1; tail -1 "$OUT/int4-mma-tests.log"
      grep -E "^(E |FAILED)" "$OUT/int4-mma-tests.log" | head -12
      AB_ENV=OCTAVO_CUDA_INT4_MMA AB_VALUES="1 0" AB_MODELS="8b 8b-int4" bash "$0" latency-ab
      table=$(python3 -c "import torch; from octavo.kernels.triton.skinny_gemm import \
config_table_path; print(config_table_path(torch.cuda.get_device_name()))")
      cp "$table" "$OUT/" 2>/dev/null || true
      python3 benchmarks/gpu/bench_int4_mma.py --rows "${ROWS:-1,8}" \
        --write-configs "$OUT/$(basename "$table")" 2>"$OUT/int4-mma-bench.err" \
        | tee "$OUT/int4-mma-bench.log" | grep -v '^{'
      ;;
    int4-chain)
      # The tensor-core int4 GEMV's GPU tests (late trigger, the norm inside), then its one-row
      # configs picked inside a layer-like chain (bench_int4_mma.py --chain: 32 layer copies,
      # every kernel under PDL as in the model, one projection's config changed at a time from
      # the device table's; then the chain with both norms inside their GEMVs), written to a
      # copy of the table in $OUT/chain-tables; when they differ, batch-1 8B int4 with that
      # copy against the packaged tables, in turns (OCTAVO_SKINNY_CONFIG_DIR); then batch-1
      # 8B int4 with OCTAVO_CUDA_INT4_NORM=1 and 0, in turns (~8 min).
      python3 -m pytest -q -p no:cacheprovider -m gpu backends/cuda/tests/test_cuda_int4_mma.py \
        > "$OUT/int4-chain-tests.log" 2>&1; tail -1 "$OUT/int4-chain-tests.log"
      grep -E "^(E |FAILED)" "$OUT/int4-chain-tests.log" | head -12
      table=$(python3 -c "import torch; from octavo.kernels.triton.skinny_gemm import \
config_table_path; print(config_table_path(torch.cuda.get_device_name()))")
      mkdir -p "$OUT/chain-tables" && cp "$table" "$OUT/chain-tables/"
      python3 benchmarks/gpu/bench_int4_mma.py --chain \
        --write-configs "$OUT/chain-tables/$(basename "$table")" 2>"$OUT/int4-chain.err" \
        | tee "$OUT/int4-chain.log" | tail -1
      if ! cmp -s "$table" "$OUT/chain-tables/$(basename "$table")"; then
        AB_ENV=OCTAVO_SKINNY_CONFIG_DIR AB_VALUES="$OUT/chain-tables $(dirname "$table")" \
          AB_MODELS=8b-int4 bash "$0" latency-ab
      fi
      # the norms before qkv and gate_up inside the int4 GEMV, in the model
      AB_ENV=OCTAVO_CUDA_INT4_NORM AB_VALUES="1 0" AB_MODELS=8b-int4 bash "$0" latency-ab
      ;;
    quant-latency)
      # Batch-1 ms per output token, Llama-3-8B shape (dummy weights), bf16 vs fp8 weights
      # vs int4 GPTQ: at batch 1 both run the small-M Triton kernels (fp8_gemv, int4_gemv;
      # tuned once per shape at start-up, before the CUDA graphs are captured); ~4 min.
      make_l8b
      for variant in "bf16 $L8B" "fp8 $L8B --quantization fp8" "int4 $L8B_GPTQ"; do
        set -- $variant; name=$1; model=$2; shift 2
        echo "== $name"
        octavo bench latency --model $model --load-format dummy --dtype bfloat16 \
          --input-len 128 --output-len 256 --num-iters 3 --max-model-len 4096 "$@" \
          2>"$OUT/quant-latency-$name.err" | tee "$OUT/quant-latency-$name.log" | tail -2
        grep -h "max concurrency" "$OUT/quant-latency-$name.err" | tail -1
      done
      ;;
    lora-tests)
      # Multi-LoRA on CUDA: a mixed-adapter batch against transformers+PEFT, the Triton
      # shrink/expand kernels against torch at Llama-3-8B shapes (~2 min).
      python3 -m pytest -q -p no:cacheprovider -m gpu backends/cuda/tests/test_cuda_lora.py \
        tests/kernels/test_triton_lora.py 2>&1 | tee "$OUT/lora-tests.log" | tail -15
      ;;
    bench-lora|bench-lora-q05|bench-lora-l8b)
      # W1 through LLM.generate without adapters, then with 4 rank-16 adapters round-robin
      # (Qwen2.5-0.5B shape, ~3 min, then Llama-3-8B shape with dummy weights, ~7 min);
      # output tok/s. bench-lora-q05 / bench-lora-l8b run one shape each.
      if [ "$stage" != bench-lora-l8b ]; then
        [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
        python3 benchmarks/gpu/bench_lora.py --model $MODEL 2>"$OUT/bench-lora-q05.err" \
          | tee "$OUT/bench-lora-q05.log"
      fi
      if [ "$stage" != bench-lora-q05 ]; then
        make_l8b
        python3 benchmarks/gpu/bench_lora.py --model $L8B --load-format dummy \
          2>"$OUT/bench-lora-l8b.err" | tee "$OUT/bench-lora-l8b.log"
      fi
      ;;
    quant-w1)
      # W1 (256 requests, 100-1024 in/out tokens) through LLM.generate, Llama-3-8B shape
      # (dummy weights): bf16, fp8 weights, fp8 weights + fp8 KV cache; ~8 min.
      make_l8b
      for variant in "bf16" "fp8 --quantization fp8" \
                     "fp8-kvfp8 --quantization fp8 --kv-cache-dtype fp8"; do
        set -- $variant; name=$1; shift
        echo "== $name"
        octavo bench throughput --model $L8B --load-format dummy --dtype bfloat16 \
          --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
          --max-num-seqs 256 "$@" 2>"$OUT/quant-w1-$name.err" | tee "$OUT/quant-w1-$name.log" \
          | tail -2
        grep -h "max concurrency" "$OUT/quant-w1-$name.err" | tail -1
      done
      ;;
    quant-w1-kv)
      # As quant-w1, bf16 weights with the fp8 KV cache alone (~3 min).
      make_l8b
      octavo bench throughput --model $L8B --load-format dummy --dtype bfloat16 \
        --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
        --max-num-seqs 256 --kv-cache-dtype fp8 2>"$OUT/quant-w1-kvfp8.err" \
        | tee "$OUT/quant-w1-kvfp8.log" | tail -2
      grep -h "max concurrency" "$OUT/quant-w1-kvfp8.err" | tail -1
      ;;
    bench-serve)
      # 500 requests at once, 512 in / 128 out, EOS ignored, over HTTP (`octavo serve` +
      # `octavo bench serve`), then the same token ids through AsyncLLM in-process
      # (`bench throughput --async-engine`, same seed and lengths), same engine flags; the
      # ratio is HTTP output tok/s / in-process output tok/s. The client runs in
      # $CLIENT_PROCS processes (default 4) so that it is not the limit. ~3 min.
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      PORT=8011
      octavo serve $MODEL --dtype bfloat16 --max-num-seqs 256 --port $PORT \
        >"$OUT/bench-serve-server.log" 2>&1 &
      SERVER_PID=$!
      if wait_health $SERVER_PID $PORT; then
        # The client's own CPU time: user + sys close to wall means the client, not the
        # server, was the limit.
        TIMEFORMAT="bench serve client: %R s wall, %U s user, %S s sys"
        time octavo bench serve --port $PORT --model $MODEL --num-prompts 500 --input-len 512 \
          --output-len 128 --ignore-eos --seed 0 --disable-tqdm \
          --num-client-processes ${CLIENT_PROCS:-4} \
          2>"$OUT/bench-serve.err" | tee "$OUT/bench-serve.log"
        tail -3 "$OUT/bench-serve.err"
      else
        tail -20 "$OUT/bench-serve-server.log"
      fi
      kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID
      echo "server exited with $?"
      octavo bench throughput --model $MODEL --dtype bfloat16 --num-prompts 500 \
        --input-len 512 --output-len 128 --workload-seed 0 --max-num-seqs 256 --async-engine \
        2>"$OUT/bench-serve-inproc.err" | tee "$OUT/bench-serve-inproc.log"
      tail -3 "$OUT/bench-serve-inproc.err"
      python3 - "$OUT/bench-serve.log" "$OUT/bench-serve-inproc.log" <<'PY'
import json, sys
def last_json(path):
    lines = [l for l in open(path) if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None
http, inproc = last_json(sys.argv[1]), last_json(sys.argv[2])
if http is None or inproc is None:
    sys.exit("bench-serve: a run printed no result")
h, a = http["output_throughput"], inproc["output_tokens_per_s"]
print(f"bench-serve: HTTP {h:,.0f} output tok/s ({http['completed']} requests, "
      f"{http['total_output_tokens']:,} tokens, TTFT p99 {http['p99_ttft_ms']:.0f} ms, "
      f"TPOT median {http['median_tpot_ms']:.1f} ms) vs AsyncLLM in-process {a:,.0f} "
      f"({inproc['output_tokens']:,} tokens): HTTP / in-process = {h / a:.2f}")
PY
      ;;
    bench-serve-multi)
      # bench-serve's workload over HTTP with `--api-server-count` 1, 2 and 4 (override with
      # API_SERVER_COUNTS="1 2 4 8"; a count may repeat), each run followed by the same
      # requests through AsyncLLM in-process; one line per run with HTTP / the in-process run
      # next to it (both move between runs on this host). Also the API processes' CPU seconds
      # (user + sys, from /proc, read just before SIGTERM) per output token. ~2 min per run.
      # SERVE_ARGS adds server options (e.g. SERVE_ARGS="--stream-interval 4").
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      PORT=8012
      RUN=0
      for COUNT in ${API_SERVER_COUNTS:-1 2 4}; do
        RUN=$((RUN + 1)); TAG="run$RUN-$COUNT"
        octavo serve $MODEL --dtype bfloat16 --max-num-seqs 256 --port $PORT \
          --api-server-count $COUNT ${SERVE_ARGS:-} >"$OUT/bench-serve-multi-$TAG-server.log" 2>&1 &
        SERVER_PID=$!
        if wait_health $SERVER_PID $PORT; then
          # Warm-up (first-use compilation, CUDA graphs), not counted.
          octavo bench serve --port $PORT --model $MODEL --num-prompts 64 --input-len 512 \
            --output-len 32 --ignore-eos --seed 1 --disable-tqdm >/dev/null 2>&1
          API_PIDS=$(python3 - $SERVER_PID $COUNT <<'PY'
import os, sys
# The API processes: with one, the server itself; with several, its spawned children but the
# engine core (the first spawned, lowest pid).
root, count = int(sys.argv[1]), int(sys.argv[2])
if count == 1:
    print(root); sys.exit()
kids = []
for e in os.listdir("/proc"):
    if e.isdigit():
        try:
            stat = open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{e}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat[1]) == root and b"spawn_main" in cmd:
            kids.append(int(e))
print(" ".join(map(str, sorted(kids)[1:])))
PY
)
          cpu() { python3 -c "
import os, sys
tck = os.sysconf('SC_CLK_TCK'); total = 0
for pid in sys.argv[1:]:
    f = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split(); total += int(f[11]) + int(f[12])
print(total / tck)" $API_PIDS; }
          CPU0=$(cpu)
          octavo bench serve --port $PORT --model $MODEL --num-prompts 500 --input-len 512 \
            --output-len 128 --ignore-eos --seed 0 --disable-tqdm \
            --num-client-processes ${CLIENT_PROCS:-4} \
            2>"$OUT/bench-serve-multi-$TAG.err" | tee "$OUT/bench-serve-multi-$TAG.log"
          CPU1=$(cpu)
          echo "api-server-count $COUNT: API processes ($API_PIDS) CPU $CPU0 -> $CPU1 s" \
            | tee -a "$OUT/bench-serve-multi-$TAG.log"
          tail -3 "$OUT/bench-serve-multi-$TAG.err"
        else
          tail -20 "$OUT/bench-serve-multi-$TAG-server.log"
        fi
        kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID
        echo "api-server-count $COUNT: server exited with $? (0 expected)"
        # Nothing may be left behind: no process of the server, the port free again.
        pgrep -f "spawn_main" >/dev/null && echo "LEFT BEHIND: $(pgrep -af spawn_main)"
        octavo bench throughput --model $MODEL --dtype bfloat16 --num-prompts 500 \
          --input-len 512 --output-len 128 --workload-seed 0 --max-num-seqs 256 --async-engine \
          2>"$OUT/bench-serve-multi-$TAG-inproc.err" | tee "$OUT/bench-serve-multi-$TAG-inproc.log"
        tail -3 "$OUT/bench-serve-multi-$TAG-inproc.err"
      done
      python3 - "$OUT" ${API_SERVER_COUNTS:-1 2 4} <<'PY'
import json, re, sys
out, counts = sys.argv[1], sys.argv[2:]
def last_json(path):
    try:
        lines = [l for l in open(path) if l.startswith("{")]
    except OSError:
        return None
    return json.loads(lines[-1]) if lines else None
for run, count in enumerate(counts, 1):
    tag = f"run{run}-{count}"
    inproc = last_json(f"{out}/bench-serve-multi-{tag}-inproc.log")
    http = last_json(f"{out}/bench-serve-multi-{tag}.log")
    if http is None or inproc is None:
        print(f"  run {run}, --api-server-count {count}: no result"); continue
    a = inproc["output_tokens_per_s"]
    cpu = re.findall(r"CPU ([0-9.]+) -> ([0-9.]+) s", open(f"{out}/bench-serve-multi-{tag}.log").read())
    per_token = ""
    if cpu:
        used = float(cpu[-1][1]) - float(cpu[-1][0])
        per_token = f", API CPU {used:.1f} s = {1e6 * used / http['total_output_tokens']:.0f} us/token"
    h = http["output_throughput"]
    print(f"  run {run}, --api-server-count {count}: HTTP {h:,.0f} output tok/s "
          f"({http['completed']} requests, TTFT p99 {http['p99_ttft_ms']:.0f} ms, TPOT median "
          f"{http['median_tpot_ms']:.1f} ms{per_token}); in-process right after {a:,.0f}: "
          f"HTTP / in-process = {h / a:.2f}")
PY
      ;;
    spec-tests)
      # Speculative decoding (ngram, draft model, EAGLE-1, EAGLE-3) on CUDA: greedy equality with
      # and without, graphs on/off.
      python3 -m pytest -q -p no:cacheprovider -m gpu backends/cuda/tests/test_cuda_spec_decode.py \
        backends/cuda/tests/test_cuda_spec_decode_eagle.py \
        backends/cuda/tests/test_cuda_spec_decode_eagle3.py \
        2>&1 | tee "$OUT/spec-tests.log" | tail -15
      ;;
    bench-spec)
      # ngram speculation at batch 1 on a repetitive prompt (a 64-token block x 4), greedy, 256
      # output tokens, K = 4: Llama-3-8B shape (dummy bf16 weights) and Qwen2.5-0.5B random.
      make_l8b
      python3 benchmarks/gpu/bench_spec_decode.py --model $L8B --load-format dummy \
        --dtype bfloat16 --device cuda --num-speculative-tokens 4 --output-len 256 \
        2>"$OUT/bench-spec-l8b.err" | tee "$OUT/bench-spec-l8b.log"
      [ -d $MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out $MODEL
      python3 benchmarks/gpu/bench_spec_decode.py --model $MODEL --dtype bfloat16 --device cuda \
        --num-speculative-tokens 4 --output-len 256 \
        2>"$OUT/bench-spec-q05.err" | tee "$OUT/bench-spec-q05.log"
      tail -3 "$OUT/bench-spec-l8b.err" "$OUT/bench-spec-q05.err"
      ;;
    bench-spec-eagle3)
      # eagle3 speculation at batch 1, greedy, 256 output tokens, K = 4: Llama-3-8B shape target
      # with an EAGLE-3 head of EAGLE3-LLaMA3.1-Instruct-8B's shape (one layer, a 32,000-token
      # draft vocabulary; both dummy bf16 weights: acceptance near zero, so this measures what
      # the head and the target's three auxiliary hidden states cost per step).
      make_l8b
      E3=/tmp/eagle3-llama3-8b-config
      [ -d $E3 ] || python3 - $L8B $E3 <<'PY' || exit 1
import json, pathlib, sys
config = json.loads((pathlib.Path(sys.argv[1]) / "config.json").read_text())
config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
              draft_vocab_size=32000)
out = pathlib.Path(sys.argv[2])
out.mkdir(parents=True)
(out / "config.json").write_text(json.dumps(config, indent=2))
PY
      python3 benchmarks/gpu/bench_spec_decode.py --model $L8B --load-format dummy \
        --dtype bfloat16 --device cuda --num-speculative-tokens 4 --output-len 256 \
        --eagle3-head $E3 2>"$OUT/bench-spec-eagle3.err" | tee "$OUT/bench-spec-eagle3.log"
      tail -3 "$OUT/bench-spec-eagle3.err"
      ;;
    bench-spec-draft)
      # draft_model speculation at batch 1, greedy, 256 output tokens, K = 4: Llama-3-8B shape
      # target with a Llama-3.2-1B shape draft (both dummy bf16 weights: acceptance near zero,
      # so this measures what the draft costs), then the target as its own draft (every draft
      # accepted: the machinery at full acceptance).
      make_l8b
      [ -d $L1B ] || python3 benchmarks/gpu/make_random_model.py --shape llama3.2-1b \
        --config-only --out $L1B || exit 1
      python3 benchmarks/gpu/bench_spec_decode.py --model $L8B --load-format dummy \
        --dtype bfloat16 --device cuda --num-speculative-tokens 4 --output-len 256 \
        --draft-model $L1B 2>"$OUT/bench-spec-draft-1b.err" | tee "$OUT/bench-spec-draft-1b.log"
      python3 benchmarks/gpu/bench_spec_decode.py --model $L8B --load-format dummy \
        --dtype bfloat16 --device cuda --num-speculative-tokens 4 --output-len 256 \
        --num-gpu-blocks-override 1024 --draft-model $L8B \
        2>"$OUT/bench-spec-draft-self.err" | tee "$OUT/bench-spec-draft-self.log"
      tail -3 "$OUT/bench-spec-draft-1b.err" "$OUT/bench-spec-draft-self.err"
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
