#!/usr/bin/env bash
# Where the time goes end to end: runs a layout (default w1-2gpu-high-load, W1 c256) and, SETTLE
# seconds into its measured level, samples every service process with py-spy (raw stacks, all
# threads, 10 s) and reads each one's per-thread CPU before and after. Needs py-spy. Packed into
# $OUT/e2e_profile.tgz with gpu.csv (nvidia-smi every 200 ms); summarise with
# python -m chorus.bench.spy_summary DIR.
#   LAYOUT, DUR (measured seconds, default 40), EXTRA (more chorus bench flags), IDLE=1 (sample
#   threads while they wait too: where a loop blocks, in a lock, a CUDA call or a poll).
FINAL=${OUT:-/tmp/out}
OUT=$(mktemp -d)
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
threads() {  # pid -> "tid name utime+stime" per thread
  for t in /proc/$1/task/*; do echo "$(basename $t) $(cat $t/comm | tr ' ' _) $(awk '{print $14+$15}' $t/stat)"; done
}
python -m chorus.cli bench --layout "${LAYOUT:-w1-2gpu-high-load}" --duration "${DUR:-40}" --no-progress $EXTRA \
  --out "$OUT/e2e_profile_bench.json" > "$OUT/bench.log" 2>&1 &
bench=$!
nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader,nounits -lms 200 > "$OUT/gpu.csv" 2>/dev/null &
smi=$!
until grep -q "latencies in ms" "$OUT/bench.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 2; done  # table header
sleep ${SETTLE:-15}
worker=$(pgrep -f "chorus.colocate|gpu_worker.server" | tr "\n" " ")  # every worker process (an OmniVoice layout has two)
core=$(pgrep -f "scheduler_svc.server" -a | grep -v -- "--core" | grep -v bench | awk '{print $1}' | head -1)
front=$(pgrep -f "scheduler_svc.server.*--core" | head -1)
vocoders=$(pgrep -f "vocoder_svc.server" | tr '\n' ' ')
decoders=$(pgrep -f "vocoder_svc.decode_process" | tr '\n' ' ')
pids="$worker $core $front $vocoders $decoders"
echo "worker $worker core $core frontend $front vocoders $vocoders decoders $decoders" | tee "$OUT/pids.txt"
for p in $pids; do threads $p > "$OUT/threads_${p}_0.txt"; done
spies=()
for p in $pids; do
  "$SPY" record -p $p -d 10 -r 250 -f raw -o "$OUT/spy_$p.txt" --nonblocking ${IDLE:+--idle} > "$OUT/spy_$p.log" 2>&1 &
  spies+=($!)
done
wait "${spies[@]}"
for p in $pids; do threads $p > "$OUT/threads_${p}_1.txt"; done
wait $bench
kill $smi 2>/dev/null
tail -8 "$OUT/bench.log"
tar -czf "$FINAL/e2e_profile.tgz" -C "$OUT" .
