"""Run under the vLLM CPU build's python: the context length vLLM 0.32 derives for
each config, as its ModelConfig does at start-up.

stdin: {"name": {"config": {...}, "limit": N}}; stdout: {"name": {"default": vLLM's
max_model_len without --max-model-len, "accepts_limit": whether --max-model-len N
passes, "refuses_above": whether N + 1 is refused}}.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

logging.disable(logging.WARNING)

from vllm.config import ModelConfig  # noqa: E402


def _max_model_len(directory: str, max_model_len: int | None) -> int | None:
    try:
        return ModelConfig(model=directory, skip_tokenizer_init=True,
                           max_model_len=max_model_len).max_model_len
    except ValueError:  # pydantic's ValidationError is one: a length vLLM refuses
        return None


def main() -> None:
    cases: dict[str, dict[str, Any]] = json.load(sys.stdin)
    out = {}
    for name, case in cases.items():
        with tempfile.TemporaryDirectory() as directory:
            Path(directory, "config.json").write_text(json.dumps(case["config"]))
            limit = int(case["limit"])
            out[name] = {"default": _max_model_len(directory, None),
                         "accepts_limit": _max_model_len(directory, limit) == limit,
                         "refuses_above": _max_model_len(directory, limit + 1) is None}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
