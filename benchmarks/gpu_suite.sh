#!/bin/bash
# The GPU path's benchmarks of issue 9 in one device call (H200, ~8 minutes): the seed workload offline
# (penalties off, then all four on), served, the generated shared prefix, decode step times, and the HF
# generate_batch peer on a fixed-length workload with sglbus on the same one. Usage:
#   bash benchmarks/gpu_suite.sh <config-only model folder> <output folder>
# Needs the carried wheels installed (see ../shared/GPU_RUNS.md); prints SGLang's result lines.
set -u
M=${1:?model folder}; OUT=${2:?output folder}
SEED="--dataset-name random --num-prompts 3000 --random-input 256 --random-output 512 --random-range-ratio 0.0"
PEN='{"frequency_penalty": 1.1, "presence_penalty": 1.1, "repetition_penalty": 0.1, "min_new_tokens": 5}'
DUMMY="--model-path $M --load-format dummy"
pick() { grep -E "Backend|duration|Output token|overhead|hit rate|ratio"; }
echo "== offline, penalties off";  timeout 150 python3 -m benchmarks.offline $DUMMY $SEED --output-file "$OUT/offline.jsonl" 2>&1 | pick
echo "== offline, four penalties"; timeout 150 python3 -m benchmarks.offline $DUMMY $SEED --extra-sampling-params "$PEN" --output-file "$OUT/offline.jsonl" 2>&1 | pick
echo "== offline, no overlap";     timeout 150 python3 -m benchmarks.offline $DUMMY $SEED --disable-overlap-schedule --output-file "$OUT/offline.jsonl" 2>&1 | pick
echo "== served"
timeout 200 python3 -m benchmarks.serving --backend sglbus --launch-server --server-args "$DUMMY" $SEED --disable-tqdm --output-file "$OUT/serving.jsonl" 2>&1 | grep -v Warning | tail -30
echo "== shared prefix"
timeout 100 python3 -m benchmarks.offline $DUMMY --dataset-name shared-prefix --num-groups 8 --num-prompts 512 --shared-prefix-len 1024 --question-len 64 --output-len 128 --output-file "$OUT/offline.jsonl" 2>&1 | pick
echo "== decode step times"
timeout 150 python3 -m benchmarks.step_time $DUMMY --batch-sizes 1 64 256 1024 --cuda-graph-max-bs 1024 2>&1 | grep -v Warning | tail -6
echo "== HF generate_batch peer and sglbus, 200 prompts of 256 in, 256 out"
timeout 200 python3 -m benchmarks.hf_generate_batch --model-path "$M" --num-prompts 200 --input-len 256 --output-len 256 2>&1 | tail -1
timeout 100 python3 -m benchmarks.offline $DUMMY --dataset-name random --num-prompts 200 --random-input 256 --random-output 256 --random-range-ratio 1.0 2>&1 | pick
