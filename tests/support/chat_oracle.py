"""Run inside vLLM's environment: render chat conversations with transformers (what vLLM
renders with) and detect each template's content format with vLLM's own code.

    <vllm python> tests/support/chat_oracle.py < request.json > answer.json

request: {"templates": {name: source}, "cases": [{"template", "conversation", "tools",
"add_generation_prompt", "continue_final_message", "kwargs"}]}
answer: {"formats": {name: "string" | "openai"}, "rendered": [text | {"error": message}]}
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template
    from vllm.renderers.hf import _detect_content_format

    request = json.load(sys.stdin)
    templates = request["templates"]
    formats = {name: _detect_content_format(source, default="string")
               for name, source in templates.items()}
    rendered = []
    for case in request["cases"]:
        try:
            texts, _ = render_jinja_template(
                conversations=[case["conversation"]], tools=case.get("tools"),
                chat_template=templates[case["template"]],
                add_generation_prompt=case.get("add_generation_prompt", True),
                continue_final_message=case.get("continue_final_message", False),
                **case.get("kwargs", {}))
            rendered.append(texts[0])
        except Exception as exc:  # the template's own refusal is an answer too
            rendered.append({"error": f"{exc.__class__.__name__}: {exc}"})
    json.dump({"formats": formats, "rendered": rendered}, sys.stdout)


if __name__ == "__main__":
    main()
