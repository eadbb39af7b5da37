#!/usr/bin/env bash
# A sweep longer than one device call: the stages run in the background on the device machine
# (a process session of their own outlives the call that started it), and each call collects what
# has finished. The machine stays warm only ~30 s after a call, so make the next call at once.
#
#   start:   (setsid bash benchmarks/background_sweep.sh start STAGES </dev/null >/tmp/sweep.log 2>&1 &)
#   collect: bash benchmarks/background_sweep.sh collect SECONDS
#
# STAGES: a file of lines "NAME COMMAND ...", run in order from the repository root with OUT set to
# /tmp/sweep/NAME (e2e_sweep.sh packs its runs there). A stage whose folder exists is skipped: to
# run one again after a failure, remove its folder and start again. `collect` waits until every
# stage has run or SECONDS have passed, prints the progress and each stage's result lines, and
# packs /tmp/sweep into $OUT/sweep.tgz.
set -u
R=/tmp/sweep
case "${1:-}" in
  start)
    mkdir -p "$R"; rm -f "$R/done"
    export PYTHONUNBUFFERED=1
    while read -r name command; do
      [ -z "$name" ] || [ "${name#\#}" != "$name" ] || [ -d "$R/$name" ] && continue
      mkdir -p "$R/$name"
      echo "=== $(date +%T) start $name" >> "$R/progress"
      OUT="$R/$name" bash -c "$command" > "$R/$name/stage.log" 2>&1
      rc=$?
      echo "=== $(date +%T) end $name rc=$rc" >> "$R/progress"
    done < "$2"
    touch "$R/done";;
  collect)
    end=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $end ] && [ ! -f "$R/done" ]; do sleep 5; done
    cat "$R/progress" 2>/dev/null
    for d in "$R"/*/; do
      [ -d "$d" ] || continue
      echo "--- $(basename "$d")"
      grep -E " (c|r)=[0-9]|^rc=|x_floor|ratio|Error|Traceback" "$d/stage.log" | head -30
    done
    tar -czf "$OUT/sweep.tgz" -C "$R" .;;
  *)
    sed -n '2,14p' "$0"; exit 2;;
esac
