"""A tiny served model and a fake clock for admission tests (no server involved)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from prometheus_client import CollectorRegistry

from sidecar.admission import AdmissionController, AdmissionSettings, CostModel, ServerState
from sidecar.model import Deployment, ServedModel, custom_gpu, parse_config
from sidecar.server.services import Services
from sidecar.server.settings import ServeSettings

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "torch_dtype": "bfloat16",
}


def tiny_served(num_blocks: int = 64, block_size: int = 16, max_model_len: int = 1024,
                config: dict[str, Any] | None = None) -> ServedModel:
    return ServedModel(
        parse_config(config or TINY_LLAMA, "tiny-llama"),
        Deployment(block_size=block_size, max_model_len=max_model_len,
                   num_gpu_blocks_override=num_blocks, max_num_batched_tokens=2048),
        custom_gpu(16, 100, 1),
    )


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is a FakeClock, so timeouts fire when the test says."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self._fake = clock

    def time(self) -> float:
        return self._fake.now


def controller(num_blocks: int = 64, clock: FakeClock | None = None,
               deployment: dict[str, Any] | None = None,
               **settings: Any) -> AdmissionController:
    """A controller on the tiny model, its server available; `deployment`: how vLLM was
    started, where it differs from the defaults (`model.Deployment`'s fields)."""
    served = tiny_served(num_blocks)
    if deployment:
        served.deployment = dataclasses.replace(served.deployment, **deployment)
    ctl = AdmissionController(CostModel(served), AdmissionSettings(**settings),
                              clock=clock or FakeClock())
    ctl.update_server(ServerState(available=True))
    return ctl


def wired_services(clock: FakeClock) -> Services:
    """The sidecar's services with a real controller and calibrator on the tiny model,
    no server: for the wiring between admission, observations and calibration."""
    services = Services(ServeSettings(upstream="http://127.0.0.1:9"), CollectorRegistry(),
                        arch=None, gpu=None, version="test")
    services.clock = clock
    services.controller = controller(clock=clock)
    services.served = tiny_served()
    return services
