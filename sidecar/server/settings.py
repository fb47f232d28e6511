"""`kvgate serve` settings: command line > KVGATE_* environment > YAML file > default.

Every setting has one name; the flag is `--name-with-dashes`, the environment
variable `KVGATE_NAME_WITH_UNDERSCORES` and the YAML key `name_with_underscores`
(e.g. `--model-config`, `KVGATE_MODEL_CONFIG`, `model_config`).
Validation reports one line per problem, naming the setting and where it came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sidecar.upstream.kv_events import check_endpoint


class SettingsError(ValueError):
    """One or more settings are invalid; `lines` has one message per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    upstream: str = Field(description="base URL of the vLLM server, e.g. http://127.0.0.1:8000")
    model: str | None = Field(
        None, description="the served model's config.json (file, directory or preset); "
        "default: the model path /v1/models reports, when readable")
    gpu: str | None = Field(None, description="GPU name from the catalogue (`kvgate gpus`)")
    gpu_memory_gib: float | None = Field(None, gt=0, description="custom GPU: memory in GiB")
    gpu_bandwidth_gbps: float | None = Field(None, gt=0, description="custom GPU: GB/s")
    gpu_tflops: float | None = Field(None, gt=0, description="custom GPU: dense bf16 TFLOP/s")
    tp: int = Field(1, ge=1, le=64, description="the server's tensor parallel size")
    host: str = Field("0.0.0.0", description="listen address")
    port: int = Field(8080, ge=1, le=65535, description="listen port")
    admin_port: int | None = Field(
        None, ge=1, le=65535,
        description="serve /metrics and /kvgate/v1/* on this port instead of --port")
    admin_token: str | None = Field(
        None, min_length=8, description="bearer token required on /kvgate/v1/*")
    mode: Literal["enforce", "shadow"] = Field(
        "enforce", description="shadow admits everything and records what it would do")
    kv_target_ratio: float = Field(
        0.95, gt=0, le=1, description="share of the KV capacity kvgate reserves up to")
    queue_max_length: int = Field(1000, ge=0, le=1_000_000,
                                  description="requests that may wait for KV headroom")
    queue_max_wait_s: float = Field(60.0, gt=0, description="longest wait before rejection")
    ordering: Literal["fcfs", "edf"] = Field(
        "fcfs", description="order within a tenant: first come first served, or earliest "
        "deadline (x-kvgate-ttft-slo-ms)")
    fairness: Literal["cost", "none"] = Field(
        "cost", description="between tenants: by predicted GPU cost served, or none")
    priority_bands: int = Field(3, ge=1, le=10, description="number of priority bands")
    starvation_bound_s: float | None = Field(
        30.0, gt=0, description="longest a lower band waits behind higher ones; none: no "
        "bound")
    output_policy: Literal["worst-case", "quantile"] = Field(
        "worst-case", description="KV reserved for requests without max_tokens")
    output_quantile: float = Field(0.9, gt=0, le=1,
                                   description="quantile of observed output lengths")
    max_overcommit_ratio: float = Field(
        0.1, ge=0, le=1, description="share of capacity the quantile policy may leave unreserved")
    block_size: int | None = Field(None, ge=1, description="KV block size if the server "
                                   "does not report it")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="the server's --max-num-batched-tokens: the prefill chunk, "
        "which sets a sliding-window request's prefill peak (default: vLLM's for --gpu; "
        "without it 8192; give the server's on a CPU build)")
    max_num_seqs: int | None = Field(
        None, ge=1, le=1_000_000, description="the server's --max-num-seqs (per engine): "
        "kvgate forwards at most this many sequences at once (times --data-parallel-size) "
        "and keeps the rest in its own queue (priority, fairness, deadlines) instead of the "
        "server's first-come one; default: no cap")
    max_num_queued_reqs: int | None = Field(
        None, ge=0, description="the server's --max-num-queued-reqs (vLLM 0.29 and later): "
        "kvgate keeps the requests it forwards within it, so the server never refuses one")
    max_num_queued_tokens: int | None = Field(
        None, ge=0, description="the server's --max-num-queued-tokens (vLLM 0.29 and later): "
        "kvgate forwards no request while the prompts it sent that are still in prefill "
        "hold this many tokens")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="the server's --long-prefill-token-threshold: with a threshold a "
        "request behind another with the same new prompt, and each fork of a request with n "
        "above 1, is sure to share only the first chunk of that many tokens (it computes its "
        "own copy of the rest), and a prompt beside running requests is prefilled in chunks "
        "of at most that many (its predicted TTFT); 0: no threshold (vLLM's default). The "
        "server does not report it: give its value")
    metrics_interval_s: float = Field(1.0, gt=0, le=60,
                                      description="how often to scrape the server's /metrics")
    metrics_stale_s: float = Field(10.0, gt=0, description="age after which server metrics "
                                   "are ignored (model-only decisions)")
    kv_events_endpoint: str | None = Field(
        None, description="where kvgate subscribes to vLLM's KV cache events (vLLM's "
        "--kv-events-config endpoint, seen from kvgate), e.g. ipc:///run/kvgate/kv-events.sock "
        "or tcp://127.0.0.1:5557")
    kv_events_stale_s: float = Field(
        5.0, gt=0, description="kvgate sent the server prompt blocks it did not hold this "
        "long ago and no KV cache event came since: the events are stale, and kvgate models "
        "the server's cache from its own traffic until they flow again")
    mamba_cache_mode: Literal["auto", "align", "none"] = Field(
        "auto", description="the server's --mamba-cache-mode (Mamba / gated-delta-net "
        "hybrids): align holds 2 state blocks per request, none 1; auto: align with prefix "
        "caching, else none (vLLM's default)")
    mamba_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the server's --mamba-cache-dtype (conv state; auto: the model "
        "dtype)")
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the server's --mamba-ssm-cache-dtype (temporal state; auto: "
        "the model family's default)")
    num_speculative_tokens: int = Field(
        0, ge=0, le=64, description="the server's speculative tokens per step (MTP, EAGLE, "
        "n-gram): more state blocks per request on Mamba hybrids")
    data_parallel_size: int = Field(
        1, ge=1, le=1024, description="the server's --data-parallel-size: engines with a KV "
        "pool each; a request lands on one of them")
    speculative_method: Literal["ngram", "mtp"] | None = Field(
        None, description="the server's speculative decoding method when its drafter has "
        "KV layers kvgate models: mtp (the model's own MTP layers, whose caches join the "
        "model's); default: a drafter without KV layers (n-gram)")
    attention_backend: Literal["FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4"] | None = (
        Field(None, description="the server's --attention-backend where it changes the KV "
              "layout: FLASHINFER_MLA_SPARSE_DSV4 stores DeepSeek-V4's caches as plain bf16 / "
              "fp8 rows instead of fp8_ds_mla; default: vLLM's choice for the GPU"))
    prefix_caching: Literal["auto", "on", "off"] = Field(
        "auto", description="whether the server shares prompt blocks between requests with a "
        "common prefix (vLLM's --enable-prefix-caching); auto: as its cache_config_info says, "
        "on when it does not say (vLLM's default)")
    async_scheduling: bool = Field(
        True, description="whether the server schedules each step while the last one runs "
        "(vLLM's default on GPUs; off with its --no-async-scheduling, with an n-gram "
        "drafter and in its CPU build): "
        "a request arriving while others run waits for the step in flight and the one "
        "scheduled behind it (1.5 steps on average) before its prefill; 0.5 steps without it")
    tokenizer: str | None = Field(
        None, description="the served model's tokenizer files (a directory with "
        "tokenizer.json, tokenizer_config.json and the chat template): prompts are counted "
        "locally and checked against the server's /tokenize; default: the model directory "
        "(--model-config, or the path /v1/models reports) when it holds them")
    tokenizer_check_every: int = Field(
        100, ge=0, le=1_000_000, description="after the first requests of each shape "
        "(checked against the server's /tokenize, whose answer they use), compare one "
        "local count in this many with the server's, in the background; 0: never")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="the event loop: uvloop (what vLLM runs on; as fast as "
        "asyncio's own or a little faster in bench/overhead.py --canned), or asyncio's "
        "own; auto: uvloop when installed")
    front_end: Literal["lean", "aiohttp"] = Field(
        "lean", description="how requests are read off the socket: lean (kvgate reads a "
        "plain POST to a generation route itself and writes its answer straight to the "
        "socket; any other request, and the rest of its connection, goes to aiohttp), or "
        "aiohttp for every request")
    connect_timeout_s: float = Field(5.0, gt=0, description="upstream connect timeout")
    upstream_keepalive_s: float = Field(
        4.0, gt=0, description="close connections to the server idle this long: keep it "
        "below the server's own keep-alive (vLLM closes idle connections after "
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), or a request can go out on a connection the "
        "server is closing and fail")
    read_timeout_s: float = Field(600.0, gt=0,
                                  description="longest silence while reading an upstream response")
    drain_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: time given to running "
                                   "requests before exit")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024,
                                description="largest request body accepted")
    gateway_metrics: bool = Field(
        False, description="also expose vllm:num_requests_waiting and vllm:kv_cache_usage_perc "
        "(predictive) for the Gateway API Inference Extension / llm-d")
    calibrate: bool = Field(True, description="fit efficiency factors to the live server")
    calibration_file: str | None = Field(
        None, description="where to keep the calibration across restarts (safe to lose)")
    deadline_quantile: Literal["p50", "p90"] = Field(
        "p50", description="the predicted time to first token that requests' TTFT targets "
        "(x-kvgate-ttft-slo-ms) are judged on: the median (p50), or the 90th percentile "
        "(p90: refuse or stop queueing what would miss its target one time in ten)")
    log_prompts: bool = Field(False, description="log prompts (never logged otherwise)")
    access_log: str = Field(
        "stdout", min_length=1, description="one line per proxied request, at its end: off, "
        "stdout or a file path (appended to, reopened when rotated)")
    access_log_format: Literal["json", "kv"] = Field(
        "json", description="access-log lines as JSON objects or key=value pairs")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info",
                                                                    description="log level")

    @field_validator("upstream")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError("must be the server's base URL, without a path")
        try:
            port = parts.port
        except ValueError:
            port = 0
        host_and_port = parts.netloc.rpartition("@")[2].rpartition("]")[2]
        if ":" in host_and_port and not port:
            raise ValueError("must have a port from 1 to 65535, e.g. http://127.0.0.1:8000")
        return value.rstrip("/")

    @field_validator("starvation_bound_s", mode="before")
    @classmethod
    def _no_bound(cls, value: object) -> object:
        """`none` / `off` (a flag or environment variable's spelling of YAML's null; YAML
        reads a bare `off` as false)."""
        if value is False or (isinstance(value, str)
                              and value.strip().lower() in ("none", "off", "null")):
            return None
        if value is True:
            raise ValueError("must be a number of seconds, or none")
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServeSettings:
        if self.admin_port is not None and self.admin_port == self.port:
            raise ValueError(f"--admin-port must differ from --port ({self.port}): leave it "
                             "unset to serve /metrics and /kvgate/v1/* on --port")
        return self

    @model_validator(mode="after")
    def _fresh_between_scrapes(self) -> ServeSettings:
        if self.metrics_stale_s <= self.metrics_interval_s:
            raise ValueError(
                f"--metrics-stale-s ({self.metrics_stale_s:g}) must be longer than "
                f"--metrics-interval-s ({self.metrics_interval_s:g}): the server's figures "
                "would be stale before the next scrape, and every decision between two "
                "scrapes made without them")
        return self

    @field_validator("kv_events_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)


FIELDS = ServeSettings.model_fields
BOOLEAN_FIELDS = {name for name, f in FIELDS.items() if f.annotation is bool}


# Settings whose public name differs from the field (pydantic reserves `model_config`).
PUBLIC_NAMES = {"model": "model_config"}
FIELD_NAMES = {public: field for field, public in PUBLIC_NAMES.items()}


def public_name(field: str) -> str:
    return PUBLIC_NAMES.get(field, field)


def env_name(field: str) -> str:
    return "KVGATE_" + public_name(field).upper()


def flag_name(field: str) -> str:
    return "--" + public_name(field).replace("_", "-")


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _from_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The settings the environment gives, and one line per value it misspells."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    for name in FIELDS:
        raw = environ.get(env_name(name))
        if raw is None or raw == "":
            continue
        if name in BOOLEAN_FIELDS:
            word = raw.strip().lower()
            if word not in TRUE_WORDS + FALSE_WORDS:
                problems.append(f"{env_name(name)}: must be one of {', '.join(TRUE_WORDS)} "
                                f"or {', '.join(FALSE_WORDS)} (got {raw!r})")
                continue
            values[name] = word in TRUE_WORDS
        else:
            values[name] = raw
    return values, problems


def _from_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError([f"--config {path}: cannot read ({exc.strerror})"]) from exc
    except yaml.YAMLError as exc:
        raise SettingsError([f"--config {path}: not valid YAML ({exc})"]) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError([f"--config {path}: must be a mapping of setting: value"])
    normalised = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        normalised[FIELD_NAMES.get(name, name)] = value
    unknown = sorted(set(normalised) - set(FIELDS))
    if unknown:
        raise SettingsError([f"--config {path}: unknown setting {name!r}" for name in unknown])
    return normalised


def load_settings(
    cli: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> ServeSettings:
    """Merge the three sources and validate; SettingsError lists every problem."""
    environ = os.environ if environ is None else environ
    config_path = config_file or environ.get("KVGATE_CONFIG") or None
    from_file = _from_yaml(Path(config_path)) if config_path else {}
    from_env, problems = _from_env(environ)
    given = {k: v for k, v in cli.items() if v is not None}
    merged: dict[str, Any] = {**from_file, **from_env, **given}
    source = {name: f"--config {config_path}: {public_name(name)}" for name in from_file}
    source.update({name: env_name(name) for name in from_env})
    source.update({name: flag_name(name) for name in given})
    try:
        settings = ServeSettings.model_validate(merged)
    except ValidationError as exc:
        lines = list(problems)
        for error in exc.errors():
            message = error["msg"].removeprefix("Value error, ")
            if not error["loc"]:  # a check across settings names them itself
                lines.append(message)
                continue
            name = str(error["loc"][0])
            where = source.get(name, flag_name(name))
            if error["type"] == "missing":
                message = f"is required (give {flag_name(name)} or {env_name(name)})"
                where = flag_name(name)
            value = f" (got {merged[name]!r})" if name in merged else ""
            lines.append(f"{where}: {message}{value}")
        raise SettingsError(lines) from exc
    if problems:
        raise SettingsError(problems)
    return settings
