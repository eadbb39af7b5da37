#!/usr/bin/env bash
# Runs named layouts (benchmarks/layouts.toml) one after another with nvidia-smi sampled during
# each, and packs every run's JSON, log and GPU samples into $OUT/e2e_sweep.tgz.
#   LAYOUTS      layouts to run (default: the ones benchmarks/README.md cites)
#   EXTRA        chorus bench flags for every run, e.g. EXTRA="--duration 30 --concurrency 256"
#   RUN_TIMEOUT  seconds a run may take (default 420)
FINAL=${OUT:-/tmp/out}
OUT=$(mktemp -d)  # everything is packed into one archive: the device tool returns few files
python -m chorus.bench.worker --batches 1 --contexts 32 --steps 2 > /dev/null 2>&1  # flashinfer JIT warm-up
for name in ${LAYOUTS:-w1-1gpu w1-1gpu-c256 w1-2gpu w1-2gpu-high-load w2-radix w2-no-radix}; do
  echo "=== $name $EXTRA"
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader,nounits -lms 200 \
    > "$OUT/$name.gpu.csv" 2>/dev/null &
  smi=$!
  # SIGINT first: chorus bench stops its services and writes what it measured.
  timeout -s INT -k 60 "${RUN_TIMEOUT:-420}" python -m chorus.cli bench --layout "$name" --no-progress $EXTRA \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$?"; kill $smi 2>/dev/null
  grep -E " (c|r)=[0-9]|server CPU" "$OUT/$name.log"; grep -iE "error|traceback" "$OUT/$name.log" | head -5
  [ -f "$OUT/$name.json" ] && python -m chorus.bench.gpu_busy "$OUT/$name.gpu.csv" "$OUT/$name.json"
  # A bench killed outright leaves its services (process groups of their own): stop them before the next run.
  pkill -9 -f "gpu_worker.server|vocoder_svc.server|vocoder_svc.decode_process|scheduler_svc.server" 2>/dev/null
  tar -czf "$FINAL/e2e_sweep.tgz" -C "$OUT" .  # after every run: a call cut short keeps what finished
done
