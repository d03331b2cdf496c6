"""The CUDA path against the CPU's: training, decoding, checkpoints, translation, serving and
running out of memory. Marked `gpu` and skipped without a CUDA GPU; scripts/gpu_check.py runs
them (`pytest -m gpu`). MTRAIN_GPU_RUN may name a trained run to translate with (the check's
own base-gpu run); without it the tiny session run is used."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch

from mtrain.core import config
from mtrain.data.pairs import Batch, group_references, read_parallel
from mtrain.decoding.search import beam_search, greedy
from mtrain.decoding.translator import Translator
from mtrain.run.directory import load_checkpoint, load_run
from mtrain.training.build import build_trainer
from mtrain.training.trainer import Update

from .synthetic import REPO, overrides, small_model
from .test_decode import VOCAB, sources
from .test_serve import Served

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CPU = torch.device("cpu")
CUDA = torch.device("cuda")
# Relative tolerances of the CUDA update against the CPU's: fp32 on CUDA multiplies in TF32
# (runtime.configure), a 10-bit mantissa; bf16 autocast an 8-bit one, against fp32 or bf16.
LOSS_RTOL = {"fp32": 2e-3, "auto": 2e-2}
GRAD_RTOL = {"fp32": 1e-2, "auto": 6e-2}  # of the gradient's norm


@pytest.fixture
def exact_fp32(monkeypatch):
    """fp32 matrix multiplies in fp32, not TF32, as on the CPU."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def tiny(corpus, **train_keys) -> config.Config:
    cfg = config.load(REPO / "configs" / "tiny.yaml", [*overrides(corpus, **train_keys)])
    cfg.model.dropout = 0.0  # the same function on both devices
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_one_update_on_cuda_equals_the_cpus(corpus, tmp_path, precision):
    trainers = {}
    for device in (CPU, CUDA):
        (tmp_path / device.type).mkdir()
        cfg = tiny(corpus, precision=precision)
        trainers[device.type] = build_trainer(cfg, tmp_path / device.type, device)
    cpu, cuda = trainers["cpu"], trainers["cuda"]
    for a, b in zip(cpu.model.parameters(), cuda.model.parameters()):
        assert torch.equal(a, b.cpu())  # the same initial weights
    update = next(cpu.data.updates(cpu.group, 1))
    loss_cpu = float(cpu.update_step(update))
    loss_cuda = float(cuda.update_step(update))
    assert loss_cuda == pytest.approx(loss_cpu, rel=LOSS_RTOL[precision])
    for (name, a), b in zip(cpu.model.named_parameters(), cuda.model.parameters()):
        error = (a.grad - b.grad.cpu()).norm() / a.grad.norm().clamp_min(1e-12)
        assert error < GRAD_RTOL[precision], (name, float(error))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_and_uncached_greedy_agree_and_beam_of_one_is_greedy_on_cuda(exact_fp32, seed):
    model = small_model(VOCAB, VOCAB, seed=seed).to(CUDA)
    src, limits = sources().to(CUDA), torch.tensor([12, 12, 12], device=CUDA)
    cached = greedy(model, src, limits)
    assert cached == greedy(model, src, limits, use_cache=False)
    beam = beam_search(model, src, limits, beam_size=1, alpha=0.6)
    assert [h[0].tokens for h in beam] == cached
    on_cpu = small_model(VOCAB, VOCAB, seed=seed)
    assert cached == greedy(on_cpu, sources(), limits.cpu())


@pytest.mark.parametrize(("first", "then"), [(CUDA, CPU), (CPU, CUDA)])
def test_a_checkpoint_resumes_on_the_other_device(corpus, tmp_path, first, then):
    build_trainer(tiny(corpus, max_steps=6, eval_every=3), tmp_path, first).run()
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 6
    resumed = build_trainer(tiny(corpus, max_steps=9, eval_every=3), tmp_path, then, resume=True)
    assert resumed.step == 6
    resumed.run()
    state = load_checkpoint(tmp_path / "last.pt")
    assert state["step"] == 9
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def translation_run(run_dir: Path) -> Path:
    """The run to translate with: MTRAIN_GPU_RUN's, else the session's tiny one."""
    return Path(os.environ.get("MTRAIN_GPU_RUN") or run_dir)


def test_translate_on_cuda_equals_the_cpu_on_200_dev_sentences(run_dir, exact_fp32, capsys):
    """Greedy in fp32: only near-ties may differ (other kernels sum in other orders)."""
    run = translation_run(run_dir)
    outputs = []
    for device in (CPU, CUDA):
        loaded = load_run(run, device)
        cfg, tokenizer, model = loaded.cfg, loaded.tokenizer, loaded.model
        pairs = read_parallel(
            Path(cfg.data.dev), cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.swap_columns
        )
        texts = group_references(pairs)[0][:200]
        decode = dataclasses.replace(cfg.decode, beam_size=1)
        outputs.append(Translator(model, tokenizer, cfg, device, decode).translate(texts))
    cpu, cuda = outputs
    differ = [i for i, (a, b) in enumerate(zip(cpu, cuda)) if a != b]
    with capsys.disabled():
        print(f"\ntranslate, CUDA vs CPU: {len(differ)} of {len(cpu)} differ ({run})")
    assert len(differ) <= len(cpu) // 100, [(cpu[i], cuda[i]) for i in differ[:5]]


def test_serve_on_cuda_answers(run_dir):
    served = Served(translation_run(run_dir), "--device", "cuda")
    try:
        status, answer = served.post("/translate", {"text": ["我是谁", "你好"]})
        assert status == 200, answer
        assert len(answer["translations"]) == 2
    finally:
        status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr


def test_a_batch_too_large_for_the_gpu_is_skipped_with_one_line(corpus, tmp_path, caplog):
    trainer = build_trainer(tiny(corpus, precision="fp32"), tmp_path, CUDA)
    rows, length = 300_000, 32  # fp32 logits alone: 11.5 GB, over the 7 GB allowed below
    vocab = min(trainer.data.tokenizer.src_vocab_size, trainer.data.tokenizer.tgt_vocab_size)
    ids = torch.randint(4, vocab, (rows, length))
    huge = Update.of([Batch(ids, ids, ids)])
    torch.cuda.set_per_process_memory_fraction(0.05)
    try:
        with caplog.at_level(logging.WARNING):
            assert trainer.update_step(huge) is None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert trainer.skipped == 1 and trainer.step == 0
    (line,) = [r.getMessage() for r in caplog.records if "skipped the update" in r.getMessage()]
    assert "out of memory" in line and "\n" not in line
    assert trainer.update_step(next(trainer.data.updates(trainer.group, 1))) is not None
    assert trainer.step == 1
