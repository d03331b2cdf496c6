import pytest
import torch

from mtrain import runtime

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
