#!/usr/bin/env bash
# The training benchmark (bench/train.py) in lanes, in the background, for device sessions cut into short calls.
#
#   bench/train_lanes.sh start RESULTS_DIR [train.py args...]   set up, copy this tree aside, start train.py detached
#   bench/train_lanes.sh watch RESULTS_DIR SECONDS [DEST]       follow it until it ends or SECONDS pass, copying
#                                                                RESULTS_DIR's files to DEST (e.g. $OUT) every 20 s
#
# `start` installs the carried wheels (.whl/), bubblewrap (.bwrap/) and OpenSSL's headers (.ssl/, for --cpp) where
# the tree has them, as bench/lanes.sh does, then runs bench/train.py from a copy of the tree (a later call replaces the tree, never the copy) with its
# output in RESULTS_DIR: train.json (the merged rows, rewritten as each finishes), train.log, gpus.txt, pid. Give it
# --lanes N or --gpus 0,1,2,3 for one lane per GPU (bench/trainlanes.py); without them it is one service, as before.
# RESULTS_DIR must be outside the tree (e.g. /tmp/train): the tree is re-sent on every device call.
# On a machine without a GPU (a smoke test), PYTHON picks the interpreter and nothing is installed.
set -euo pipefail
cmd=$1 res=$2
shift 2
case $cmd in
start)
    mkdir -p "$res"
    AOTC_RUN_NAME=train source "$(dirname "$0")/device_env.sh"  # into a copy: wheels, bwrap, OpenSSL, LD_PRELOAD
    py=$PY
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi -L | tee "$res/gpus.txt"
    fi
    echo "cores: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg); tree: $run" | tee -a "$res/gpus.txt"
    PYTHONUNBUFFERED=1 setsid nohup $py bench/train.py --out "$res/train.json" "$@" \
        >"$res/train.log" 2>&1 </dev/null &
    echo $! >"$res/pid"
    echo "started (pid $(cat "$res/pid")) in $run; poll: bench/train_lanes.sh watch $res 540 \$OUT"
    ;;
watch)
    secs=$1 dest=${2:-}
    end=$((SECONDS + secs))
    pid=$(cat "$res/pid")
    while ((SECONDS < end)) && kill -0 "$pid" 2>/dev/null; do
        sleep 20
        if [[ -n $dest ]]; then cp -f "$res"/train.json "$res"/train.log "$res"/gpus.txt "$dest"/ 2>/dev/null || true; fi
    done
    if [[ -n $dest ]]; then cp -f "$res"/train.json "$res"/train.log "$res"/gpus.txt "$dest"/ 2>/dev/null || true; fi
    kill -0 "$pid" 2>/dev/null && echo "still running (pid $pid)" || echo "ended"
    tail -n 30 "$res/train.log"
    ;;
*)
    echo "usage: $0 start|watch RESULTS_DIR ..." >&2
    exit 2
    ;;
esac
