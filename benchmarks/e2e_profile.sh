#!/usr/bin/env bash
# Where the time goes at c256 end to end (nvidia-h200-x2): runs W1 at c256 as e2e_sweep.sh
# does and, in the middle of the measured level, samples the worker, the scheduler core and
# one scheduler frontend with py-spy (raw stacks, all threads) and reads each process's
# per-thread CPU. Needs py-spy (in the .gpu bundle: pip download py-spy into .gpu/).
# Results in $OUT/e2e_profile.tgz.
FINAL=${OUT:-/tmp/out}
OUT=$(mktemp -d)
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
threads() {  # pid -> "tid name utime+stime" per thread
  for t in /proc/$1/task/*; do echo "$(basename $t) $(cat $t/comm | tr ' ' _) $(awk '{print $14+$15}' $t/stat)"; done
}
python -m chorus.cli bench --launch --device cuda:0 --vocoder-device cuda:1 --dtype bfloat16 \
  --worker-arg=--preset=full --worker-arg=--max-batch=256 --worker-arg=--kv-slots=150000 \
  --vocoder-arg=--preset=full --vocoder-arg=--slots=256 --scheduler-arg=--frontends=${FRONTENDS:-4} \
  --channels 32 --workload W1 --concurrency 256 --duration ${DUR:-40} --warmup 5 --no-progress \
  --out "$OUT/e2e_profile_bench.json" > "$OUT/bench.log" 2>&1 &
bench=$!
until grep -q "latencies in ms" "$OUT/bench.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 2; done  # table header
sleep 15
worker=$(pgrep -f "gpu_worker.server" | head -1)
core=$(pgrep -f "scheduler_svc.server" -a | grep -v -- "--core" | grep -v bench | awk '{print $1}' | head -1)
front=$(pgrep -f "scheduler_svc.server.*--core" | head -1)
echo "worker $worker core $core frontend $front" | tee "$OUT/pids.txt"
for p in $worker $core $front; do threads $p > "$OUT/threads_${p}_0.txt"; done
spies=()
for p in $worker $core $front; do
  "$SPY" record -p $p -d 10 -r 250 -f raw -o "$OUT/spy_$p.txt" --nonblocking > "$OUT/spy_$p.log" 2>&1 &
  spies+=($!)
done
wait "${spies[@]}"
for p in $worker $core $front; do threads $p > "$OUT/threads_${p}_1.txt"; done
wait $bench
tail -5 "$OUT/bench.log"
tar -czf "$FINAL/e2e_profile.tgz" -C "$OUT" .
