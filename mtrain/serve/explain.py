"""One sentence's search as JSON: the `--trace` record and the `--attention` weights."""

from __future__ import annotations

import math
from typing import Any

import torch

from mtrain.data.tokenizer import EOS_ID, Tokenizer
from mtrain.decoding.attention import AttentionMaps, AttentionRecorder
from mtrain.decoding.trace import Tracer, TraceStep
from mtrain.decoding.translator import Source, Translator


def _weights(layers: list[torch.Tensor]) -> list[list[list[list[float]]]]:
    """Per layer, per head, the (queries, keys) weights, to 4 decimals."""
    return [w.double().round(decimals=4).tolist() for w in layers]


def _greedy_step(step: TraceStep, tokenizer: Tokenizer) -> dict[str, Any]:
    piece = tokenizer.tgt.id_to_piece
    return {
        "step": step.step,
        "input": piece(step.inputs[0]),
        "log_prob": step.log_probs[0],
        "top": [{"piece": piece(t), "id": t, "prob": p} for t, p in step.top],
        "chosen": {
            "piece": piece(step.chosen),
            "id": step.chosen,
            "prob": math.exp(step.chosen_log_prob),
        },
    }


def _beam_step(step: TraceStep, tokenizer: Tokenizer) -> dict[str, Any]:
    piece = tokenizer.tgt.id_to_piece
    candidates = []
    for c in step.candidates:
        fate = c.fate
        if fate == "finished":
            fate = "finished with </s>" if c.token == EOS_ID else "finished at the length limit"
        candidates.append(
            {
                "origin": c.origin,
                "piece": piece(c.token),
                "id": c.token,
                "token_log_prob": c.log_prob - step.log_probs[c.origin],
                "log_prob": c.log_prob,
                "fate": fate,
                "score": c.score,  # finished: after the length penalty
            }
        )
    hypotheses = [
        {"input": piece(tokens), "log_prob": log_prob}
        for tokens, log_prob in zip(step.inputs, step.log_probs)
    ]
    return {"step": step.step, "hypotheses": hypotheses, "candidates": candidates}


def _attention(maps: AttentionMaps, src: list[int], tokens: list[int], tokenizer: Tokenizer):
    """The maps with their axis labels: source pieces, decoder inputs, output pieces."""
    labels = maps.axis_labels(src, tokens, tokenizer)
    return {
        "source": labels.source,
        "decoder_input": labels.decoder_input,
        "output": labels.output,
        "encoder": _weights(maps.encoder),  # [layer][head][source][source]
        "decoder": _weights(maps.decoder),  # [layer][head][decoder input][decoder input]
        "cross": _weights(maps.cross),  # [layer][head][decoder input][source]
    }


def explain(translator: Translator, text: str, source: Source, top_k: int) -> dict[str, Any]:
    """Translate `text` (encoded as `source`) alone, recording every step and attention weight."""
    tracer, recorder = Tracer(top_k), AttentionRecorder(translator.model)
    with recorder:
        result = translator.inspect_source(source, lambda e: (tracer(e), recorder(e)))
    tokenizer = translator.tokenizer
    translations = [{"text": t.text, "score": t.score} for t in result.translations]
    answer = {
        "text": text,
        "search": "greedy" if translator.decode.beam_size == 1 else "beam",
        "translations": translations,
        "source": {"pieces": tokenizer.src.id_to_piece(result.src), "ids": result.src},
        "steps": [],
        "attention": None,
    }
    if not result.src:  # an empty line: nothing was searched
        return answer
    step = _greedy_step if answer["search"] == "greedy" else _beam_step
    answer["steps"] = [step(s, tokenizer) for s in tracer.steps[0]]
    maps = recorder.maps(result.hypotheses[0].tokens)
    answer["attention"] = _attention(maps, result.src, result.hypotheses[0].tokens, tokenizer)
    return answer
