#!/usr/bin/env bash
# End-to-end sweep on the two-GPU machine (nvidia-h200-x2): worker on cuda:0, vocoder on
# cuda:1, scheduler on the CPU; every level through the real gRPC API. Then the ratios the
# GPU issue asks for, each from one run at c16: lookahead off, CUDA graphs off, and W2 with
# the radix cache on and off. Results land in $OUT (see benchmarks/README.md).
# VOCODERS: vocoder replicas on cuda:1 (default 2: one process tops out near 1,500 s/s),
# VOCODER_SLOTS: streams each (default 128).
# FRONTENDS: the scheduler's frontend processes (default 4), CHANNELS: client connections
# (default 32, so the kernel spreads them over the frontends). RATIOS picks the ratio runs
# (default: the first four; frontends1 = c256 with one frontend, depth2 / depth3 = c256 with
# 2 / 3 steps in flight, chunk2048 = c256 prefilling up to 2,048 prompt rows a step, vocoders4 =
# c256 with four vocoder replicas of 64 streams, vocoders1 = c256 with one replica of 256 (each
# replica is a CUDA context of its own, and contexts time-slice the GPU), chunk10 = c256 with 10-frame audio chunks, so a
# stream's last vocoder step is short, chunk5 = c256 with every chunk 5 frames like the first, so first
# chunks and steady chunks share the vocoder's steps, step5 = c256 with 25-frame chunks decoded in 5-frame
# steps (the same sharing without 5x the relay messages), chunk5_v4 = chunk5 with
# four replicas of 64 (four gRPC processes for the 5x chunk messages), chunk5_depth3 / chunk5_interval3 /
# chunk5_buckets16 = chunk5 with 3 steps in flight / prefill every 3rd step / session 7's 16-stream vocoder buckets,
# chunk5_gather_off = chunk5 prefilling every step under load too (--prefill-interval-loaded=1; before session 9),
# chunk10u = every chunk 10 frames, the first too (half the vocoder steps of chunk5), chunk10_loaded = first
# chunk 5 at light load and 10 under load (the README's
# high-load config: --first-chunk-frames-loaded 10), chunk10_loaded_shared = chunk10_loaded with both replicas in front of one
# decoder process of 256 slots (--shared-vocoder-decoder: one CUDA context, gRPC work over two processes), chunk10_loaded_fine = chunk10_loaded with vocoder buckets every 4 streams up to 64 (c256's
# steps hold ~33 streams: less padding than buckets of 8), chunk10_loaded_v1 = that with one vocoder replica of 256
# (one CUDA context, no time-slicing), chunk10_loaded_no_la = chunk10_loaded launching ahead only steps of half
# the slots (--launch-ahead-streams 64, the default before session 10, which c256's 30-55-stream steps never
# reached), chunk10_loaded_v1_no_fold = chunk10_loaded_v1 with the worker's --no-fold-decodes (a mixed step as a
# prefill pass plus the decode graph, the default before session 11), chunk10_loaded_v1_every = chunk10_loaded_v1
# prefilling every step under load too (--prefill-interval-loaded 1: gathering was for the separate prefill pass's
# fixed cost), chunk10u_v1 = chunk10u
# with one vocoder replica of 256 (one CUDA context: two
# replicas' contexts time-slice cuda:1), chunk10u_interval4 / chunk10u_v1_interval4 = those prefilling every
# 4th step under load, engine_side_1gpu = chunk10_loaded_v1 on the one-GPU machine with the
# vocoder at the tiny preset (same 48 kHz stereo PCM, toy widths): the worker, scheduler and relay's ceiling at c256
# without the codec's GPU cost, engine_side_colocated_1gpu = that with the tiny decoder in the worker's
# process (one CUDA context, so no time slices between the two), chunk10_loaded_v1_1gpu = chunk10_loaded_v1 with the full vocoder on the worker's GPU, step5_1gpu = one-GPU c16 with 5-frame vocoder steps, colocated1gpu = the one-GPU run below with the vocoder's decoder in the worker's process (--colocate-vocoder: one
# CUDA context), colocated_priority1gpu = that plus --priority-first-chunks, colocated_step5_1gpu = that with
# --step-frames=5 instead (colocated_step5_1gpu_no_fold: and --no-fold-decodes), priority1gpu = the one-GPU run below with the vocoder's
# --priority-first-chunks; runs on one GPU too); ONE_GPU=1 adds W1 at c1 and c16 with the
# vocoder on the worker's GPU as a process of its own (--colocate-vocoder=off; chorus's one-GPU default is
# colocated with 5-frame steps, the colocated_step5_1gpu run); PROFILE=1 adds vocoder profiles.
# TWO_GPU=0 RATIOS=" " ONE_GPU=1: only the one-GPU run (for the single-GPU machine).
# C256: the c256 ratio runs' levels (default 256); C256=256,256,256 measures each three times in one
# launch, back to back, for a spread (runs of one configuration differ by a few percent).
FINAL=${OUT:-/tmp/out}
OUT=$(mktemp -d)  # the device tool returns at most 8 files: everything is packed into one archive
DUR=${DUR:-15}  # RUN_TIMEOUT: seconds per run (default 420)
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
  # A run cut off by the timeout leaves its services (own sessions) running: stop them before the next one.
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
    chunk10_loaded_v1_no_fold) run e2e_w1_c256_chunk10_loaded_v1_no_fold "${LOADED10[@]}" "${V1[@]}" --worker-arg=--no-fold-decodes ;;
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
    colocated_step5_1gpu_no_fold) run e2e_w1_1gpu_colocated_step5_no_fold --workload W1 --concurrency 1,16 \
                     --vocoder-device cuda:0 --worker-arg=--max-batch=64 --vocoders 1 --vocoder-arg=--slots=64 \
                     --colocate-vocoder --vocoder-arg=--step-frames=5 --worker-arg=--no-fold-decodes \
                     --device-note "1x H200: worker and vocoder on cuda:0, the vocoder's decoder in the worker's process, 5-frame vocoder steps, mixed steps not folded, bf16, dummy weights" ;;
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
