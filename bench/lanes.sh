#!/usr/bin/env bash
# The serving benchmark on a machine of two GPUs, in the background, for device sessions cut into short calls.
#
#   bench/lanes.sh start RESULTS_DIR [bench.py args...]   set up, copy this tree aside, start bench.py detached
#   bench/lanes.sh watch RESULTS_DIR SECONDS [DEST]       follow it, copying RESULTS_DIR to DEST every 20 s
#
# `start` installs the carried wheels (.whl/) and bubblewrap (.bwrap/) as docs/development.md says, then runs
# bench/bench.py from a copy of the tree (a later call replaces the tree, never the copy) with the workers on GPU 0
# and the last three quarters of the cores, one measuring lane on GPU 1 and the first quarter of the cores from the
# start, and a second one on GPU 0 once every compile is over (bench.py --lanes). BENCH_GPU_TESTS (pytest
# arguments) runs GPU tests beside the compiles.
set -euo pipefail
cmd=$1 res=$2
shift 2
case $cmd in
start)
    mkdir -p "$res"
    AOTC_RUN_NAME=bench source "$(dirname "$0")/device_env.sh"  # into a copy of the tree: wheels, bwrap, LD_PRELOAD
    n=$(nproc) q=$(($(nproc) / 4))
    nvidia-smi -L | tee "$res/gpus.txt"
    echo "cores: $n; workers on $q-$((n - 1)); lanes 1:0-$((q - 1)), 0:$q-$((2 * q - 1))" | tee -a "$res/gpus.txt"
    setsid nohup python3 bench/bench.py --out "$res/bench.json" --compile-gpu 0 --worker-cpus "$q-$((n - 1))" \
        --lanes "1:0-$((q - 1)),0:$q-$((2 * q - 1))" --state /tmp/bench-state "$@" >"$res/bench.log" 2>&1 </dev/null &
    if [[ -n ${BENCH_GPU_TESTS:-} ]]; then  # pytest arguments: GPU tests beside the compiles, on GPU 0
        CUDA_VISIBLE_DEVICES=0 setsid nohup taskset -c "$q-$((n - 1))" python3 -m pytest -m gpu -v -p no:cacheprovider \
            $BENCH_GPU_TESTS >"$res/gpu-tests.log" 2>&1 </dev/null &
    fi
    echo "started in $run"
    ;;
watch)
    secs=$1 dest=${2:-}
    end=$((SECONDS + secs))
    while ((SECONDS < end)); do
        sleep 20
        [[ -n $dest ]] && cp -f "$res"/* "$dest"/ 2>/dev/null || true
    done
    tail -n 25 "$res/bench.log"
    ;;
*)
    echo "usage: $0 start|watch RESULTS_DIR ..." >&2
    exit 2
    ;;
esac
