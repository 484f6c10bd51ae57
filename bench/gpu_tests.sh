#!/usr/bin/env bash
# The GPU test suite (pytest -m gpu tests/gpu) in the background, for device sessions cut into short calls: the suite
# takes longer than one call, and a chain started as `( a; b ) &` dies with the call that started it (2026-11-29,
# docs/development.md "On a GPU"), so the whole run is one new session (setsid) that writes its exit status last.
#
#   bench/gpu_tests.sh start RESULTS_DIR [pytest args...]   set up (device_env.sh), start the suite detached
#   bench/gpu_tests.sh watch RESULTS_DIR SECONDS [DEST]     follow it, copying the log, the GPU worker's log and the
#                                                           exit status to DEST every 20 s, until it ends or SECONDS
#
# RESULTS_DIR gets `pytest.log`, `rc` (written when pytest ends) and `tmp/` (pytest's --basetemp: the GPU worker's
# log is tmp/logs*/gpu-worker.log, what the `gpu_compile` fixture quotes when a compile outlives its bound).
set -euo pipefail
cmd=$1 res=$2
shift 2
case $cmd in
start)
    mkdir -p "$res"
    rm -rf "$res/tmp" "$res/rc"
    AOTC_RUN_NAME=gputests source "$(dirname "$0")/device_env.sh"  # into a copy of the tree: wheels, bwrap, LD_PRELOAD
    export PY
    setsid nohup bash -c '"$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider --basetemp "$0/tmp" "${@}" \
        >"$0/pytest.log" 2>&1; echo $? >"$0/rc"' "$res" "$@" </dev/null >/dev/null 2>&1 &
    echo "started in $run"
    ;;
watch)
    secs=$1 dest=${2:-}
    end=$((SECONDS + secs))
    copy() {
        [[ -n $dest ]] || return 0
        mkdir -p "$dest"
        cp -f "$res/pytest.log" "$res/rc" "$dest"/ 2>/dev/null || true
        find "$res/tmp" -name 'gpu-worker.log' -exec cp -f {} "$dest"/ \; 2>/dev/null || true
    }
    while ((SECONDS < end)) && [[ ! -e $res/rc ]]; do
        sleep 20
        copy
    done
    copy
    tail -n 25 "$res/pytest.log"
    [[ -e $res/rc ]] && echo "pytest exit status: $(cat "$res/rc")" || echo "still running"
    ;;
*)
    echo "usage: $0 start|watch RESULTS_DIR ..." >&2
    exit 2
    ;;
esac
