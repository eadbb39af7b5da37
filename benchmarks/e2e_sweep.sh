#!/usr/bin/env bash
# End-to-end runs of `chorus bench --launch`, every level through the real gRPC API, packed into
# $OUT/e2e_sweep.tgz (each run's JSON, log and nvidia-smi samples; see benchmarks/README.md).
# Default: the two-GPU layout (worker cuda:0, vocoder cuda:1, scheduler on the CPU) at W1
# c1,16,64,256, then the runs named in RATIOS.
#   RATIOS     names from the case block below, each one run (default: no_lookahead eager radix
#              no_radix, the c16 ratios); each line's flags say what it changes from COMMON.
#   ONE_GPU=1  adds W1 at c1 and c16 with the vocoder on the worker's GPU in a process of its own.
#   TWO_GPU=0  skips the two-GPU sweep (with RATIOS=" " ONE_GPU=1: only the one-GPU run).
#   PROFILE=1  adds vocoder kernel profiles.
#   VOCODERS / VOCODER_SLOTS  vocoder replicas on cuda:1 and streams each (default 2 x 128).
#   FRONTENDS / CHANNELS      scheduler frontend processes (default 4), client connections (default 32).
#   LEVELS     the two-GPU sweep's levels; C256: the c256 runs' levels (256,256,256 measures three
#              times in one launch, for a spread); DUR: measured seconds a level; RUN_TIMEOUT: seconds a run.
FINAL=${OUT:-/tmp/out}
OUT=$(mktemp -d)  # everything is packed into one archive: the device tool returns few files
DUR=${DUR:-15}
COMMON=(--launch --device cuda:0 --vocoder-device cuda:1 --dtype bfloat16 --worker-arg=--preset=full
        --worker-arg=--max-batch=256 --worker-arg=--kv-slots=150000 --vocoder-arg=--preset=full
        --vocoders ${VOCODERS:-2} --vocoder-arg=--slots=${VOCODER_SLOTS:-128}
        --scheduler-arg=--frontends=${FRONTENDS:-4} --channels ${CHANNELS:-32}
        --duration "$DUR" --warmup 5 --no-progress
        --device-note "2x H200: worker cuda:0, vocoder cuda:1, bf16, dummy weights")
# The README's high-load config at c256 (10-frame chunks; first chunks of 10 while 64 or more requests run),
# and one vocoder replica of 256.
LOADED10=(--workload W1 --concurrency ${C256:-256} --scheduler-arg=--chunk-frames=10
          --scheduler-arg=--first-chunk-frames-loaded=10 --vocoder-arg=--chunk-frames=10)
V1=(--vocoders 1 --vocoder-arg=--slots=256)
run() {  # name, then chorus bench flags
  local name=$1; shift
  echo "=== $name: $*"
  # How busy each GPU was (nvidia-smi: the share of time any kernel ran), sampled every 200 ms;
  # chorus.bench.gpu_busy prints the mean over each level's measured window.
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader,nounits -lms 200 \
    > "$OUT/$name.gpu.csv" 2>/dev/null &
  local smi=$!
  timeout ${RUN_TIMEOUT:-420} python -m chorus.cli bench "${COMMON[@]}" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?; kill $smi 2>/dev/null
  echo "rc=$rc"; grep -E " (c|r)=[0-9]|server CPU" "$OUT/$name.log"; grep -iE "error|traceback" "$OUT/$name.log" | head -5
  [ -f "$OUT/$name.json" ] && python -m chorus.bench.gpu_busy "$OUT/$name.gpu.csv" "$OUT/$name.json"
  # A run cut off by the timeout leaves its services running (they run in process groups of their own): stop them before the next one.
  pkill -9 -f "gpu_worker.server|vocoder_svc.server|vocoder_svc.decode_process|scheduler_svc.server" 2>/dev/null; sleep 1
  tar -czf "$FINAL/e2e_sweep.tgz" -C "$OUT" .  # after every run: a call cut short keeps what finished
}
python -m chorus.bench.worker --batches 1 --contexts 32 --steps 2 > /dev/null 2>&1  # flashinfer JIT warm-up
if [ "${TWO_GPU:-1}" = 1 ]; then
run e2e_w1_x2 --server-logs --workload W1 --concurrency ${LEVELS:-1,16,64,256} --plot "$OUT/e2e_w1_x2.png"
fi
for r in ${RATIOS:-no_lookahead eager radix no_radix}; do
  case $r in
    no_lookahead) run e2e_w1_c16_no_lookahead --workload W1 --concurrency 16 --scheduler-arg=--no-lookahead ;;
    eager) run e2e_w1_c16_eager --workload W1 --concurrency 16 --worker-arg=--no-cuda-graphs ;;
    radix) run e2e_w2_c16_radix --workload W2 --concurrency 16 ;;
    no_radix) run e2e_w2_c16_no_radix --workload W2 --concurrency 16 --scheduler-arg=--no-radix-cache ;;
    frontends1) run e2e_w1_c256_frontends1 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--frontends=1 ;;
    depth2) run e2e_w1_c256_depth2 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--lookahead-depth=2 ;;
    depth3) run e2e_w1_c256_depth3 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--lookahead-depth=3 ;;
    chunk2048) run e2e_w1_c256_chunk2048 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--prefill-chunk=2048 ;;
    vocoders4) run e2e_w1_c256_vocoders4 --workload W1 --concurrency ${C256:-256} --vocoders 4 --vocoder-arg=--slots=64 ;;
    vocoders1) run e2e_w1_c256_vocoders1 --workload W1 --concurrency ${C256:-256} "${V1[@]}" ;;
    chunk10) run e2e_w1_c256_chunk10 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--chunk-frames=10 \
               --vocoder-arg=--chunk-frames=10 ;;
    chunk5) run e2e_w1_c256_chunk5 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--chunk-frames=5 \
               --vocoder-arg=--chunk-frames=5 ;;
    step5) run e2e_w1_c256_step5 --workload W1 --concurrency ${C256:-256} --vocoder-arg=--step-frames=5 ;;
    chunk5_v4) run e2e_w1_c256_chunk5_v4 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--chunk-frames=5 \
               --vocoder-arg=--chunk-frames=5 --vocoders 4 --vocoder-arg=--slots=64 ;;
    chunk5_gather_off) run e2e_w1_c256_chunk5_gather_off --workload W1 --concurrency ${C256:-256} --scheduler-arg=--chunk-frames=5 \
               --vocoder-arg=--chunk-frames=5 --scheduler-arg=--prefill-interval-loaded=1 ;;
    chunk5_depth3) run e2e_w1_c256_chunk5_depth3 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--chunk-frames=5 \
               --vocoder-arg=--chunk-frames=5 --scheduler-arg=--lookahead-depth=3 ;;
    chunk5_interval3) run e2e_w1_c256_chunk5_interval3 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--chunk-frames=5 \
               --vocoder-arg=--chunk-frames=5 --scheduler-arg=--prefill-interval=3 ;;
    chunk5_buckets16) run e2e_w1_c256_chunk5_buckets16 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--chunk-frames=5 \
               --vocoder-arg=--chunk-frames=5 --vocoder-arg=--buckets=1,2,4,8,16,32,48,64,80,96,112,128 ;;
    chunk10u) run e2e_w1_c256_chunk10u --workload W1 --concurrency ${C256:-256} --scheduler-arg=--first-chunk-frames=10 \
               --scheduler-arg=--chunk-frames=10 --vocoder-arg=--first-chunk-frames=10 --vocoder-arg=--chunk-frames=10 ;;
    chunk10_loaded) run e2e_w1_c256_chunk10_loaded "${LOADED10[@]}" ;;
    chunk10_loaded_shared) run e2e_w1_c256_chunk10_loaded_shared "${LOADED10[@]}" --vocoders 2 --vocoder-arg=--slots=256 --shared-vocoder-decoder ;;
    chunk10_loaded_fine) run e2e_w1_c256_chunk10_loaded_fine "${LOADED10[@]}" --vocoder-arg=--buckets=1,2,4,8,12,16,20,24,28,32,36,40,44,48,52,56,60,64,72,80,88,96,104,112,120,128 ;;
    chunk10_loaded_v1) run e2e_w1_c256_chunk10_loaded_v1 "${LOADED10[@]}" "${V1[@]}" ;;
    chunk10_loaded_v1_every) run e2e_w1_c256_chunk10_loaded_v1_every "${LOADED10[@]}" "${V1[@]}" \
               --scheduler-arg=--prefill-interval-loaded=1 ;;
    chunk10_loaded_no_la) run e2e_w1_c256_chunk10_loaded_no_la "${LOADED10[@]}" --vocoder-arg=--launch-ahead-streams=64 ;;
    chunk10u_v1) run e2e_w1_c256_chunk10u_v1 --workload W1 --concurrency ${C256:-256} --scheduler-arg=--first-chunk-frames=10 \
               --scheduler-arg=--chunk-frames=10 --vocoder-arg=--first-chunk-frames=10 --vocoder-arg=--chunk-frames=10 \
               "${V1[@]}" ;;
    chunk10u_interval4) run e2e_w1_c256_chunk10u_interval4 --workload W1 --concurrency ${C256:-256} \
               --scheduler-arg=--first-chunk-frames=10 --scheduler-arg=--chunk-frames=10 \
               --vocoder-arg=--first-chunk-frames=10 --vocoder-arg=--chunk-frames=10 --scheduler-arg=--prefill-interval-loaded=4 ;;
    chunk10u_v1_interval4) run e2e_w1_c256_chunk10u_v1_interval4 --workload W1 --concurrency ${C256:-256} \
               --scheduler-arg=--first-chunk-frames=10 --scheduler-arg=--chunk-frames=10 \
               --vocoder-arg=--first-chunk-frames=10 --vocoder-arg=--chunk-frames=10 --scheduler-arg=--prefill-interval-loaded=4 \
               "${V1[@]}" ;;
    engine_side_1gpu) run e2e_w1_c256_engine_side_1gpu "${LOADED10[@]}" "${V1[@]}" --vocoder-device cuda:0 \
               --vocoder-arg=--preset=tiny --vocoder-arg=--launch-ahead-streams=1 --colocate-vocoder=off \
               --device-note "1x H200: worker cuda:0, vocoder cuda:0 at the tiny preset (48 kHz stereo, toy widths): the engine side's ceiling, bf16, dummy weights" ;;
    engine_side_colocated_1gpu) run e2e_w1_c256_engine_side_colocated_1gpu "${LOADED10[@]}" "${V1[@]}" --vocoder-device cuda:0 \
               --vocoder-arg=--preset=tiny --vocoder-arg=--launch-ahead-streams=1 --vocoder-arg=--step-frames=0 \
               --colocate-vocoder=on --device-note "1x H200: worker cuda:0, the tiny-preset vocoder's decoder in the worker's process (one CUDA context): the engine side's ceiling, bf16, dummy weights" ;;
    chunk10_loaded_v1_1gpu) run e2e_w1_c256_chunk10_loaded_v1_1gpu "${LOADED10[@]}" "${V1[@]}" --vocoder-device cuda:0 \
               --colocate-vocoder=off --device-note "1x H200: worker and vocoder (one replica of 256) on cuda:0, bf16, dummy weights" ;;
    step5_1gpu) run e2e_w1_1gpu_step5 --workload W1 --concurrency 16 --vocoder-device cuda:0 \
                  --worker-arg=--max-batch=64 --vocoders 1 --vocoder-arg=--slots=64 --vocoder-arg=--step-frames=5 \
                  --colocate-vocoder=off --device-note "1x H200: worker and vocoder on cuda:0, bf16, dummy weights" ;;
    colocated1gpu) run e2e_w1_1gpu_colocated --workload W1 --concurrency 1,16 --vocoder-device cuda:0 \
                     --worker-arg=--max-batch=64 --vocoders 1 --vocoder-arg=--slots=64 --colocate-vocoder --server-logs \
                     --vocoder-arg=--step-frames=0 \
                     --device-note "1x H200: worker and vocoder on cuda:0, the vocoder's decoder in the worker's process, bf16, dummy weights" ;;
    colocated_priority1gpu) run e2e_w1_1gpu_colocated_priority --workload W1 --concurrency 1,16 \
                     --vocoder-device cuda:0 --worker-arg=--max-batch=64 --vocoders 1 --vocoder-arg=--slots=64 \
                     --colocate-vocoder --vocoder-arg=--priority-first-chunks --vocoder-arg=--step-frames=0 \
                     --device-note "1x H200: worker and vocoder on cuda:0, the vocoder's decoder in the worker's process, first chunks on a high-priority stream, bf16, dummy weights" ;;
    colocated_step5_1gpu) run e2e_w1_1gpu_colocated_step5 --workload W1 --concurrency 1,16 \
                     --vocoder-device cuda:0 --worker-arg=--max-batch=64 --vocoders 1 --vocoder-arg=--slots=64 \
                     --colocate-vocoder --vocoder-arg=--step-frames=5 \
                     --device-note "1x H200: worker and vocoder on cuda:0, the vocoder's decoder in the worker's process, 5-frame vocoder steps, bf16, dummy weights" ;;
    priority1gpu) run e2e_w1_1gpu_priority --workload W1 --concurrency 1,16 --vocoder-device cuda:0 \
                    --worker-arg=--max-batch=64 --vocoders 1 --vocoder-arg=--slots=64 \
                    --vocoder-arg=--priority-first-chunks --colocate-vocoder=off \
                    --device-note "1x H200: worker and vocoder on cuda:0, bf16, dummy weights" ;;
  esac
done
if [ "${ONE_GPU:-0}" = 1 ]; then
  run e2e_w1_1gpu --workload W1 --concurrency 1,16 --vocoder-device cuda:0 --worker-arg=--max-batch=64 \
      --vocoders 1 --vocoder-arg=--slots=64 --colocate-vocoder=off --device-note "1x H200: worker and vocoder on cuda:0, bf16, dummy weights"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  python -m chorus.bench.vocoder_profile --device cuda:1 --streams 64 --frames 25 --out "$OUT/vocoder_profile.json"
  python -m chorus.bench.vocoder_profile --device cuda:1 --streams 1 --frames 5 --out "$OUT/vocoder_profile_first_chunk.json" | head -12
fi
tar -czf "$FINAL/e2e_sweep.tgz" -C "$OUT" .
