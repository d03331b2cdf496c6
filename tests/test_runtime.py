import os
import subprocess
import sys

import pytest
import torch

from mtrain.core import runtime

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "caps, expected",
    [
        ({"avx512_bf16": True, "amx_bf16": False}, torch.bfloat16),
        ({"avx512_bf16": False, "amx_bf16": True}, torch.bfloat16),
        ({"avx512_bf16": False, "amx_bf16": False, "avx2": True}, None),
        ({"architecture": "arm64", "bf16": True}, None),  # ARM's bf16: not measured here
    ],
)
def test_auto_precision_on_the_cpu_is_bf16_only_where_it_multiplies_bf16_natively(
    monkeypatch, caps, expected
):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert runtime.mixed_precision(CPU, "auto") is expected
    assert runtime.mixed_precision(CPU, "fp32") is None


def test_auto_precision_on_the_cpu_is_fp32_where_pytorch_cannot_list_its_capabilities(
    monkeypatch,
):
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert runtime.mixed_precision(CPU, "auto") is None


# Frees 64 blocks of 4 MB from the middle of the heap, each behind a small live block that keeps
# glibc from merging it into the top, then prints the resident set (MB) before and after.
FRAGMENTED_HEAP = """
import sys, torch
from pathlib import Path
from mtrain.core import runtime

def resident_mb():
    status = Path("/proc/self/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) / 1024

runtime.configure(torch.device("cpu"))
blocks = []
for _ in range(64):
    blocks.append(bytearray(4 << 20))  # written: its pages are resident
    blocks.append(bytearray(1 << 10))
del blocks[::2]
before = resident_mb()
runtime.release_freed_memory()
print(before, resident_mb())
"""


@pytest.mark.skipif(runtime._glibc() is None, reason="glibc's malloc_trim is Linux-only")
def test_release_freed_memory_gives_the_free_pages_of_a_fragmented_heap_back():
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, check=True
    ).stdout
    before, after = map(float, out.split())
    assert before - after > 200  # of the 256 MB freed; never trimmed without the call


def test_on_the_cpu_onednn_keeps_few_kernels_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    runtime.configure(torch.device("cpu"))
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(runtime.ONEDNN_KERNELS_KEPT)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    runtime.configure(torch.device("cpu"))
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
