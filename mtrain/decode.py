"""Greedy search over `model.encode` / `model.decode`, and batched translation of text."""

from __future__ import annotations

import torch

from mtrain.config import Config
from mtrain.data import encode_sources, pad
from mtrain.model import Transformer
from mtrain.text import normalize
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


def length_limits(src: torch.Tensor, ratio: float, cap: int) -> torch.Tensor:
    """(B, S) source ids -> (B,) output length limits: ratio × source length + 10, at most cap."""
    src_len = (src != PAD_ID).sum(dim=1).float()
    return (src_len * ratio + 10).ceil().clamp(max=cap).long()


@torch.no_grad()
def greedy(model: Transformer, src: torch.Tensor, limits: torch.Tensor) -> list[list[int]]:
    """Decode a (B, S) batch one step at a time, feeding back the most likely token.

    Each sentence ends at </s> or after limits[i] tokens; returned ids exclude <s> and </s>.
    """
    memory, src_mask = model.encode(src)  # (B, S, d_model), (B, 1, 1, S)
    batch = src.size(0)
    ys = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=src.device)  # (B, t)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    limits = limits.to(src.device)
    for step in range(1, int(limits.max()) + 1):
        logits = model.decode(ys, memory, src_mask)[:, -1]  # (B, tgt_vocab)
        next_token = logits.argmax(dim=-1).masked_fill(finished, PAD_ID)  # (B,)
        ys = torch.cat([ys, next_token[:, None]], dim=1)
        finished |= (next_token == EOS_ID) | (limits <= step)
        if finished.all():
            break
    out = []
    for row in ys[:, 1:].tolist():
        out.append([t for t in row if t not in (EOS_ID, PAD_ID)])
    return out


def translate(
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: Config,
    texts: list[str],
    device: torch.device,
) -> list[str]:
    """Translate sentences in batches of similar length; output order follows input order."""
    model.eval()
    sources = [normalize(t, cfg.data.src_lang) for t in texts]
    todo = [i for i, s in enumerate(sources) if s]  # empty lines translate to empty lines
    ids = encode_sources(tokenizer, [sources[i] for i in todo], cfg.data.max_src_len)
    order = sorted(range(len(todo)), key=lambda j: len(ids[j]))
    results = [""] * len(texts)
    size = cfg.decode.batch_size
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        src = pad([ids[j] for j in chunk]).to(device)
        limits = length_limits(src, cfg.decode.max_len_ratio, cfg.data.max_tgt_len)
        hyps = tokenizer.decode_tgt(greedy(model, src, limits))
        for j, hyp in zip(chunk, hyps):
            results[todo[j]] = hyp
    return results
