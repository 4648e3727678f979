#!/bin/sh
# SmolLM2-135M-Instruct on this CPU: spectrio (no speculation, the shipped MTP head at
# k = 1 and 3 and adaptive, n-gram lookup) against llama.cpp on the same GGUF file,
# alternated round by round. Each round also runs one short completion of each under
# /usr/bin/time for its peak RSS.
#
#   LLAMA_BIN=<llama.cpp build/bin> FILE=<smollm2 .gguf> OUT=<folder> [K="0 auto"] \
#     sh benchmarks/smollm2_vs_llamacpp.sh [ROUNDS]
#
# K: spectrio's cases (default: no speculation, the head at k = 1 and 3, adaptive, n-gram).
#
# FILE is any SmolLM2 GGUF file: the shipped Q4_1 one, or one llama.cpp made from it:
#   llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf smollm2-q8_0.gguf Q8_0
# (Q4_K_M, F32 likewise). spectrio serves a quantized file from its blocks
# (docs/models.md) and an F32 one from float32 panels.
# Never a dependency: build llama.cpp in a scratch folder (cmake -DCMAKE_BUILD_TYPE=Release
# -DGGML_NATIVE=ON; targets llama-bench llama-batched-bench llama-quantize llama-cli).
set -eu
ROUNDS=${1:-2}
THREADS=${THREADS:-2}
K=${K:-0 1 3 auto ngram:3}
: "${LLAMA_BIN:?set LLAMA_BIN}" "${FILE:?set FILE}" "${OUT:?set OUT}"
mkdir -p "$OUT"
PROMPT="Why is the sky blue?"
i=1
while [ "$i" -le "$ROUNDS" ]; do
  "$LLAMA_BIN/llama-bench" -m "$FILE" -t "$THREADS" -p 0 -n 128 -r 3 -o json \
    > "$OUT/llama_bench_$i.json" 2> "$OUT/llama_bench_$i.err"
  "$LLAMA_BIN/llama-batched-bench" -m "$FILE" -t "$THREADS" -c 4096 -b 2048 -ub 512 \
    -npp 48 -ntg 128 -npl 1,16 --output-format jsonl \
    > "$OUT/llama_batched_$i.jsonl" 2> "$OUT/llama_batched_$i.err"
  # shellcheck disable=SC2086
  spectrio bench --model "$FILE" --batch 1 16 --k $K \
    --max-tokens 128 --prompt-tokens 48 --min-requests 3 --interleave 2 --progress off \
    --json "$OUT/spectrio_$i.json" > "$OUT/spectrio_$i.txt" 2> "$OUT/spectrio_$i.err"
  /usr/bin/time -v "$LLAMA_BIN/llama-cli" -m "$FILE" -t "$THREADS" -p "$PROMPT" -n 32 \
    --temp 0 -st < /dev/null > "$OUT/llama_cli_$i.txt" 2> "$OUT/llama_cli_$i.err" || true
  /usr/bin/time -v spectrio generate --model "$FILE" --chat "$PROMPT" --max-tokens 32 \
    > "$OUT/spectrio_generate_$i.txt" 2> "$OUT/spectrio_generate_$i.err"
  i=$((i + 1))
done
grep -H "Maximum resident" "$OUT"/llama_cli_*.err "$OUT"/spectrio_generate_*.err
echo "results in $OUT"
