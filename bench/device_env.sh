# Sourced by bench/lanes.sh and bench/train_lanes.sh on a device machine: copy this tree aside and set up what the
# GPU image lacks, from what the device call carried (docs/development.md, "On a GPU"). After it, the shell is in
# the copy ($run: a later call replaces the tree, never the copy) with:
#   .whl/*.whl                 installed with --target /tmp/site, on PYTHONPATH beside the copy
#   .bwrap/bubblewrap_*.deb    unpacked to /tmp/bw, AOTC_SANDBOX_BWRAP pointing at it (with .bwrap/'s libraries
#                              when the image lacks one that bwrap links)
#   .ssl/libssl-dev_*.deb      OpenSSL's headers for examples/cpp (train.py --cpp), linked against the image's own
#                              libcrypto.so.3 (what its Python's ssl module loads)
#   a GPU                      LD_PRELOAD of the system libstdc++ (packages segfault on load without it: NOTES.md)
#   bytecode                   the copy and /tmp/site compiled (.pyc), as an installed client has them
# Each is skipped when absent (a CPU smoke test carries none). PY is the interpreter (PYTHON, else python3).
run=$(mktemp -d "/tmp/aotc-${AOTC_RUN_NAME:-run}-XXXX")
cp -a . "$run"
cd "$run"
PY=${PYTHON:-python3}
if compgen -G '.whl/*.whl' >/dev/null; then
    # Installed once per machine: a second run started beside a first (train_lanes.sh and farm.py on one machine)
    # must not replace /tmp/site under the first's imports. The marker names the wheels it was installed from.
    wheels=$(ls .whl/*.whl | xargs -n1 basename | sort | sha256sum | cut -c1-16)
    if [[ $(cat /tmp/site/.aotc-wheels 2>/dev/null) != "$wheels" ]]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        echo "$wheels" >/tmp/site/.aotc-wheels
    fi
    export PYTHONPATH=/tmp/site:$run
    # A wheel missing from .whl/ (httpx-sse, pyseccomp: fetch-wheels.sh's extras) fails here in a second, not
    # minutes later in a lane's log with a service half started.
    $PY -c "import client, service.api, worker.main, cryptography, pyseccomp" || {
        echo "device_env.sh: the carried wheels lack a module above (docs/development.md, 'On a GPU')" >&2
        return 1 2>/dev/null || exit 1; }
fi
if compgen -G '.bwrap/bubblewrap_*.deb' >/dev/null; then
    rm -rf /tmp/bw && dpkg -x .bwrap/bubblewrap_*.deb /tmp/bw
    if ! /tmp/bw/usr/bin/bwrap --version >/dev/null 2>&1; then  # the image lacks a library bwrap links
        mv /tmp/bw/usr/bin/bwrap /tmp/bw/usr/bin/bwrap.real
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec /tmp/bw/usr/bin/bwrap.real "$@"\n' "$run/.bwrap" >/tmp/bw/usr/bin/bwrap
        chmod +x /tmp/bw/usr/bin/bwrap
    fi
    /tmp/bw/usr/bin/bwrap --version
    export AOTC_SANDBOX_BWRAP=/tmp/bw/usr/bin/bwrap
fi
if compgen -G '.ssl/libssl-dev_*.deb' >/dev/null; then  # tried on the CPU box: the same build, headers from the .deb
    rm -rf /tmp/ssl && dpkg -x .ssl/libssl-dev_*.deb /tmp/ssl
    export OPENSSL_CFLAGS="-I/tmp/ssl/usr/include -I/tmp/ssl/usr/include/x86_64-linux-gnu"
    export OPENSSL_LIBS="-l:libcrypto.so.3"
fi
if command -v nvidia-smi >/dev/null; then
    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
fi
# Bytecode, as `pip install` leaves it: the image sets PYTHONDONTWRITEBYTECODE=1 and the wheels go in with
# --no-compile, so without this every fresh process compiled the client, httpx, pydantic and the rest from source,
# and bench/ttfi.py's client start measured that (bench/README.md, "Weights onto the GPU in pinned chunks").
$PY -m compileall -q -j 0 "$run" ${PYTHONPATH:+/tmp/site} >/dev/null 2>&1 || true
