"""The README stays a page a user reads in minutes, its links and the docs' links lead
somewhere, and names live in docs/contracts.md alone (no page copies its tables)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
# Pages the README's index names before they are written.
ANNOUNCED = {"docs/access-log.md", "docs/prefix-caching.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (code blocks skipped)."""
    found, in_code = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = re.match(r"#+\s+(.*)", line)
        if heading and not in_code:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            found.add(text.replace(" ", "-"))
    return found


def test_readme_is_a_short_users_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for section in ("## Install", "## Plan a deployment", "## Run the sidecar",
                    "### Reading decisions", "## Metrics and alerts",
                    "## Kubernetes quick start", "## Documentation"):
        assert section in text
    assert "bash scripts/check" in text  # .ci/run runs the README's test command


def test_readme_indexes_every_docs_page() -> None:
    linked = set(LINK.findall(README.read_text(encoding="utf-8")))
    for page in PAGES:
        assert f"docs/{page.name}" in linked, f"README does not link docs/{page.name}"
    assert linked >= ANNOUNCED


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_links_lead_somewhere(path: Path) -> None:
    for link in LINK.findall(path.read_text(encoding="utf-8")):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        target, _, fragment = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if str(file.relative_to(ROOT)) in ANNOUNCED:
            continue
        assert file.exists(), f"{path.name}: {link} leads nowhere"
        if fragment and file.suffix == ".md":
            assert fragment in anchors(file), f"{path.name}: no heading for {link}"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_only_contracts_holds_the_tables_of_names(path: Path) -> None:
    if path.name == "contracts.md":
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        # A table row naming a kvgate metric, or a flag with its environment variable.
        assert not re.match(r"\|\s*`kvgate_\w+", line), f"{path.name} copies a metric row"
        assert not re.match(r"\|\s*`--[\w-]+.*\|\s*`KVGATE_", line), (
            f"{path.name} copies a flag row")


def test_contracts_lists_every_serve_flag_with_its_variable() -> None:
    from sidecar.cli.serve import build_parser

    rows: set[str] = set()
    for line in (ROOT / "docs" / "contracts.md").read_text(encoding="utf-8").splitlines():
        cells = re.split(r"(?<!\\)\|", line)  # a cell may hold an escaped \|
        if len(cells) > 3 and "KVGATE_" in cells[2]:
            rows |= set(re.findall(r"--[\w-]+", cells[1]))
    flags = {flag for action in build_parser()._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"}
    assert flags - rows == set(), "flags of `kvgate serve` without a row in contracts.md"


def test_the_readmes_plan_example_is_what_kvgate_plan_prints() -> None:
    """The README's `kvgate plan` session, abridged: its command, run now, prints each of
    its lines (the plan is pure: same model, same numbers on any machine)."""
    from sidecar.cli.main import main

    text = README.read_text(encoding="utf-8")
    block = text.split("## Plan a deployment", 1)[1].split("```", 2)[1]
    lines = block.strip("\n").splitlines()
    command = lines[0].removeprefix("$ ")
    while command.endswith("\\"):
        lines.pop(0)
        command = command[:-1] + lines[0]
    argv = shlex.split(command)
    assert argv[:2] == ["kvgate", "plan"], argv
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv[1:]) == 0
    printed = out.getvalue().splitlines()
    shown = [line for line in lines[1:] if line.strip()]
    assert len(shown) >= 10
    for line in shown:
        assert line in printed, f"the README shows {line!r}; kvgate plan prints it otherwise"
