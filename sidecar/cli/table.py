"""Plain-text tables for terminal output."""

from __future__ import annotations

from collections.abc import Sequence


def render(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None) -> str:
    """Left-aligned columns separated by two spaces; a rule under the header."""
    body = [list(map(str, row)) for row in rows]
    all_rows = ([list(header)] if header else []) + body
    if not all_rows:
        return ""
    widths = [max(len(row[i]) for row in all_rows if i < len(row)) for i in
              range(max(len(row) for row in all_rows))]
    lines = []
    for index, row in enumerate(all_rows):
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if header and index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def section(title: str, rows: Sequence[Sequence[str]]) -> str:
    return f"{title}\n{render(rows)}"
