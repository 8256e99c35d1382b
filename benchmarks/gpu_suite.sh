#!/bin/bash
# The GPU path's benchmarks of issue 9, in two device calls of under 10 minutes each (H200):
#   throughput  the seed workload offline (step trace), with all four penalties, sampled (temperature 1,
#               top-p, seeds: the sliced draw's memory at ~2,400 rows), and served
#   extras      the generated shared prefix with and without the cascade kernel, the kernels alone,
#               decode step times, and the HF generate_batch peer next to sglbus on one workload
# Usage: bash benchmarks/gpu_suite.sh <config-only model folder> <output folder> throughput|extras
# Needs the carried wheels installed (see ../shared/GPU_RUNS.md); every log also lands in <output>.
set -u
M=${1:?model folder}; OUT=${2:?output folder}; PART=${3:?throughput or extras}
SEED="--dataset-name random --num-prompts 3000 --random-input 256 --random-output 512 --random-range-ratio 0.0"
PEN='{"frequency_penalty": 1.1, "presence_penalty": 1.1, "repetition_penalty": 0.1, "min_new_tokens": 5}'
SAMPLED='{"temperature": 1.0, "top_p": 0.9, "sampling_seed": 7}'
DUMMY="--model-path $M --load-format dummy"
SHARED="--dataset-name shared-prefix --num-groups 8 --num-prompts 512 --shared-prefix-len 1024 --question-len 64 --output-len 128"
pick() { grep -E "Backend|duration|Output token|hit rate|ratio|Device|steps|^decode|^extend|^step|^total|^host|allocator|KV pool|garbage|longest idle"; }
run() {  # name, timeout, command...: the whole log to $OUT/<name>.log, the figures to stdout
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  pick < "$OUT/$name.log"
}
case $PART in
throughput)
  run offline 120 python3 -m benchmarks.offline $DUMMY $SEED --step-trace --output-file "$OUT/offline.jsonl"
  run penalties 120 python3 -m benchmarks.offline $DUMMY $SEED --extra-sampling-params "$PEN" --step-trace \
    --output-file "$OUT/offline.jsonl"
  run sampled 120 python3 -m benchmarks.offline $DUMMY $SEED --extra-sampling-params "$SAMPLED" --step-trace \
    --output-file "$OUT/offline.jsonl"
  echo "== served"
  # --server-log keeps the server's own log (its batch lines: #running-req, #queue-req); --sample-cpu
  # says which process (scheduler, detokenizer, gateway, client) was busy all the time
  timeout 200 python3 -m benchmarks.serving --backend sglbus --launch-server --server-args "$DUMMY" $SEED \
    --disable-tqdm --sample-cpu --server-log "$OUT/served_server.log" --output-file "$OUT/serving.jsonl" \
    > "$OUT/served.log" 2>&1
  grep -v Warning "$OUT/served.log" | tail -40
  ;;
extras)
  run shared_prefix 80 python3 -m benchmarks.offline $DUMMY $SHARED --step-trace --output-file "$OUT/offline.jsonl"
  run shared_prefix_cascade 80 python3 -m benchmarks.offline $DUMMY $SHARED --enable-cascade-attention \
    --step-trace --output-file "$OUT/offline.jsonl"
  echo "== kernels"; timeout 100 python3 -m benchmarks.kernel_bench > "$OUT/kernels.log" 2>&1; tail -14 "$OUT/kernels.log"
  echo "== decode step times"
  timeout 120 python3 -m benchmarks.step_time $DUMMY --batch-sizes 1 64 256 1024 --cuda-graph-max-bs 1024 \
    > "$OUT/step_time.log" 2>&1; grep -v Warning "$OUT/step_time.log" | tail -6
  echo "== HF generate_batch peer and sglbus, 200 prompts of 256 in, 256 out"
  timeout 120 python3 -m benchmarks.hf_generate_batch --model-path "$M" --num-prompts 200 --input-len 256 \
    --output-len 256 > "$OUT/hf.log" 2>&1; tail -1 "$OUT/hf.log"
  run sglbus_fixed 60 python3 -m benchmarks.offline $DUMMY --dataset-name random --num-prompts 200 \
    --random-input 256 --random-output 256 --random-range-ratio 1.0
  ;;
*) echo "unknown part $PART (throughput or extras)"; exit 2 ;;
esac
