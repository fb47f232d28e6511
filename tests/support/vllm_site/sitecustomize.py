"""Loaded at start-up by the interpreters of the test suite's vLLM servers
(`tests/support/vllm_server.py` puts this directory on their PYTHONPATH unless
KVGATE_VLLM_AMX=1).

vLLM's CPU attention takes its AMX kernels when torch reports AMX tiles (bf16, blocks
of a multiple of 32 tokens). On virtual machines that advertise AMX without keeping
its state across context switches, they die now and then with SIGILL ("Fatal Python
error: Illegal instruction" in the engine core: about 1 run in 3 of a 32-sequence
request on a 2-core Firecracker VM, 2026-12-01). The test servers run vLLM's AVX-512
kernels instead; oneDNN is held below AMX by ONEDNN_MAX_CPU_ISA in the same place."""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
