#!/usr/bin/env bash
# A GPU session's work as one background job on a staged device host (stage-stack.sh put
# p01-p17, p24; carry .whl/d), so that no phase depends on the next call arriving in time:
#   bash tests/gpu/session_job.sh start kimi|output|both|quick [BENCH_DEADLINE_S [OUTPUT_DEADLINE_S]]
#       (returns at once; both: the output module, the kimi job, then the output bench;
#       quick: the fused fp8 kernel's module, then the output module)
#   bash tests/gpu/session_job.sh collect [jit]     (copies what is done to $OUT)
#   bash tests/gpu/session_job.sh seed              (carry .jit-cache: a JIT cache collected earlier)
# kimi (issue 48): the fused fp8 kernel's module (-k test_gpu_quant, seconds; quant.json);
# kimi_slice_prep.sh bench (the Marlin prebuild in the background, the slices); the GPU
# module's bf16 and fp8 files and the reference check (-k "kimi_slice and (bf16_files or
# fp8_files or match_reference)", fp8's benchmark one cell; the server waits on SGLang's
# JIT lock for the prebuild); then `python -m bench` on kimi-slice-2 (nodump, dump,
# dump_early, dump_fp8, dump_fp8_early; 2k/8k/32k x 1/8; 3 rounds). Series v0.5.23.
# output (issue 49, the candidate series patches/candidates/v0.5.23): the output-rows module
# (test_gpu_output.py, llama and deepseek; output.json), then `python -m bench` on llama-8b
# (gen_nodump, gen_output, gen_two_pass; 512 and 2k prompts, 512 generated tokens).
# The candidate series is series 7 + 0009: on a host where series 7 is applied, `output`
# first reverts it. BENCH_DEADLINE_S (default 300) cuts the bench's cells past it.
# Everything lands in /tmp/k48: job.log, *.json (pytest --results-json), logs/, bench/
# and jit.tgz (SGLang's JIT cache, for a later host: SGLANG_JIT_CACHE_DIR).
set -uo pipefail
cd "$(dirname "$0")/../.."
k=/tmp/k48
case "${1:-}" in
  start)
    if [ -f $k/job.pid ] && kill -0 "$(cat $k/job.pid)" 2>/dev/null; then
      echo "a job is running (pid $(cat $k/job.pid)): collect it, or kill it first" >&2; exit 1
    fi
    mkdir -p $k/logs $k/bench
    case "${2:-}" in kimi|output|both|quick) ;; *) echo "start kimi|output|both|quick [BENCH_DEADLINE_S [OUTPUT_DEADLINE_S]]" >&2; exit 2 ;; esac
    setsid nohup bash "$0" "job-$2" "${3:-300}" "${4:-${3:-300}}" >$k/job.log 2>&1 < /dev/null &
    echo $! > $k/job.pid
    echo "started: $k/job.log" ;;
  job-kimi)
    t0=$(date +%s)
    stamp() { echo "== $(( $(date +%s) - t0 )) s: $*"; }
    stamp "fused fp8 kernel (no server)"
    bash "$0" job-quant
    stamp prep
    if ! bash tests/gpu/kimi_slice_prep.sh bench; then stamp "prep failed: no module, no bench"; exit 1; fi
    stamp "module (bf16 files, reference)"
    # fp8's benchmark cells cut to one (its files are what this run is for)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True KIMI_SGLANG_SERIES=v0.5.23 OUT=$k \
      KIMI_SLICE_CELLS=${KIMI_SLICE_CELLS:-8192x8x16} KIMI_SLICE_ROUNDS=${KIMI_SLICE_ROUNDS:-1} \
      bash tests/gpu/run_e2e.sh run -k "kimi_slice and (bf16_files or fp8_files or match_reference)" \
      --results-json $k/slice.json --server-log-dir $k/logs -s
    stamp "module rc $?"
    tar -C ~/.cache/sglang -czf $k/jit.tgz jit && ls -la $k/jit.tgz
    stamp bench
    # The kept files (~15 GB with their routes) stay in /dev/shm for a later reference-only
    # run: the disk holds the slice (35 GB) and kimi-slice-2 (15 GB) and has ~14 GB left.
    # Three bench servers beside 30 GB of /dev/shm were SIGKILLed at start (host memory);
    # with kimi-slice-2 on disk it is 15 GB.
    rm -rf /dev/shm/hs-kimi-slice
    KIMI_SGLANG_SERIES=v0.5.23 OUT=$k/bench bash bench/run_bench.sh run --quick --models kimi-slice-2 \
      --modes nodump,dump,dump_early,dump_fp8,dump_fp8_early --prompt-lens 2048,8192,32768 --concurrency 1,8 --repeat 3 \
      --skip-ceilings --peer-reference none --no-build --workdir /tmp/kimi-bench \
      --deadline-s "${2:-300}" --case kimi-slice-2
    stamp "bench rc $?"
    stamp done ;;
  job-quant)  # the fused fp8 kernel's module: no server, seconds
    KIMI_SGLANG_SERIES=v0.5.23 OUT=$k bash tests/gpu/run_e2e.sh run -k test_gpu_quant --results-json $k/quant.json
    echo "== quant rc $?" ;;
  job-quick)  # for a session with little device time left: the fused fp8 kernel, the output module
    bash "$0" job-quant
    bash "$0" job-output module ;;
  job-both)
    # the output module first (minutes), then the kimi job, then the output bench: each
    # phase's results are whole when the session's device time ends mid-way
    bash "$0" job-output module
    (eval "$(bash tests/gpu/stage-stack.sh env sglang)"; export PYTHONPATH="$PYTHONPATH:$PWD"
     python3 -m sglang_ext patches revert --series patches/candidates/v0.5.23 --site-packages) \
      && echo "== candidate series reverted"
    bash "$0" job-kimi "${2:-300}"
    # the disk (64 GB) holds the slices (50 GB) or the output bench's 8B model (16 GB)
    rm -rf /tmp/kimi-slice /tmp/kimi-bench/kimi-slice-2 /dev/shm/hs-*; df -h /tmp | tail -1
    bash "$0" job-output bench "${3:-300}" ;;
  job-output)  # [module|bench|all [BENCH_DEADLINE_S]]
    t0=$(date +%s)
    stamp() { echo "== $(( $(date +%s) - t0 )) s: $*"; }
    what=${2:-all}; case $what in module|bench|all) shift ;; *) what=all ;; esac
    eval "$(bash tests/gpu/stage-stack.sh env sglang)"
    export PYTHONPATH="$PYTHONPATH:$PWD"
    python3 -m sglang_ext patches revert --series patches/v0.5.23 --site-packages 2>/dev/null \
      && stamp "series 7 reverted"
    if [ "$what" != bench ]; then
      stamp "output-rows module (candidate series)"
      KIMI_SGLANG_SERIES=candidates/v0.5.23 OUT=$k bash tests/gpu/run_e2e.sh run -k test_gpu_output \
        --models llama,deepseek --results-json $k/output.json --server-log-dir $k/logs
      stamp "module rc $?"
    fi
    if [ "$what" != module ]; then
      KIMI_SGLANG_SERIES=candidates/v0.5.23 OUT=$k/bench bash bench/run_bench.sh run --quick --models llama-8b \
        --modes gen_nodump,gen_output,gen_two_pass --prompt-lens 512,2048 --gen-tokens 512 --repeat 2 \
        --counterbalance --skip-ceilings --peer-reference none --deadline-s "${2:-300}" --case gen-llama-8b
      stamp "bench rc $?"
    fi
    stamp done ;;
  collect)
    out=${OUT:?}
    tail -40 $k/job.log
    cp $k/job.log "$out/" 2>/dev/null
    for f in $k/slice.json $k/quant.json $k/output.json; do [ -f "$f" ] && cp "$f" "$out/"; done
    for f in $k/bench/*.json $k/bench/*.md; do [ -f "$f" ] && cp "$f" "$out/"; done
    # SGLang's JIT cache (the Marlin MoE modules, ~17 MB), in parts $OUT takes (16 MiB a file):
    # keep them in .jit-cache/ (git-ignored) and carry that folder to `seed` a later host
    if [ -f $k/jit.tgz ] && [ "${2:-}" = jit ]; then split -b 15M -d $k/jit.tgz "$out/jit.tgz.part"; fi
    ls $k/logs $k/bench 2>/dev/null | head -30 ;;
  seed)
    mkdir -p ~/.cache/sglang && cat .jit-cache/jit.tgz.part* | tar -C ~/.cache/sglang -xzf - \
      && echo "seeded $(find ~/.cache/sglang/jit -name '*.so' | wc -l) JIT modules" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
