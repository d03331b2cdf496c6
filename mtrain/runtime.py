"""The one place that picks the device, seeds every generator and sets numeric precision."""

from __future__ import annotations

import random
from contextlib import AbstractContextManager, nullcontext

import torch


def pick_device(name: str = "auto") -> torch.device:
    """Return CUDA when present (or when asked for), else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def set_seed(seed: int) -> None:
    """Seed Python's, torch's and every CUDA device's generators."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def setup_precision(device: torch.device) -> None:
    """Allow TF32 matrix multiplies on GPUs that have them; a no-op on the CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast(device: torch.device) -> AbstractContextManager:
    """Mixed precision on CUDA (bf16 where supported, else fp16); full fp32 on the CPU."""
    if device.type != "cuda":
        return nullcontext()
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.autocast("cuda", dtype=dtype)


def needs_grad_scaler(device: torch.device) -> bool:
    """fp16 autocast needs loss scaling; bf16 and fp32 do not."""
    return device.type == "cuda" and not torch.cuda.is_bf16_supported()
