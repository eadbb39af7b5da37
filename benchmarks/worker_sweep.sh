#!/usr/bin/env bash
# Worker on one GPU: kernel checks, parity checks, the `chorus bench worker` sweep and decode step
# profiles (PROFILE_BATCHES, default "1 256"), all written under $OUT.
set -x
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m chorus.bench.worker --batches 1 --contexts 32 --steps 2 > /dev/null 2>&1  # flashinfer JIT warm-up
python -m chorus.bench.kernel_checks --quick --out "$OUT/kernel_checks.json" > "$OUT/kernel_checks.log" 2>&1
tail -25 "$OUT/kernel_checks.log"
python -m chorus.bench.gpu_checks --out "$OUT/gpu_checks.json" > "$OUT/gpu_checks.log" 2>&1
tail -15 "$OUT/gpu_checks.log"
python -m chorus.cli bench worker --out "$OUT/worker_bench.json" 2>&1 | tee "$OUT/worker_bench.log"
for b in ${PROFILE_BATCHES:-1 256}; do
  python -m chorus.bench.profile_step --batch "$b" --context 300 --out "$OUT/profile_step_bs${b}.json" \
    > "$OUT/profile_bs${b}.log" 2>&1
  python - "$OUT/profile_step_bs${b}.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items() if not k.startswith("top_kernels")})
for name, us, n in d["top_kernels_by_time_us"][:15]:
    print(f"{us:9.1f} us {n:5d}x {name}")
PY
done
