"""The one place that picks the device, seeds every generator and sets numeric precision."""

from __future__ import annotations

import ctypes
import functools
import os
import random
import sys
from contextlib import AbstractContextManager, nullcontext

import torch

from mtrain.core.errors import MtrainError


class DeviceError(MtrainError, ValueError):
    """A device that does not exist here; the message names it."""


def pick_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """Return CUDA when present (or when asked for), else the CPU.

    `cuda` without an index is the process's own GPU under torchrun: its LOCAL_RANK.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {name!r}: mtrain runs on cpu or cuda")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError("--device cuda: no CUDA GPU is available here; use --device cpu")
        if device.index is not None and device.index >= count:
            raise DeviceError(f"--device {name}: this machine has {count} CUDA GPU(s)")
    return device


def set_seed(seed: int) -> None:
    """Seed Python's, torch's and every CUDA device's generators."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def rng_state() -> dict:
    """This process's random generators: Python's, torch's and every CUDA device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict) -> None:
    """Put back the generators `rng_state` returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# oneDNN kernels kept for reuse (its default is 1,024). Each bf16 matrix multiply of a new shape
# builds one; on a 2-core AMD EPYC the cached ones held ~450 MB of the bf16 default's training
# (bench_train: 1,280-1,352 MB resident with 16 kept, 1,596-2,016 with 1,024) at the same
# tokens/s, and its whole-run peak fell from 2,204 to 1,569 MB (docs/benchmarks.md). A user's
# own ONEDNN_PRIMITIVE_CACHE_CAPACITY wins.
ONEDNN_KERNELS_KEPT = 16


def configure(device: torch.device) -> None:
    """On CUDA allow TF32 and pick attention kernels; on the CPU keep freed memory for reuse
    and few oneDNN kernels. Call it before the first bf16 matrix multiply: oneDNN reads its
    cache's capacity then."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # cuDNN's attention builds a plan for every new batch shape (~0.4 s on an H200), and
        # token batches rarely repeat a shape; the other fused kernels need no such step.
        torch.backends.cuda.enable_cudnn_sdp(False)
    else:
        _keep_freed_memory()
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNELS_KEPT))


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc on Linux; None elsewhere (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _keep_freed_memory() -> None:
    """Stop glibc from returning large freed blocks to the kernel.

    By default every tensor over a few MB is a fresh mmap, so each training step faults in and
    zeroes its activations again: measured at 110k page faults/s and half the CPU time in the
    kernel. Serving all sizes from the heap, and never trimming it, removes that;
    `release_freed_memory` gives the heap's free pages back now and then.
    """
    if (libc := _glibc()) is None:
        return
    m_trim_threshold, m_mmap_max = -1, -4
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 1 << 30)


def release_freed_memory() -> None:
    """Give the kernel back the pages of every free block in the heap (glibc's malloc_trim).

    A heap that is never trimmed fragments when a run allocates many sizes (validation's
    decoding meets a new batch shape at every step, bf16 adds weight copies and kernel
    buffers): its free but resident pages grew a bf16 default run from 1.9 GB at 3 minutes to
    3.1 GB at 29. The cost is re-touching the pages training uses again.
    """
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def mixed_precision(device: torch.device, precision: str) -> torch.dtype | None:
    """The dtype autocast should compute in for `precision` ("auto" or "fp32"); None for fp32.

    "auto" means bf16 on CUDA GPUs that have it, else fp16 (with loss scaling); on the CPU, bf16
    where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), else fp32. On our 2-core AMD
    EPYC (AVX512-BF16), bf16 matrix multiplies run 2-3x as fast as fp32 ones and a training
    step of the default model 1.6x as fast (attention itself stays fp32 there: `model.attention`).
    A PyTorch without `torch.cpu.get_capabilities` (older releases) cannot tell: fp32.
    """
    if precision == "fp32":
        return None
    if device.type == "cpu":
        caps = getattr(torch.cpu, "get_capabilities", dict)()
        return torch.bfloat16 if caps.get("avx512_bf16") or caps.get("amx_bf16") else None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    """Mixed precision in `dtype`, or nothing when it is None."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantization of every Linear layer, for faster CPU inference."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch announces a future move of this API to torchao
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
