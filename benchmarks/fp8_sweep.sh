#!/usr/bin/env bash
# FP8 backbone weights on one GPU: agreement with bf16 (hidden states, frames, the determinism
# promise) and the decode step at batch 64 and 256, context 300, in bf16 and FP8 beside their
# byte floors, all written under $OUT.
set -x
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m chorus.bench.worker --batches 1 --contexts 32 --steps 2 > /dev/null 2>&1  # flashinfer JIT warm-up
python -m chorus.bench.fp8_agreement --out "$OUT/fp8_agreement.json" > "$OUT/fp8_agreement.log" 2>&1
tail -40 "$OUT/fp8_agreement.log"
for q in none fp8; do
  python -m chorus.bench.worker --quantization "$q" --batches "${BATCHES:-64,256}" --contexts 300 \
    --out "$OUT/worker_bench_$q.json" 2>&1 | tee "$OUT/worker_bench_$q.log" | grep -vE "^(capturing|warm)"
done
