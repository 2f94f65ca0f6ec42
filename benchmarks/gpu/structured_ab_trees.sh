#!/usr/bin/env bash
# bench-structured's command (W1, every request JSON-constrained, then unconstrained) over
# several source trees in turn, one fresh process a run, each run after host_probe.py:
#   bash benchmarks/gpu/structured_ab_trees.sh NAME=DIR [NAME=DIR ...]
# DIR holds core/ and backends/ of one revision (here: `.`, or one made on the workstation
# with `git archive REV core backends | tar -x -C .ab/REV` and carried to the device); each
# run installs its tree's core and CUDA backend editable first, and `.` is installed again
# at the end. AB_ORDER (default: the names given, twice) sets the order, e.g. "new old new
# old"; AB_ARGS adds arguments to every run (e.g. "--distributed-executor-backend mp").
# Needs run_h100.sh's setup; logs go to $OUT/ab-trees-NAME.err.
set -uo pipefail
OUT=${OUT:-/tmp/octavo-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
JSON_MODEL=/tmp/qwen2.5-0.5b-smollm2-vocab
[ -d $JSON_MODEL ] || python3 benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b \
  --tokenizer .bench-assets/smollm2-tokenizer --out $JSON_MODEL || exit 1
declare -A tree_of=()
names=()
for arg in "$@"; do
  tree_of[${arg%%=*}]=${arg#*=}
  names+=("${arg%%=*}")
done
[ ${#names[@]} -gt 0 ] || { echo "usage: $0 NAME=DIR [NAME=DIR ...]" >&2; exit 2; }
install_tree() {
  python3 -m pip install -q --no-deps --no-build-isolation -e "$1/core" -e "$1/backends/cuda"
}
for name in ${AB_ORDER:-${names[*]} ${names[*]}}; do
  dir=${tree_of[$name]:?unknown tree $name}
  install_tree "$dir" || exit 1
  python3 benchmarks/gpu/host_probe.py
  echo "== tree $name ($dir) ${AB_ARGS:-} (at $(date +%s.%N))"
  timeout 150 octavo bench throughput --model $JSON_MODEL --dtype bfloat16 --num-prompts 256 \
    --input-len 100:1024 --output-len 100:1024 --workload-seed 0 \
    --max-num-seqs 256 --async-engine --structured json ${AB_ARGS:-} \
    2>>"$OUT/ab-trees-$name.err" | grep -E "^(json|free|ratio|grammar|engine) "
done
install_tree .
python3 benchmarks/gpu/host_probe.py
