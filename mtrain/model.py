"""The Transformer of "Attention Is All You Need", as plain nn.Modules: no I/O, no device choice.

Masks are boolean and broadcast over heads: True means "may attend". They are built here, in
`padding_mask` and `causal_mask`, and nowhere else.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtrain.config import ModelConfig


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, L) token ids -> (B, 1, 1, L) mask that hides padding keys."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """(1, 1, L, L) mask that lets position i attend to positions <= i only."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


class PositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal position signal of the paper to a (B, L, d_model) input."""

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float)[:, None]  # (max_len, 1)
        inv_freq = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * inv_freq)
        pe[:, 1::2] = torch.cos(position * inv_freq)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[: x.size(1)]


class Embeddings(nn.Module):
    """Token embedding scaled by sqrt(d_model), plus positional encoding, then dropout."""

    def __init__(self, vocab_size: int, d_model: int, max_len: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = PositionalEncoding(d_model, max_len)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(d_model)
        nn.init.normal_(self.tokens.weight, std=d_model**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # (B, L) -> (B, L, d_model)
        return self.dropout(self.positions(self.tokens(tokens) * self.scale))


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over n_heads subspaces; queries and keys/values may differ."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)  # keys and values in one matmul
        self.out_proj = nn.Linear(d_model, d_model)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape  # (B, L, d_model) -> (B, n_heads, L, d_head)
        return x.view(b, length, self.n_heads, self.d_head).transpose(1, 2)

    def forward(
        self, query: torch.Tensor, key_value: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        # query (B, Tq, d_model), key_value (B, Tk, d_model), mask broadcastable to (B, h, Tq, Tk)
        q = self._split_heads(self.q_proj(query))
        k, v = (self._split_heads(x) for x in self.kv_proj(key_value).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, h, Tq, d_head)
        b, _, tq, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, tq, -1))


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear, ReLU, Linear."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Residual(nn.Module):
    """Residual connection with LayerNorm: before the sublayer (pre-norm) or after (post-norm).

    As in the paper, dropout is applied to the sublayer's output before it is added.
    """

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a residual connection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads)
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff)
        self.residuals = nn.ModuleList(Residual(cfg.d_model, cfg.dropout, pre) for _ in range(2))

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.residuals[0](x, lambda y: self.self_attn(y, y, src_mask))
        return self.residuals[1](x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder output, then feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads)
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff)
        self.residuals = nn.ModuleList(Residual(cfg.d_model, cfg.dropout, pre) for _ in range(3))

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        tgt_mask: torch.Tensor,
    ) -> torch.Tensor:
        x = self.residuals[0](x, lambda y: self.self_attn(y, y, tgt_mask))
        # Queries come from the decoder, keys and values from the encoder output.
        x = self.residuals[1](x, lambda y: self.cross_attn(y, memory, src_mask))
        return self.residuals[2](x, self.feed_forward)


class Encoder(nn.Module):
    """A stack of encoder layers (with a final LayerNorm when pre-norm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.norm(x)


class Decoder(nn.Module):
    """A stack of decoder layers (with a final LayerNorm when pre-norm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        tgt_mask: torch.Tensor,
    ) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class Transformer(nn.Module):
    """Encoder-decoder Transformer; `forward` returns logits, the softmax lives in the loss."""

    def __init__(
        self,
        cfg: ModelConfig,
        src_vocab_size: int,
        tgt_vocab_size: int,
        max_len: int,
        pad_id: int,
    ):
        super().__init__()
        self.pad_id = pad_id
        self.src_embed = Embeddings(src_vocab_size, cfg.d_model, max_len, cfg.dropout)
        self.tgt_embed = Embeddings(tgt_vocab_size, cfg.d_model, max_len, cfg.dropout)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.output_projection = nn.Linear(cfg.d_model, tgt_vocab_size)
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                nn.init.xavier_uniform_(p)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) source ids -> memory (B, S, d_model) and its padding mask (B, 1, 1, S)."""
        src_mask = padding_mask(src, self.pad_id)
        return self.encoder(self.src_embed(src), src_mask), src_mask

    def decode(
        self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor
    ) -> torch.Tensor:
        """(B, T) decoder input ids -> (B, T, tgt_vocab) logits for the next token."""
        tgt_mask = padding_mask(tgt_in, self.pad_id) & causal_mask(tgt_in.size(1), tgt_in.device)
        x = self.decoder(self.tgt_embed(tgt_in), memory, src_mask, tgt_mask)
        return self.output_projection(x)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: (B, S) source, (B, T) `<s> y1..yn` -> (B, T, tgt_vocab) logits."""
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)
