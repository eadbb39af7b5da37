#!/usr/bin/env bash
# Does sharing CPU cores with the other services slow the GPU worker's step loop? Runs a layout at
# three levels of one concurrency against the same launched services: the first with the OS placing
# every thread, the second with the OmniVoice worker's process alone on two physical cores (with
# their hyperthread siblings) and every other process kept off them, the third with the scheduler
# core's process on two more cores of its own. Packed into $OUT/e2e_pinned.tgz with the CPU topology.
#   LAYOUT (default o1-1gpu), C (concurrency, default 1), DUR (seconds a level, default 20),
#   WORKER (pgrep -f pattern of the worker, default its config file omnivoice-worker.pb).
FINAL=${OUT:-/tmp/out}
OUT=$(mktemp -d)
lscpu > "$OUT/lscpu.txt"
# cpu lists: the first two physical cores (siblings included), the next two, and the rest
read -r worker_cpus core_cpus rest_cpus < <(python - <<'PY'
import glob
cores = {}
for d in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*"), key=lambda p: int(p.rsplit("cpu", 1)[1])):
    try:
        sib = open(d + "/topology/thread_siblings_list").read().strip()
    except OSError:
        continue
    cores.setdefault(sib, []).append(int(d.rsplit("cpu", 1)[1]))
groups = list(cores.values())
take = lambda gs: ",".join(str(c) for g in gs for c in g)
if len(groups) < 5:  # too few cores to set any apart: every list is every CPU (a dry run of the steps)
    print(take(groups), take(groups), take(groups))
else:
    print(take(groups[:2]), take(groups[2:4]), take(groups[4:]))
PY
)
echo "worker cpus $worker_cpus, scheduler core cpus $core_cpus, the rest $rest_cpus" | tee "$OUT/pins.txt"
c=${C:-1}
python -m chorus.cli bench --layout "${LAYOUT:-o1-1gpu}" --concurrency "$c,$c,$c" --duration "${DUR:-20}" \
  --no-progress $EXTRA --out "$OUT/e2e_pinned.json" > "$OUT/bench.log" 2>&1 &
bench=$!
wait_for() { until grep -q "$1" "$OUT/bench.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 0.5; done; }
pin_all_but() {  # every process on the machine onto the CPUs left, except the listed pids
  for p in $(ps -e -o pid=); do
    case " $* " in *" $p "*) continue;; esac
    taskset -a -p -c "$1" "$p" > /dev/null 2>&1
  done
}
wait_for "level 2/3"
worker=$(pgrep -f "${WORKER:-omnivoice-worker.pb}" | head -1)
pin_all_but "$core_cpus,$rest_cpus" "$worker"
taskset -a -p -c "$worker_cpus" "$worker" | tail -1 | tee -a "$OUT/pins.txt"
wait_for "level 3/3"
core=$(pgrep -f "scheduler_svc.server" -a | grep -v -- "--core" | grep -v bench | awk '{print $1}' | head -1)
pin_all_but "$rest_cpus" "$worker" "$core"
taskset -a -p -c "$core_cpus" "$core" | tail -1 | tee -a "$OUT/pins.txt"
wait $bench
grep -E " c=[0-9]|first frame" "$OUT/bench.log"
tar -czf "$FINAL/e2e_pinned.tgz" -C "$OUT" .
