"""The Transformer of "Attention Is All You Need", as plain nn.Modules: no I/O, no device choice.

Masks are boolean and broadcast over heads: True means "may attend". They are built here, in
`padding_mask`, `causal_mask` and `teacher_forcing_mask` (the two together), and nowhere else.

`model.variant` swaps one part of the textbook's model for another, chosen once at construction
(`variant_parts`, from core/config.py's `MODEL_VARIANTS`): each swapped part follows the textbook's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtrain.core.config import MODEL_VARIANTS, ModelConfig


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, L) token ids -> (B, 1, 1, L) mask that hides padding keys."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device, past: int = 0) -> torch.Tensor:
    """(1, 1, L, past + L) mask that lets new position i attend to positions <= past + i only."""
    ones = torch.ones(length, past + length, dtype=torch.bool, device=device)
    return ones.tril(diagonal=past)[None, None]


def teacher_forcing_mask(tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, T) decoder input ids -> (B, 1, T, T) mask of training: no padding, no look-ahead."""
    return padding_mask(tgt_in, pad_id) & causal_mask(tgt_in.size(1), tgt_in.device)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Fused dot-product attention, scores times `scale` (None: 1/sqrt(d_head)):
    (B, h, Tq, d_head) queries over (B, h, Tk, d_head).

    On the CPU it computes in fp32 even under bf16 autocast: there the bf16 kernel's backward
    is so much slower than the fp32 one that it costs more than bf16 saves in the projections.
    """
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            q, k, v = q.float(), k.float(), v.float()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class _KeepAndScale(torch.autograd.Function):
    """x * keep * scale, with a backward of one product too (where + mul takes two each way)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.mul(x, keep).mul_(scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return torch.mul(grad, keep).mul_(ctx.scale), None, None


class Dropout(nn.Module):
    """Inverted dropout, as nn.Dropout, that draws its CPU masks 16 bits at a time.

    On the CPU, nn.Dropout draws one random number per element, a large part of a training
    step; this draws 64-bit numbers and cuts each into four 16-bit ones, a quarter of the draws.
    The rate is rounded to a multiple of 1/65536. On other devices it is nn.Dropout's fused
    kernel.
    """

    def __init__(self, p: float):
        super().__init__()
        self.set_rate(p)

    def set_rate(self, p: float) -> None:
        self.p = p
        self.threshold = round(p * 2**16) - 2**15  # keep a position if its int16 >= threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        n = x.numel()
        bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
        keep = bits.view(torch.int16)[:n].view(x.shape) >= self.threshold
        # in x's dtype: a bool mask would be copied to it at each product, forward and backward
        return _KeepAndScale.apply(x, keep.to(x.dtype), 1 / (1 - self.p))


class PositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal position signal of the paper to a (B, L, d_model) input."""

    kind = "fixed sinusoids"

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.max_len = max_len
        position = torch.arange(max_len, dtype=torch.float)[:, None]  # (max_len, 1)
        inv_freq = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * inv_freq)
        pe[:, 1::2] = torch.cos(position * inv_freq)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return x + self.pe[offset : offset + x.size(1)]


class LearnedPositions(nn.Module):
    """learned-positions: adds a trained vector per position (as BERT, or fairseq's option)."""

    kind = "learned"

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.table = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.table.weight, std=d_model**-0.5)  # as fairseq's

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return x + self.table.weight[offset : offset + x.size(1)]  # (L, d_model) broadcast


class NoPositions(nn.Module):
    """no-positions: adds nothing, so that the encoder sees the source as a bag of pieces. The
    decoder still sees order through its look-ahead mask (each position attends to those before
    it only)."""

    kind = "word order invisible"

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.max_len = max_len

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return x


class Embeddings(nn.Module):
    """Token embedding scaled by sqrt(d_model), plus positional encoding, then dropout."""

    def __init__(self, vocab_size: int, d_model: int, positions: nn.Module, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = positions
        self.dropout = Dropout(dropout)
        self.scale = math.sqrt(d_model)
        nn.init.normal_(self.tokens.weight, std=d_model**-0.5)

    def forward(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        # (B, L) ids at positions offset.. -> (B, L, d_model)
        return self.dropout(self.positions(self.tokens(tokens) * self.scale, offset))


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over n_heads subspaces; queries and keys/values may differ.

    With `keep_weights` set it computes the softmax explicitly and keeps the attention weights
    of its last call in `weights` (B, n_heads, Tq, Tk), for looking inside the model; otherwise
    it calls the fused `attention`, which never forms them.
    """

    def __init__(self, d_model: int, n_heads: int, scaled: bool = True):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        # Scores divided by sqrt(d_head), lest large dot products saturate the softmax; no-scale:
        # the raw dot products.
        self.scale = self.d_head**-0.5 if scaled else 1.0
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)  # keys and values in one matmul
        self.out_proj = nn.Linear(d_model, d_model)
        self.keep_weights = False
        self.weights: torch.Tensor | None = None

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape  # (B, L, d_model) -> (B, n_heads, L, d_head)
        return x.view(b, length, self.n_heads, self.d_head).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Tk, d_model) -> keys and values, each (B, n_heads, Tk, d_head)."""
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        return self._split_heads(k), self._split_heads(v)

    def attend(
        self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """query (B, Tq, d_model) over projected keys/values; mask broadcasts to (B, h, Tq, Tk)."""
        q = self._split_heads(self.q_proj(query))
        if self.keep_weights:
            scores = q @ k.transpose(-2, -1) * self.scale  # (B, h, Tq, Tk)
            if mask is not None:  # hidden keys get exactly zero weight
                scores = scores.masked_fill(~mask, float("-inf"))
            self.weights = scores.softmax(dim=-1)
            out = self.weights @ v
        else:
            out = attention(q, k, v, mask, self.scale)  # (B, h, Tq, d_head)
        b, _, tq, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, tq, -1))

    def forward(
        self, query: torch.Tensor, key_value: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        return self.attend(query, *self.keys_values(key_value), mask)


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear, ReLU, Linear."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))  # (B, L, d_model) via (B, L, d_ff)


class Residual(nn.Module):
    """Residual connection with LayerNorm: before the sublayer (pre-norm) or after (post-norm).

    As in the paper, dropout is applied to the sublayer's output before it is added.
    """

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class WithoutResidual(Residual):
    """no-residual: the sublayer's output replaces its input instead of being added to it."""

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return self.dropout(sublayer(self.norm(x)))
        return self.norm(self.dropout(sublayer(x)))


class WithoutLayerNorm(nn.Module):
    """no-layernorm: the residual connection alone, x + dropout(sublayer(x)), pre or post."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm  # recorded only: with no LayerNorm, pre and post are one

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        return x + self.dropout(sublayer(x))


class LookAheadMask(nn.Module):
    """The decoder self-attention's mask under teacher forcing: no padding, no look-ahead."""

    def forward(self, tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
        return teacher_forcing_mask(tgt_in, pad_id)  # (B, 1, T, T)


class PeekingMask(LookAheadMask):
    """peek: in training, padding only, so each position sees the targets it must predict.

    In evaluation (validation loss, `score`) the textbook's mask: decoding only ever has the
    past, and a model is measured as it decodes. So cached and uncached decoding agree.
    """

    def forward(self, tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
        if self.training:
            return padding_mask(tgt_in, pad_id)  # (B, 1, 1, T)
        return super().forward(tgt_in, pad_id)


@dataclass(frozen=True)
class Parts:
    """The parts a variant may swap: the textbook's by default."""

    positions: type[nn.Module] = PositionalEncoding
    scaled: bool = True  # attention scores divided by sqrt(d_head)
    connection: type[nn.Module] = Residual  # around each sublayer
    final_norm: bool = True  # a LayerNorm after each stack, when pre-norm
    decoder_mask: type[LookAheadMask] = LookAheadMask  # of the decoder's self-attention


POSITIONS = {"sinusoidal": PositionalEncoding, "learned": LearnedPositions, "none": NoPositions}
CONNECTIONS = {  # (residual, layernorm) -> the connection around each sublayer
    (True, True): Residual,
    (False, True): WithoutResidual,
    (True, False): WithoutLayerNorm,
}


def variant_parts(variant: str) -> Parts:
    """The parts of model.variant `variant`, as core/config.py's MODEL_VARIANTS declares it."""
    v = MODEL_VARIANTS[variant]
    return Parts(
        positions=POSITIONS[v.positions],
        scaled=v.scaled,
        connection=CONNECTIONS[v.residual, v.layernorm],
        final_norm=v.layernorm,
        decoder_mask=LookAheadMask if v.look_ahead else PeekingMask,
    )


def final_norm(cfg: ModelConfig) -> nn.Module:
    """The LayerNorm that ends a pre-norm stack (none for post-norm, or without LayerNorm)."""
    if cfg.norm == "pre" and variant_parts(cfg.variant).final_norm:
        return nn.LayerNorm(cfg.d_model)
    return nn.Identity()


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a residual connection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre, parts = cfg.norm == "pre", variant_parts(cfg.variant)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, parts.scaled)
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff)
        self.residuals = nn.ModuleList(
            parts.connection(cfg.d_model, cfg.dropout, pre) for _ in range(2)
        )

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.residuals[0](x, lambda y: self.self_attn(y, y, src_mask))
        return self.residuals[1](x, self.feed_forward)


@dataclass
class LayerCache:
    """One decoder layer's keys and values: cross-attention's, computed once from the encoder
    output, and self-attention's for every position decoded so far.

    Self-attention's live in buffers allocated once for the longest output, and each step
    writes its position into them: growing them with torch.cat would copy the whole prefix at
    every step.
    """

    cross_k: torch.Tensor  # (B, h, S, d_head)
    cross_v: torch.Tensor
    self_k: torch.Tensor  # (B, h, max_len, d_head); positions < length are written
    self_v: torch.Tensor
    length: int = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new positions' keys and values (B, h, T, d_head); return all so far."""
        end = self.length + k.size(2)
        if end > self.self_k.size(2):
            raise ValueError(f"the cache holds {self.self_k.size(2)} positions, not {end}")
        self.self_k[:, :, self.length : end] = k
        self.self_v[:, :, self.length : end] = v
        self.length = end
        return self.self_k[:, :, :end], self.self_v[:, :, :end]  # (B, h, length, d_head)

    def select(self, rows: torch.Tensor) -> LayerCache:
        """Keep, reorder or repeat batch rows, e.g. to drop finished sentences."""
        cross_k, cross_v = self.cross_k.index_select(0, rows), self.cross_v.index_select(0, rows)
        return LayerCache(cross_k, cross_v, *self._selected_self(rows), self.length)

    def reorder(self, rows: torch.Tensor) -> LayerCache:
        """`select` where each row takes another row of the same sentence (a beam's
        hypotheses): the cross-attention keys and values, the same for all of them, stay."""
        return LayerCache(self.cross_k, self.cross_v, *self._selected_self(rows), self.length)

    def _selected_self(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New self-attention buffers holding `rows`: only their written positions are copied."""
        k = self.self_k.new_empty((rows.numel(), *self.self_k.shape[1:]))  # (R, h, max_len, d)
        v = self.self_v.new_empty(k.shape)
        torch.index_select(self.self_k[:, :, : self.length], 0, rows, out=k[:, :, : self.length])
        torch.index_select(self.self_v[:, :, : self.length], 0, rows, out=v[:, :, : self.length])
        return k, v


@dataclass
class DecoderCache:
    """All that incremental decoding keeps between steps: each decoder layer's keys and values."""

    layers: list[LayerCache]

    @property
    def length(self) -> int:
        """How many positions have been decoded."""
        return self.layers[0].length

    def select(self, rows: torch.Tensor) -> DecoderCache:
        """`LayerCache.select` in every layer."""
        return DecoderCache([c.select(rows) for c in self.layers])

    def reorder(self, rows: torch.Tensor) -> DecoderCache:
        """`LayerCache.reorder` in every layer."""
        return DecoderCache([c.reorder(rows) for c in self.layers])


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder output, then feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre, parts = cfg.norm == "pre", variant_parts(cfg.variant)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, parts.scaled)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, parts.scaled)
        self.feed_forward = FeedForward(cfg.d_model, cfg.d_ff)
        self.residuals = nn.ModuleList(
            parts.connection(cfg.d_model, cfg.dropout, pre) for _ in range(3)
        )

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        tgt_mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, d_model) attends to itself and to memory (B, S, d_model), the encoder output.

        With a cache (incremental decoding) x holds only the newest positions: their keys and
        values join those of earlier positions in the cache, and the encoder output's keys and
        values come from the cache, computed once for the whole search.
        """

        def self_attention(y: torch.Tensor) -> torch.Tensor:
            if cache is None:  # a module call, so that hooks on self_attn see training's masks
                return self.self_attn(y, y, tgt_mask)
            k, v = cache.extend(*self.self_attn.keys_values(y))  # (B, h, past + T, d_head)
            return self.self_attn.attend(y, k, v, tgt_mask)

        def cross_attention(y: torch.Tensor) -> torch.Tensor:
            # Queries come from the decoder, keys and values from the encoder output.
            if cache is None:
                return self.cross_attn(y, memory, src_mask)
            return self.cross_attn.attend(y, cache.cross_k, cache.cross_v, src_mask)

        x = self.residuals[0](x, self_attention)
        x = self.residuals[1](x, cross_attention)
        return self.residuals[2](x, self.feed_forward)


class Encoder(nn.Module):
    """A stack of encoder layers (with a final LayerNorm when pre-norm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.norm = final_norm(cfg)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.norm(x)


class Decoder(nn.Module):
    """A stack of decoder layers (with a final LayerNorm when pre-norm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.norm = final_norm(cfg)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        tgt_mask: torch.Tensor | None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, src_mask, tgt_mask, None if cache is None else cache.layers[i])
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
        joint_vocab: bool = False,
    ):
        super().__init__()
        self.pad_id, self.max_len = pad_id, max_len
        parts = variant_parts(cfg.variant)
        d = cfg.d_model
        self.src_embed = Embeddings(src_vocab_size, d, parts.positions(d, max_len), cfg.dropout)
        self.tgt_embed = Embeddings(tgt_vocab_size, d, parts.positions(d, max_len), cfg.dropout)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.decoder_mask = parts.decoder_mask()  # builds the tgt_mask of teacher forcing
        self.output_projection = nn.Linear(cfg.d_model, tgt_vocab_size)
        if cfg.tie_embeddings:  # one (vocab, d_model) matrix embeds and scores target tokens
            self.output_projection.weight = self.tgt_embed.tokens.weight
            if joint_vocab:
                self.src_embed.tokens.weight = self.tgt_embed.tokens.weight
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                nn.init.xavier_uniform_(p)

    def set_dropout(self, p: float) -> None:
        """Train on with dropout rate `p` everywhere (a run's budget may choose it)."""
        for module in self.modules():
            if isinstance(module, Dropout):
                module.set_rate(p)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) source ids -> memory (B, S, d_model) and its padding mask (B, 1, 1, S)."""
        src_mask = padding_mask(src, self.pad_id)
        return self.encoder(self.src_embed(src), src_mask), src_mask

    def start_cache(self, memory: torch.Tensor, max_len: int | None = None) -> DecoderCache:
        """An empty decoder cache for up to `max_len` positions (default: all the model has),
        holding each layer's cross-attention keys and values."""
        max_len = max_len or self.max_len
        layers = []
        for layer in self.decoder.layers:
            k, v = layer.cross_attn.keys_values(memory)  # (B, h, S, d_head)
            shape = (k.size(0), k.size(1), max_len, k.size(3))  # (B, h, max_len, d_head)
            layers.append(LayerCache(k, v, k.new_empty(shape), v.new_empty(shape)))
        return DecoderCache(layers)

    def decode(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """(B, T) decoder input ids -> (B, T, tgt_vocab) logits for the next token."""
        return self.output_projection(self.decoder_states(tgt_in, memory, src_mask, cache))

    def decoder_states(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """(B, T) decoder input ids -> (B, T, d_model), the decoder's output before projection.

        Without a cache (teacher forcing) the decoder reads all of `tgt_in` at once under the
        look-ahead mask (peek: none in training). With a cache (from `start_cache`), `tgt_in`
        continues the tokens decoded so far, and the cache grows by T positions; those earlier
        tokens must not be padding.
        """
        length = tgt_in.size(1)
        if cache is None:
            past = 0
            tgt_mask = self.decoder_mask(tgt_in, self.pad_id)
        else:
            past = cache.length
            # One new position may attend to everything before it: no mask needed.
            tgt_mask = causal_mask(length, tgt_in.device, past) if length > 1 else None
        return self.decoder(self.tgt_embed(tgt_in, offset=past), memory, src_mask, tgt_mask, cache)

    def record_attention(self, on: bool = True) -> None:
        """Make every attention sublayer keep its weights from its last call (or stop)."""
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                module.keep_weights, module.weights = on, None

    def attention_weights(self) -> dict[str, list[torch.Tensor]]:
        """The weights kept since `record_attention`, one (B, h, Tq, Tk) tensor per layer."""
        return {
            "encoder": [layer.self_attn.weights for layer in self.encoder.layers],
            "decoder": [layer.self_attn.weights for layer in self.decoder.layers],
            "cross": [layer.cross_attn.weights for layer in self.decoder.layers],
        }

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: (B, S) source, (B, T) `<s> y1..yn` -> (B, T, tgt_vocab) logits."""
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)
