"""Example translations at every validation: examples.jsonl, the stderr lines, the choice."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from mtrain.core import config, jsonl
from mtrain.run.directory import EXAMPLES, METRICS
from mtrain.training.build import build_trainer
from mtrain.training.examples import SHORT, choose

from .synthetic import small_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A tiny run with two validations, and what it logged."""
    run = tmp_path_factory.mktemp("examples")
    cfg = small_config(corpus, max_steps=20, eval_every=10)
    logger = logging.getLogger("mtrain")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        trainer = build_trainer(cfg, run, CPU)
        trainer.run()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return run, trainer, [r.getMessage() for r in records]


def test_each_validation_writes_its_examples_with_their_attention(trained):
    run, trainer, _ = trained
    lines = jsonl.read(run / EXAMPLES)
    validations = [r for r in jsonl.read(run / METRICS) if r["event"] == "validation"]
    assert [r["step"] for r in lines] == [r["step"] for r in validations] == [10, 20]
    assert [r["minutes"] for r in lines] == [r["minutes"] for r in validations]
    sources = [e.source for e in trainer.validator.examples]
    assert sources[0] == "我是谁" and len(sources) == 1 + 3
    for record in lines:
        assert record["event"] == "validation"
        assert [e["source"] for e in record["examples"]] == sources
        for example in record["examples"]:
            assert set(example) == {
                "source",
                "reference",
                "translation",
                "src_pieces",
                "tgt_pieces",
                "attention",
            }
            src, tgt = example["src_pieces"], example["tgt_pieces"]
            assert src[-1] == "</s>"
            attention = torch.tensor(example["attention"])
            model = trainer.validator.cfg.model
            n_layers, n_heads = model.n_decoder_layers, model.n_heads
            assert attention.shape == (n_layers, n_heads, len(tgt), len(src))
            # Each output piece's weights over the source pieces sum to 1 (3 decimals each).
            sums = attention.sum(dim=-1)
            assert torch.allclose(sums, torch.ones_like(sums), atol=0.002 * len(src))


def test_dev_examples_carry_their_references(trained, corpus):
    run, trainer, _ = trained
    lines = Path(corpus["dev"]).read_text("utf-8").splitlines()
    dev = dict(line.split("\t") for line in lines)
    (record, *_) = jsonl.read(run / EXAMPLES)
    for example in record["examples"][1:]:
        assert example["reference"] == dev[example["source"]]
        assert len(trainer.data.tokenizer.encode_src([example["source"]])[0]) <= SHORT


def test_stderr_shows_one_line_per_example_after_the_validation_line(trained):
    run, _, messages = trained
    (first, *_) = jsonl.read(run / EXAMPLES)
    at = next(i for i, m in enumerate(messages) if m.startswith("step 10 "))
    shown = messages[at + 1 : at + 1 + len(first["examples"])]
    for line, example in zip(shown, first["examples"], strict=True):
        assert line.startswith(f"  {example['source']} → {example['translation']}")


def test_examples_file_is_written_as_utf8_text(trained):
    run, _, _ = trained
    first_line = (run / EXAMPLES).read_text("utf-8").splitlines()[0]
    assert "我是谁" in first_line  # readable, not \\u escapes
    assert json.loads(first_line)["examples"][0]["source"] == "我是谁"


def test_the_configured_examples_come_first_and_dev_sentences_are_short(tokenizer):
    cfg = config.Config()
    cfg.train.examples, cfg.train.dev_examples = ["一二", "三"], 2
    long = "一" * (4 * SHORT)
    dev_sources, dev_refs = (
        ["三", long, "四五", "六", long, "七"],
        [["3"], ["x"], ["45"], ["6"], ["x"], ["7"]],
    )
    chosen = choose(cfg, tokenizer, dev_sources, dev_refs)
    assert [(e.source, e.reference) for e in chosen[:2]] == [("一二", None), ("三", "3")]
    assert len(chosen) == 4
    assert all(e.source != long and e.source != "三" for e in chosen[2:])


def test_a_resumed_run_cuts_examples_back_to_its_checkpoint(corpus, tmp_path):
    build_trainer(small_config(corpus, max_steps=13, eval_every=10), tmp_path, CPU).run()
    with (tmp_path / EXAMPLES).open("a", encoding="utf-8") as f:  # written after last.pt
        f.write(json.dumps({"event": "validation", "step": 25, "minutes": 1.0, "examples": []}))
        f.write("\n")
    cfg = small_config(corpus, max_steps=30, eval_every=10)
    build_trainer(cfg, tmp_path, CPU, resume=True).run()
    assert [r["step"] for r in jsonl.read(tmp_path / EXAMPLES)] == [10, 13, 20, 30]


@pytest.mark.parametrize("value", ["我是谁", [""], [3], ["  "]])
def test_examples_must_be_a_list_of_sentences(value):
    with pytest.raises(config.ConfigError, match=r"train\.examples: expected a list of sentences"):
        config.from_dict({"train": {"examples": value}})
