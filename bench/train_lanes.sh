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
    run=$(mktemp -d /tmp/aotc-train-XXXX)
    cp -a . "$run"
    cd "$run"
    py=${PYTHON:-python3}
    if compgen -G '.whl/*.whl' >/dev/null; then
        $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site:$run
    fi
    if compgen -G '.bwrap/bubblewrap_*.deb' >/dev/null; then
        rm -rf /tmp/bw && dpkg -x .bwrap/bubblewrap_*.deb /tmp/bw
        if ! /tmp/bw/usr/bin/bwrap --version >/dev/null 2>&1; then  # the image lacks a library bwrap links
            mv /tmp/bw/usr/bin/bwrap /tmp/bw/usr/bin/bwrap.real
            printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec /tmp/bw/usr/bin/bwrap.real "$@"\n' "$run/.bwrap" \
                >/tmp/bw/usr/bin/bwrap
            chmod +x /tmp/bw/usr/bin/bwrap
        fi
        /tmp/bw/usr/bin/bwrap --version
        export AOTC_SANDBOX_BWRAP=/tmp/bw/usr/bin/bwrap
    fi
    # --cpp builds examples/cpp's aotc_run there, which needs OpenSSL's headers: carried as Debian's libssl-dev
    # (.ssl/, `apt-get download libssl-dev`), unpacked aside and linked against the image's own libcrypto.so.3
    # (what its Python's ssl module loads). Tried on the CPU box: the same build, headers from the .deb.
    if compgen -G '.ssl/libssl-dev_*.deb' >/dev/null; then
        rm -rf /tmp/ssl && dpkg -x .ssl/libssl-dev_*.deb /tmp/ssl
        export OPENSSL_CFLAGS="-I/tmp/ssl/usr/include -I/tmp/ssl/usr/include/x86_64-linux-gnu"
        export OPENSSL_LIBS="-l:libcrypto.so.3"
    fi
    if command -v nvidia-smi >/dev/null; then
        export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6  # docs: packages segfault on load without it
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
