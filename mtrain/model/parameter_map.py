"""The model as the textbook names its parts, with parameter counts (tied matrices once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from mtrain.model.transformer import (
    DecoderLayer,
    EncoderLayer,
    NoPositions,
    PeekingMask,
    Transformer,
    WithoutLayerNorm,
    WithoutResidual,
)


@dataclass
class Part:
    depth: int  # nesting level: 0 is the whole model
    name: str  # the textbook's name
    module: str  # attribute path inside Transformer ("" for the whole model)
    shape: str  # what it maps, in words
    parameters: int = 0  # parameters first registered here: a tied matrix counts once
    tied_to: str = ""  # the part that owns a matrix this part uses too (counted there)
    shared_with: list[str] = field(default_factory=list)  # parts that use this part's matrix


def _connection(module: nn.Module, d: int) -> tuple[str, str]:
    """The name and shape of the connection around a sublayer."""
    norm = f"LayerNorm({d}), " + ("pre-norm" if module.pre_norm else "post-norm")
    if isinstance(module, WithoutResidual):
        return "norm, no residual", norm
    if isinstance(module, WithoutLayerNorm):
        return "add, no LayerNorm", "residual connection only"
    return "add & norm", norm


def _layer_parts(layer: nn.Module, prefix: str, d: int, d_ff: int, mask: str):
    """(name, module path, shape) of each sublayer of an encoder or decoder layer, in order."""
    attn = layer.self_attn
    unscaled = ", scores unscaled" if attn.scale != attn.d_head**-0.5 else ""
    attention = f"{attn.n_heads} heads × {attn.d_head}{unscaled}"
    if isinstance(layer, EncoderLayer):
        subs = [("self-attention", "self_attn", attention)]
    else:
        assert isinstance(layer, DecoderLayer)
        subs = [
            ("masked self-attention", "self_attn", f"{attention}, {mask}"),
            ("cross-attention", "cross_attn", f"{attention}, keys/values: encoder"),
        ]
    subs.append(("feed-forward", "feed_forward", f"{d} → {d_ff} → {d}, ReLU"))
    for i, (name, attr, shape) in enumerate(subs):
        yield name, f"{prefix}.{attr}", shape
        connection, shape = _connection(layer.residuals[i], d)
        yield connection, f"{prefix}.residuals.{i}", shape


def parts(model: Transformer) -> list[Part]:
    """Every textbook part of `model`, in reading order, with its own parameter count."""
    d = model.src_embed.tokens.embedding_dim
    first = (model.encoder.layers or model.decoder.layers)[0]
    d_ff = first.feed_forward.linear1.out_features
    pre = first.residuals[0].pre_norm
    peek = isinstance(model.decoder_mask, PeekingMask)
    mask = "look-ahead mask in decoding, none in training" if peek else "look-ahead mask"
    src_vocab, tgt_vocab = (
        model.src_embed.tokens.num_embeddings,
        model.tgt_embed.tokens.num_embeddings,
    )
    max_len = model.max_len
    found = [Part(0, "Transformer", "", f"d_model {d}, {'pre' if pre else 'post'}-norm")]

    def add(depth: int, name: str, module: str, shape: str) -> None:
        found.append(Part(depth, name, module, shape))

    for side, stack, vocab in (
        ("encoder", model.encoder, src_vocab),
        ("decoder", model.decoder, tgt_vocab),
    ):
        embed = "src_embed" if side == "encoder" else "tgt_embed"
        word = "source" if side == "encoder" else "target"
        add(1, f"{word} embedding", f"{embed}.tokens", f"{vocab} × {d}, scaled by √{d}")
        positions = getattr(model, embed).positions
        shape = "none" if isinstance(positions, NoPositions) else f"{max_len} × {d}"
        add(1, f"{word} positional encoding", f"{embed}.positions", f"{shape}, {positions.kind}")
        n = len(stack.layers)
        add(1, f"{side} ({n} layer{'s' if n != 1 else ''})", side, "")
        for i, layer in enumerate(stack.layers):
            add(2, f"{side} layer {i + 1}", f"{side}.layers.{i}", "")
            for name, path, shape in _layer_parts(layer, f"{side}.layers.{i}", d, d_ff, mask):
                add(3, name, path, shape)
        if isinstance(stack.norm, nn.LayerNorm):
            add(2, f"final LayerNorm of the {side}", f"{side}.norm", f"LayerNorm({d})")
    add(
        1,
        "output projection",
        "output_projection",
        f"{d} → {tgt_vocab} logits, softmax in the loss",
    )
    _count(model, found)
    return found


def _count(model: Transformer, found: list[Part]) -> None:
    """Fill in each part's parameters; a shared tensor counts in the part that registered it."""
    owner = {id(p): name for name, p in model.named_parameters()}  # first name of each tensor
    by_module = {part.module: part for part in found}

    def part_of(param_name: str) -> Part:
        path = param_name.rsplit(".", 1)[0]
        while path not in by_module:
            path = path.rsplit(".", 1)[0] if "." in path else ""
        return by_module[path]

    for part in found:
        module = model.get_submodule(part.module) if part.module else model
        for name, p in module.named_parameters(prefix=part.module, remove_duplicate=False):
            name = name.lstrip(".")
            if owner[id(p)] == name:
                part.parameters += p.numel()
            elif part_of(name) is part:  # this part's own slot holds a tensor owned elsewhere
                part.tied_to = part_of(owner[id(p)]).name
                part_of(owner[id(p)]).shared_with.append(part.name)


def total(found: list[Part]) -> int:
    """Parameters of the whole model: the count of its top part."""
    return found[0].parameters


def render(found: list[Part]) -> list[str]:
    """The parts as indented lines: name, what it maps, parameter count, tie."""
    width = max(2 * p.depth + len(p.name) for p in found) + 2
    shape_width = max(len(p.shape) for p in found) + 2
    lines = []
    for p in found:
        tie = f"  tied: the {p.tied_to}'s matrix" if p.tied_to else ""
        if p.shared_with:
            tie = f"  tied: also the {' and the '.join(p.shared_with)}"
        label = "  " * p.depth + p.name
        lines.append(f"{label:<{width}}{p.shape:<{shape_width}}{p.parameters:>12,}{tie}")
    return lines
