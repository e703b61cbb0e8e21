#!/usr/bin/env bash
# A profile-guided build of aiproxy's extensions (GCC), in place of the plain one:
#   1. build them with counters (AIPROXY_PGO=generate:DIR, see setup.py);
#   2. run scripts/pgo_train.py: the bundled config and demo upstreams under real traffic;
#   3. build them again with what the counters saw (AIPROXY_PGO=use:DIR).
# Run it after scripts/bootstrap.sh (`make pgo` does both). PYTHON picks the interpreter
# (default .venv/bin/python). A plain `build_ext --inplace` undoes it. Exit 3: not GCC.
# scripts/bootstrap.sh runs this after each install (AIPROXY_PGO_BUILD=0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PROFILE=$PWD/build/pgo-profile
CC=${CC:-$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("CC").split()[0])')}

if ! "$CC" --version 2>/dev/null | grep -q "Free Software Foundation"; then
    echo "pgo_build: $CC is not GCC; only GCC's profile format is supported" >&2
    exit 3
fi
LOG=$PWD/build/pgo-build.log
rm -rf "$PROFILE"
mkdir -p build
: >"$LOG"
# The compiler's output goes to the log; it is shown when a step fails.
build() {
    if ! AIPROXY_BPF=0 AIPROXY_PGO=$1 "$PYTHON" setup.py -q build_ext --inplace --force \
            --parallel "$(nproc)" >>"$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        echo "pgo_build: the build failed (whole log: $LOG)" >&2
        exit 1
    fi
}
echo "pgo_build: 1/3 build with counters"
build "generate:$PROFILE"
echo "pgo_build: 2/3 training run"
# It takes seconds; the bound is there so a hung run cannot hold up an install.
timeout 600 "$PYTHON" scripts/pgo_train.py "${PGO_SCALE:-10}"
count=$(find "$PROFILE" -name '*.gcda' | wc -l)
if [ "$count" -eq 0 ]; then
    echo "pgo_build: the training run wrote no counters to $PROFILE" >&2
    exit 1
fi
echo "pgo_build: 3/3 build with the profiles of $count modules"
build "use:$PROFILE"
echo "pgo_build: done"
