#!/bin/sh
# SmolLM2-135M-Instruct on this CPU: spectrio (no speculation, the shipped MTP head at
# k = 1 and 3 and adaptive, n-gram lookup) against llama.cpp on the same weights in F32,
# alternated round by round.
#
#   LLAMA_BIN=<llama.cpp build/bin> F32=<smollm2-f32.gguf> OUT=<folder> \
#     sh benchmarks/smollm2_vs_llamacpp.sh [ROUNDS]
#
# The F32 file is the Q4_1 file spectrio loads, dequantized by llama.cpp itself:
#   llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf smollm2-f32.gguf F32
# Never a dependency: build llama.cpp in a scratch folder (cmake -DCMAKE_BUILD_TYPE=Release
# -DGGML_NATIVE=ON; targets llama-bench llama-batched-bench llama-quantize).
set -eu
ROUNDS=${1:-2}
THREADS=${THREADS:-2}
: "${LLAMA_BIN:?set LLAMA_BIN}" "${F32:?set F32}" "${OUT:?set OUT}"
mkdir -p "$OUT"
i=1
while [ "$i" -le "$ROUNDS" ]; do
  "$LLAMA_BIN/llama-bench" -m "$F32" -t "$THREADS" -p 0 -n 128 -r 3 -o json \
    > "$OUT/llama_bench_$i.json" 2> "$OUT/llama_bench_$i.err"
  "$LLAMA_BIN/llama-batched-bench" -m "$F32" -t "$THREADS" -c 4096 -b 2048 -ub 512 \
    -npp 48 -ntg 128 -npl 1,16 --output-format jsonl \
    > "$OUT/llama_batched_$i.jsonl" 2> "$OUT/llama_batched_$i.err"
  spectrio bench --model smollm2 --batch 1 16 --k 0 1 3 auto ngram:3 \
    --max-tokens 128 --prompt-tokens 48 --min-requests 3 --interleave 2 --progress off \
    --json "$OUT/spectrio_$i.json" > "$OUT/spectrio_$i.txt" 2> "$OUT/spectrio_$i.err"
  i=$((i + 1))
done
echo "results in $OUT"
