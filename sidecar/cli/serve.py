"""`kvgate serve`: the sidecar in front of a vLLM server."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import Any, get_args

from sidecar.cli.args import Parser
from sidecar.model import ModelError
from sidecar.server.access_log import AccessLogError, configure_logging
from sidecar.server.app import ListenError, serve
from sidecar.server.settings import (
    BOOLEAN_FIELDS,
    FIELDS,
    SettingsError,
    env_name,
    flag_name,
    load_settings,
)
from sidecar.tokens import TokenizerFilesError

DESCRIPTION = """\
Run kvgate in front of one vLLM server. Generation requests (/v1/chat/completions,
/v1/completions, /v1/responses, /v1/messages) are admitted, queued or rejected by
predicting their KV-cache and latency cost from the model's config.json, the GPU's
figures and what the server reports about itself; everything else is proxied as is.

Every option can also be set by an environment variable (shown in brackets) or in a
YAML file given by --config (keys are the option names with underscores);
the command line wins over the environment, which wins over the file.
"""

EPILOG = """\
routes: /healthz (alive), /readyz (upstream reachable and capacity known), /metrics,
/kvgate/v1/state, /kvgate/v1/plan, /kvgate/v1/calibration

examples:
  kvgate serve --upstream http://127.0.0.1:8000 --gpu H100
  kvgate serve --upstream http://127.0.0.1:8000 --model-config /models/qwen3-8b \\
      --gpu L40S --mode shadow --port 8080
  KVGATE_UPSTREAM=http://127.0.0.1:8000 KVGATE_GPU=A100-80GB kvgate serve
"""


# The spellings `kvgate plan` and `kvgate simulate` use for the same settings.
ALIASES = {"model": ("--model",), "calibration_file": ("--calibration",)}


def build_parser(prog: str = "kvgate serve") -> Parser:
    parser = Parser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="a YAML file of settings "
                        "[KVGATE_CONFIG]")
    for name, field in FIELDS.items():
        flags = [flag_name(name), *ALIASES.get(name, ())]
        help_text = f"{field.description} [{env_name(name)}]"
        default = field.default
        if name in BOOLEAN_FIELDS:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                                default=None, help=f"{help_text} (default: "
                                f"{'on' if default else 'off'})")
            continue
        literal = [c for c in _choices(field.annotation) if isinstance(c, str)]
        if field.is_required():
            help_text += " (required)"
        elif default is not None:
            help_text += f" (default: {default})"
        metavar = "{" + ",".join(literal) + "}" if literal else _metavar(name, field.annotation)
        parser.add_argument(*flags, dest=name, default=None, metavar=metavar,
                            choices=literal or None, help=help_text)
    return parser


# A value's kind: by the setting's name, else by its unit (the name's ending), else its type.
_METAVARS = {"upstream": "URL", "kv_events_endpoint": "ENDPOINT", "host": "ADDRESS",
             "port": "PORT", "admin_port": "PORT", "admin_token": "TOKEN", "model": "MODEL",
             "gpu": "NAME", "tokenizer": "DIR", "calibration_file": "FILE",
             "access_log": "PATH", "num_speculative_tokens": "N"}
_UNITS = (("_gib", "GIB"), ("_gbps", "GB/S"), ("_tflops", "TFLOP/S"), ("_bytes", "BYTES"),
          ("_s", "SECONDS"), ("_ratio", "F"), ("_quantile", "F"), ("_tokens", "TOKENS"))


def _metavar(name: str, annotation: Any) -> str:
    if name in _METAVARS:
        return _METAVARS[name]
    for ending, metavar in _UNITS:
        if name.endswith(ending):
            return metavar
    return "N" if int in (annotation, *get_args(annotation)) else "X"


def _choices(annotation: Any) -> tuple[Any, ...]:
    """The values of a Literal (also inside `Literal[...] | None`)."""
    values: list[Any] = []
    for arg in get_args(annotation) or ():
        values += list(get_args(arg)) if get_args(arg) else [arg]
    return tuple(values)


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop for "uvloop" (and "auto" when it is installed), else asyncio's."""
    if choice == "asyncio":
        return None
    try:
        import uvloop  # noqa: PLC0415  (not on Windows; only serve needs it)
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("kvgate serve: error: --event-loop uvloop: uvloop is not "
                             "installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run(argv: Sequence[str], prog: str = "kvgate serve") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    cli: dict[str, Any] = {name: getattr(args, name) for name in FIELDS}
    try:
        settings = load_settings(cli, config_file=args.config)
    except SettingsError as exc:
        for line in exc.lines:
            sys.stderr.write(f"{prog}: error: {line}\n")
        return 2
    configure_logging(settings.log_level)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
            return runner.run(serve(settings))
    except (ModelError, AccessLogError, TokenizerFilesError) as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    except ListenError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    except OSError as exc:
        sys.stderr.write(f"{prog}: error: cannot listen on {settings.host}:{settings.port} "
                         f"({exc.strerror})\n")
        return 2
