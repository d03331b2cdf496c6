"""The Python API: `mtrain.load` and its TranslationModel, `mtrain.score` by teacher forcing,
`mtrain.train`, and errors as exceptions with the command line's message."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtrain
from mtrain.data.pairs import read_lines
from mtrain.data.tokenizer import BOS_ID, EOS_ID
from mtrain.decoding.score import score_ids
from mtrain.decoding.search import allowed
from mtrain.decoding.trace import Tracer

from .console import REPO
from .console import mtrain as run_mtrain

DEV = REPO / "data" / "tatoeba" / "dev.tsv"


def dev_sentences(n: int) -> list[str]:
    return [line.split("\t")[1] for line in read_lines(DEV)[:n]]


@pytest.fixture(scope="module")
def model(run_dir: Path) -> mtrain.TranslationModel:
    return mtrain.load(run_dir, device="cpu")


def cli_translations(run: Path, engine: str, sentences: list[str], tmp_path: Path) -> list[str]:
    source = tmp_path / f"{engine}.zh"
    source.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    args = ["translate", "--run", str(run), "--engine", engine, "--input", str(source)]
    result = run_mtrain(*args, "--device", "cpu")
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_importing_mtrain_loads_no_torch() -> None:
    code = "import sys, mtrain; help(mtrain); print(any(m == 'torch' for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"
    assert "mtrain.load" in result.stdout and "FUNCTIONS" in result.stdout


def test_translate_equals_the_command_on_200_dev_sentences(model, run_dir, tmp_path) -> None:
    sentences = dev_sentences(200)
    ours = model.translate(sentences)
    assert ours == cli_translations(run_dir, "mtrain", sentences, tmp_path)
    assert model.translate(sentences[0]) == ours[0]  # a string for a string


def test_translate_with_ctranslate2_equals_the_command(run_dir, tmp_path) -> None:
    pytest.importorskip("ctranslate2")
    from mtrain.export.converter import export_run

    out = export_run(run_dir, tmp_path / "ct2")
    model = mtrain.load(out, engine="ctranslate2", device="cpu")
    assert model.engine == "ctranslate2" and "ctranslate2" in repr(model)
    sentences = dev_sentences(200)
    assert model.translate(sentences) == cli_translations(out, "ctranslate2", sentences, tmp_path)
    with pytest.raises(mtrain.MtrainError, match="needs --engine mtrain"):
        model.score("我是谁", "Who am I?")


def test_nbest_and_options(model) -> None:
    best = model.translate("我是谁", beam=3)
    nbest = model.translate("我是谁", beam=3, nbest=3)
    assert len(nbest) == 3 and nbest[0][0] == best
    assert all(isinstance(score, float) for _, score in nbest)
    assert [round(s, 6) for _, s in nbest] == sorted((round(s, 6) for _, s in nbest), reverse=True)
    assert model.translator.decode.beam_size == 1  # the model's own options are kept
    lists = model.translate(["我是谁", "", "今天是星期二"], beam=2, nbest=2)
    assert len(lists) == 3 and lists[1] == [("", 0.0)]


def test_repr_names_direction_size_and_checkpoint(model, run_dir) -> None:
    text = repr(model)
    assert "zh→en" in text and "M parameters" in text and "1+1 layers" in text
    assert str(run_dir / "best.pt") in text and "(step " in text
    assert model.step in (60, 120)


def teacher_forced(model, source: str, target_ids: list[int]) -> torch.Tensor:
    """The log-probabilities of `target_ids` then </s>, from one forward pass."""
    t = model.translator
    (src,) = t.sources([source])
    with torch.no_grad():
        logits = t.model(
            torch.tensor([src.ids]), torch.tensor([[BOS_ID, *target_ids]])
        )  # (1, T, V)
    log_probs = torch.log_softmax(allowed(logits), dim=-1)[0]  # (T, V)
    return log_probs.gather(1, torch.tensor([*target_ids, EOS_ID])[:, None])[:, 0]


def test_scores_are_a_teacher_forced_forward_pass(model) -> None:
    pairs = [("我是谁？", "Who am I?"), ("我是谁？", "Who is I?"), ("今天是星期二", "")]
    scores = model.score([s for s, _ in pairs], [t for _, t in pairs])
    for (source, target), score in zip(pairs, scores):
        ids = model.translator.tokenizer.encode_tgt([target])[0]
        expected = teacher_forced(model, source, ids)
        assert [p.id for p in score.pieces] == [*ids, EOS_ID]
        got = torch.tensor([p.log_prob for p in score.pieces])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert score.total == pytest.approx(float(expected.sum()), abs=1e-4)
        assert score.mean == pytest.approx(score.total / (len(ids) + 1))
        for p in score.pieces:
            assert p.top[0][1] >= p.log_prob and len(p.top) == 5
            assert (p.rank == 1) == (p.top[0][0] == p.piece)
    one = model.score("我是谁？", "Who am I?")
    assert one.total == pytest.approx(scores[0].total, abs=1e-4)  # alone or in a batch
    assert json.loads(json.dumps(one.to_dict()))["total"] == one.total


def test_scoring_greedy_output_gives_back_its_choices(model) -> None:
    """Piece by piece the log-probabilities greedy chose, and rank 1 everywhere."""
    t = model.translator
    for text in dev_sentences(20):
        tracer = Tracer(1)
        result = t.inspect(text, tracer)
        steps = tracer.steps[0]
        chosen = [s.chosen for s in steps]
        tokens = result.hypotheses[0].tokens
        ended = chosen[-1] == EOS_ID
        # Stopped at the length limit: no </s> to score, greedy never chose one.
        (pieces,) = score_ids(t, [result.src], [tokens], end=ended)
        assert [p.id for p in pieces] == chosen
        assert [p.rank for p in pieces] == [1] * len(chosen)
        got = [p.log_prob for p in pieces]
        assert got == pytest.approx([s.chosen_log_prob for s in steps], abs=1e-4)


def test_trace_and_attention_are_the_commands_data(model, capsys) -> None:
    trace = model.trace("我是谁")
    assert trace.translation == model.translate("我是谁")
    assert trace.text.startswith("source: 我是谁") and "<- chosen" in trace.text
    assert [s["step"] for s in trace.steps] == list(range(1, len(trace.steps) + 1))
    assert trace.steps[0]["input"] == ["<s>"]
    beam = model.trace("我是谁", beam=2)
    assert "candidates" in beam.steps[0] and beam.score is not None
    attention = model.attention("我是谁")
    assert len(attention.cross) == 1 and attention.cross[0].shape == (
        4,
        len(attention.output),
        len(attention.source),
    )
    assert attention.cross[0].sum(axis=-1) == pytest.approx(1.0, abs=1e-5)
    assert attention.decoder_input[0] == "<s>"
    for png in (attention._repr_png_(), trace._repr_png_(), beam._repr_png_()):
        assert png.startswith(b"\x89PNG")
    assert type(mtrain.curves(model.path)).__name__ == "Figure"
    assert type(model.curves()).__name__ == "Figure"
    assert capsys.readouterr().out == ""  # the API prints nothing


def test_errors_are_exceptions_with_the_commands_message(run_dir, tmp_path, capsys) -> None:
    missing = tmp_path / "nothing"
    missing.mkdir()
    with pytest.raises(mtrain.MtrainError) as caught:
        mtrain.load(missing)
    result = run_mtrain("translate", "--run", str(missing), "我")
    assert result.returncode == 2
    assert result.stderr == f"mtrain: error: {caught.value}\n"
    with pytest.raises(mtrain.MtrainError, match="--nbest 3 needs --beam 3"):
        mtrain.load(run_dir, device="cpu").translate("我", nbest=3)
    with pytest.raises(mtrain.MtrainError, match="no such checkpoint"):
        mtrain.load(run_dir, checkpoint="step-1.pt")
    with pytest.raises(mtrain.MtrainError, match="engine 'onnx'"):
        mtrain.load(run_dir, engine="onnx")
    with pytest.raises(mtrain.MtrainError, match="2 sources but 1 targets"):
        mtrain.load(run_dir, device="cpu").score(["我", "你"], ["I"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: -1\n", encoding="utf-8")
    with pytest.raises(mtrain.MtrainError):
        mtrain.train(bad, out=tmp_path / "run")
    assert capsys.readouterr().out == ""


def test_score_command(model, run_dir, tmp_path) -> None:
    expected = model.score(["我是谁？", "我是谁？"], ["Who am I?", "Who is I?"])
    args = ["score", "--run", str(run_dir), "--device", "cpu"]
    result = run_mtrain(*args, "我是谁？", "Who am I?", "我是谁？", "Who is I?")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [float(line.split("\t")[0]) for line in lines] == [
        pytest.approx(s.total, abs=1e-3) for s in expected
    ]
    assert lines[0].split("\t")[2].split(" ")[-1].startswith("</s>:")
    piped = run_mtrain(*args, "--json", input="我是谁？\tWho am I?\n我是谁？\tWho is I?\n")
    assert piped.returncode == 0, piped.stderr
    records = [json.loads(line) for line in piped.stdout.splitlines()]
    assert [r["total"] for r in records] == [pytest.approx(s.total, abs=1e-5) for s in expected]
    assert records[1]["pieces"][0]["rank"] >= 1 and len(records[1]["pieces"][0]["top"]) == 5
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("我是谁？\tWho am I?\nno tab here\n", encoding="utf-8")
    refused = run_mtrain(*args, "--input", str(tsv))
    assert refused.returncode == 2 and f"{tsv}:2: expected SOURCE<TAB>TARGET" in refused.stderr
    odd = run_mtrain(*args, "我是谁？")
    assert odd.returncode == 2 and "give SOURCE TARGET pairs" in odd.stderr


def test_a_mapping_of_overrides_is_set_as_python_values(tmp_path) -> None:
    """{"data.train": "corpus #2.tsv"} names that file: " #" is no YAML comment here."""
    corpus = tmp_path / "corpus #2.tsv"
    with pytest.raises(mtrain.MtrainError, match=re.escape("corpus #2.tsv")):
        mtrain.train(REPO / "configs/tiny.yaml", tmp_path / "run", {"data.train": str(corpus)})
    assert not (tmp_path / "run").exists()


WRONG_CALLS = {
    "load(3)": (lambda m, r: mtrain.load(3), "path: expected a path"),
    "load(beam='4')": (lambda m, r: mtrain.load(r, beam="4"), "beam: expected a whole number"),
    "load(quantize='yes')": (lambda m, r: mtrain.load(r, quantize="yes"), "quantize: expected"),
    "load(device=0)": (lambda m, r: mtrain.load(r, device=0), "device: expected a string"),
    "train(3)": (lambda m, r: mtrain.train(3), "config: expected a path"),
    "train(overrides=str)": (
        lambda m, r: mtrain.train("configs/tiny.yaml", overrides="train.max_steps=1"),
        "overrides: expected a mapping",
    ),
    "train(overrides=[1])": (
        lambda m, r: mtrain.train("configs/tiny.yaml", overrides=[1]),
        "overrides: expected",
    ),
    "train(device=None)": (
        lambda m, r: mtrain.train("configs/tiny.yaml", device=None),
        "device: expected a string",
    ),
    "translate(3)": (lambda m, r: m.translate(3), "text: expected a string or a list"),
    "translate([3])": (lambda m, r: m.translate(["我", 3]), "text: expected a string or a list"),
    "translate(nbest=0)": (lambda m, r: m.translate("我", nbest=0), "nbest 0: expected from 1"),
    "translate(beam=10**6)": (
        lambda m, r: m.translate("我", beam=10**6),
        "beam 1000000: expected from 1 to 64",
    ),
    "translate(alpha='x')": (lambda m, r: m.translate("我", alpha="x"), "alpha: expected a num"),
    "score(k=-1)": (lambda m, r: m.score("我", "I", k=-1), "k -1: expected from 1 to"),
    "score(3, 4)": (lambda m, r: m.score(3, 4), "source: expected a string or a list"),
    "trace(3)": (lambda m, r: m.trace(3), "text: expected a string"),
    "trace(k=0)": (lambda m, r: m.trace("我", k=0), "k 0: expected from 1 to"),
    "attention(None)": (lambda m, r: m.attention(None), "text: expected a string"),
    "translate(surrogate)": (lambda m, r: m.translate("\ud800"), "text: a lone surrogate"),
    "translate([surrogate])": (
        lambda m, r: m.translate(["我", "我\udfff"]),
        "text 1: a lone surrogate '\\udfff' at character 1 is not text",
    ),
    "score(surrogate)": (lambda m, r: m.score("我", "I\ud800"), "target: a lone surrogate"),
    "trace(surrogate)": (lambda m, r: m.trace("\ud800"), "text: a lone surrogate"),
    "attention(surrogate)": (lambda m, r: m.attention("\ud800"), "text: a lone surrogate"),
    "curves()": (lambda m, r: mtrain.curves(), "name at least one run directory"),
}


@pytest.mark.parametrize("call", list(WRONG_CALLS))
def test_wrong_arguments_are_one_line_errors(call, model, run_dir) -> None:
    """Not a TypeError or AttributeError from deep inside, not an empty list: one line."""
    wrong, message = WRONG_CALLS[call]
    with pytest.raises(mtrain.MtrainError, match=re.escape(message)) as caught:
        wrong(model, run_dir)
    assert "\n" not in str(caught.value)


def test_an_export_opened_as_a_run_says_what_it_is(tmp_path) -> None:
    export = tmp_path / "ct2"
    export.mkdir()
    (export / "model.bin").write_bytes(b"")
    (export / "mtrain.yaml").write_text("model: {}\n", encoding="utf-8")
    expected = f"{export}: a CTranslate2 export (written by mtrain export), not a run directory"
    with pytest.raises(mtrain.MtrainError, match=re.escape(expected)) as caught:
        mtrain.load(export)
    assert 'engine="ctranslate2"' in str(caught.value)
    result = run_mtrain("translate", "--run", str(export), "我")
    assert result.returncode == 2 and "--engine ctranslate2" in result.stderr


def test_the_beam_has_one_bound_everywhere(run_dir) -> None:
    from mtrain.core.config import MAX_BEAM
    from mtrain.serve.api import Limits

    assert Limits().max_beam == MAX_BEAM
    for command in (["translate", "我"], ["eval"]):
        result = run_mtrain(*command, "--run", str(run_dir), "--beam", "1000000")
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "--beam" in result.stderr, result.stderr
        assert str(MAX_BEAM) in result.stderr


def test_train_returns_none_on_a_rank_that_writes_no_run(monkeypatch) -> None:
    """Under torchrun the ranks other than 0 train too, and return None rather than raise."""
    import mtrain.training.start

    monkeypatch.setattr(mtrain.training.start, "train_run", lambda *args, **kwargs: (None, 0.0))
    assert mtrain.train("configs/tiny.yaml") is None
