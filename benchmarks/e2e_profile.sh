#!/usr/bin/env bash
# Where the time goes at c256 end to end on two GPUs: runs W1 at c256 as e2e_sweep.sh does and, in
# the middle of the measured level, samples the worker, the scheduler core, one scheduler frontend,
# every vocoder process and every vocoder decode process with py-spy (raw stacks, all threads,
# 10 s) and reads each one's per-thread CPU before and after. Needs py-spy. Results in
# $OUT/e2e_profile.tgz (with gpu.csv: nvidia-smi's GPU busy every 200 ms); summarise with
# python -m chorus.bench.spy_summary.
#   VOCODERS / VOCODER_SLOTS  vocoder replicas on cuda:1 and streams each (default 2 x 128).
#   EXTRA      more chorus bench flags (e.g. EXTRA="--scheduler-arg=--chunk-frames=5 --vocoder-arg=--chunk-frames=5").
FINAL=${OUT:-/tmp/out}
OUT=$(mktemp -d)
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
threads() {  # pid -> "tid name utime+stime" per thread
  for t in /proc/$1/task/*; do echo "$(basename $t) $(cat $t/comm | tr ' ' _) $(awk '{print $14+$15}' $t/stat)"; done
}
python -m chorus.cli bench --launch --device cuda:0 --vocoder-device cuda:1 --dtype bfloat16 \
  --worker-arg=--preset=full --worker-arg=--max-batch=256 --worker-arg=--kv-slots=150000 \
  --vocoder-arg=--preset=full --vocoders ${VOCODERS:-2} --vocoder-arg=--slots=${VOCODER_SLOTS:-128} \
  --scheduler-arg=--frontends=${FRONTENDS:-4} --channels 32 --workload W1 --concurrency 256 \
  --duration ${DUR:-40} --warmup 5 --no-progress $EXTRA \
  --out "$OUT/e2e_profile_bench.json" > "$OUT/bench.log" 2>&1 &
bench=$!
nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader,nounits -lms 200 > "$OUT/gpu.csv" 2>/dev/null &
smi=$!
until grep -q "latencies in ms" "$OUT/bench.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 2; done  # table header
sleep ${SETTLE:-15}
worker=$(pgrep -f "gpu_worker.server" | head -1)
core=$(pgrep -f "scheduler_svc.server" -a | grep -v -- "--core" | grep -v bench | awk '{print $1}' | head -1)
front=$(pgrep -f "scheduler_svc.server.*--core" | head -1)
vocoders=$(pgrep -f "vocoder_svc.server" | tr '\n' ' ')
decoders=$(pgrep -f "vocoder_svc.decode_process" | tr '\n' ' ')
pids="$worker $core $front $vocoders $decoders"
echo "worker $worker core $core frontend $front vocoders $vocoders decoders $decoders" | tee "$OUT/pids.txt"
for p in $pids; do threads $p > "$OUT/threads_${p}_0.txt"; done
spies=()
for p in $pids; do
  "$SPY" record -p $p -d 10 -r 250 -f raw -o "$OUT/spy_$p.txt" --nonblocking > "$OUT/spy_$p.log" 2>&1 &
  spies+=($!)
done
wait "${spies[@]}"
for p in $pids; do threads $p > "$OUT/threads_${p}_1.txt"; done
wait $bench
kill $smi 2>/dev/null
tail -8 "$OUT/bench.log"
tar -czf "$FINAL/e2e_profile.tgz" -C "$OUT" .
