"""`mtrain export` and `--engine ctranslate2`: CTranslate2 runs our weights and searches as we do.

CTranslate2 is an optional extra: these tests skip without it, except in CI (CI=true), which
installs it and where a missing CTranslate2 must fail, not skip.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mtrain.cli import main
from mtrain.core import files
from mtrain.core.config import Config, DataConfig, DecodeConfig, ModelConfig, TokenizerConfig
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from mtrain.decoding.search import NEVER_OUTPUT
from mtrain.decoding.translator import Translator
from mtrain.export import converter as export
from mtrain.export import engine as ct2_engine
from mtrain.export.converter import ExportError, check_expressible, export_run
from mtrain.run.directory import BEST, build_model, load_run, save_checkpoint, write_config

from .synthetic import REPO, number_pairs, overrides

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ct2():
    if os.environ.get("CI"):
        return importlib.import_module("ctranslate2")
    return pytest.importorskip("ctranslate2")


def make_run(path: Path, cfg: Config, tokenizer: Tokenizer, biases: dict[int, float]) -> Path:
    """A run directory holding a randomly initialised model; `biases` are added to its logits."""
    path.mkdir()
    write_config(path, cfg)
    for name, proto in zip((export.SRC_MODEL, export.TGT_MODEL), tokenizer.protos()):
        (path / name).write_bytes(proto)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer)
    with torch.no_grad():
        for norm in model.modules():  # each LayerNorm its own: a swapped one changes outputs
            if isinstance(norm, torch.nn.LayerNorm):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)
        for name, table in model.named_parameters():  # learned positions large enough to tell
            if ".positions." in name:
                table.normal_()
        for token, bias in biases.items():
            model.output_projection.bias[token] += bias
    state = {"model": model.state_dict(), "tokenizer": tokenizer.fingerprint(), "step": 0}
    save_checkpoint(path / BEST, state)
    return path


def random_config(norm: str, tie: bool, joint: bool, beam: int = 1) -> Config:
    return Config(
        data=DataConfig(max_src_len=12, max_tgt_len=14),
        tokenizer=TokenizerConfig(
            joint=joint, vocab_size=300, tgt_vocab_size=0, character_coverage=1.0
        ),
        model=ModelConfig(
            d_model=32,
            n_heads=4,
            n_encoder_layers=2,
            n_decoder_layers=2,
            d_ff=64,
            dropout=0.0,
            norm=norm,
            tie_embeddings=tie,
        ),
        decode=DecodeConfig(batch_tokens=60, beam_size=beam, alpha=0.6, max_len_offset=3),
    )


def both_engines(run: Path, out: Path, decode: DecodeConfig, nbest: int = 1):
    """mtrain's Translator on the run, and CTranslate2's on its export, with `decode`."""
    loaded = load_run(run, CPU)
    cfg, tokenizer, model = loaded.cfg, loaded.tokenizer, loaded.model
    ours = Translator(model, tokenizer, cfg, CPU, decode, nbest)
    _, _, engine = ct2_engine.load(export_run(run, out), "cpu")
    return ours, ct2_engine.CT2Translator(engine, tokenizer, cfg, decode, nbest)


SENTENCES = [zh for zh, _ in number_pairs(24, seed=11)] + [
    "",  # an empty line gives an empty line
    "  四  五 ",  # whitespace is collapsed
    "七" * 30,  # cut at data.max_src_len
    "我是誰",  # traditional characters, then bytes: the digit tokenizer has none of them
]


@pytest.mark.parametrize(
    "norm, tie, joint",
    [("pre", True, False), ("post", True, False), ("pre", False, False), ("post", True, True)],
)
@pytest.mark.parametrize("beam", [1, 3])
def test_random_models_translate_alike(ct2, tokenizer, tmp_path, norm, tie, joint, beam):
    """Pre- and post-norm, tied, untied and joint-tied: the same outputs, alone and in batches
    of mixed lengths and output limits; <pad> and <s>, made likeliest, are never output."""
    if joint:  # one SentencePiece model for both sides
        tokenizer = Tokenizer(tokenizer.src, tokenizer.src)
    cfg = random_config(norm, tie, joint, beam)
    run = make_run(tmp_path / "run", cfg, tokenizer, {PAD_ID: 4.0, BOS_ID: 4.0})
    ours, theirs = both_engines(run, tmp_path / "ct2", cfg.decode, nbest=beam)
    if joint:
        assert (tmp_path / "ct2" / "shared_vocabulary.json").is_file()
    with torch.inference_mode():  # unmasked, the model would output <pad> or <s> first
        first = ours.model(torch.tensor([[5, 6, EOS_ID]]), torch.tensor([[BOS_ID]]))[0, -1]
    assert first.argmax().item() in (PAD_ID, BOS_ID)

    alone = [
        [h.tokens for h in t.inspect(text, lambda event: None).hypotheses]
        for text in SENTENCES
        for t in (ours, theirs)
    ]
    assert alone[1::2] == alone[0::2]
    assert len({tuple(hyps[0]) for hyps in alone if hyps}) > 10  # outputs vary with the input
    assert not {t for hyps in alone for h in hyps for t in h} & {PAD_ID, BOS_ID}
    expected, got = ours.translate_nbest(SENTENCES), theirs.translate_nbest(SENTENCES)
    assert [[t.text for t in n] for n in got] == [[t.text for t in n] for n in expected]
    for a, b in zip([t for n in expected for t in n], [t for n in got for t in n]):
        assert (a.score is None) == (b.score is None)
        if a.score is not None:
            assert b.score == pytest.approx(a.score, abs=1e-3)


@pytest.mark.parametrize(
    "norm, tie, joint",
    [
        ("pre", True, False),
        ("post", True, False),
        ("pre", False, False),
        ("post", False, True),  # one vocabulary, three matrices
        ("pre", True, True),  # one vocabulary, one matrix
    ],
)
def test_token_log_probs_are_ours(ct2, tokenizer, tmp_path, norm, tie, joint):
    """Teacher forced, CTranslate2's score_batch gives every target token (</s> included) our
    log-probability within 1e-4, in a batch of mixed source and target lengths."""
    if joint:
        tokenizer = Tokenizer(tokenizer.src, tokenizer.src)
    cfg = random_config(norm, tie, joint)
    run = make_run(tmp_path / "run", cfg, tokenizer, {})
    model = load_run(run, CPU).model
    _, _, engine = ct2_engine.load(export_run(run, tmp_path / "ct2"), "cpu")
    zh, en = zip(*number_pairs(40, seed=5))
    # One to four sentences' worth, cut to the longest the model reads (with </s>) and decodes
    # (with <s>): every position is used; source and target lengths vary apart.
    sources = [
        tokenizer.src.encode("".join(zh[i : i + 1 + i % 4]))[: cfg.data.max_src_len - 1]
        for i in range(16)
    ]
    targets = [
        tokenizer.tgt.encode(" ".join(en[20 + i : 21 + i + 3 * i % 4]))[: cfg.data.max_tgt_len - 1]
        for i in range(16)
    ]
    for rows, limit in ((sources, cfg.data.max_src_len - 1), (targets, cfg.data.max_tgt_len - 1)):
        assert len({len(r) for r in rows}) >= 3 and max(map(len, rows)) == limit

    def padded(rows: list[list[int]]) -> torch.Tensor:  # (B, longest)
        longest = max(map(len, rows))
        return torch.tensor([row + [PAD_ID] * (longest - len(row)) for row in rows])

    src = padded([[*s, EOS_ID] for s in sources])  # (B, S)
    tgt_in = padded([[BOS_ID, *t] for t in targets])  # (B, T)
    with torch.inference_mode():
        log_probs = model(src, tgt_in).log_softmax(-1)  # (B, T, V)
    results = engine.score_batch(
        [tokenizer.src.id_to_piece(s) for s in sources],
        [tokenizer.tgt.id_to_piece(t) for t in targets],
    )
    for row, (target, result) in enumerate(zip(targets, results)):
        tgt_out = [*target, EOS_ID]
        assert result.tokens == tokenizer.tgt.id_to_piece(tgt_out)
        ours = log_probs[row, torch.arange(len(tgt_out)), tgt_out]  # (T_row,)
        assert result.log_probs == pytest.approx(ours.tolist(), abs=1e-4)


def test_beam_ranks_by_our_length_penalty(ct2, tokenizer, tmp_path, monkeypatch):
    """A model that often ends at once: where GNMT's penalty prefers a short output to long
    ones that CTranslate2's length ** alpha would rank first, the engine still gives ours."""
    cfg = random_config("pre", True, False, beam=4)
    run = make_run(tmp_path / "run", cfg, tokenizer, {EOS_ID: 3.0})
    ours, theirs = both_engines(run, tmp_path / "ct2", cfg.decode)
    sentences = [zh for zh, _ in number_pairs(40, seed=11)]
    expected = [n[0] for n in ours.translate_nbest(sentences)]
    assert 5 < sum(t.text == "" for t in expected) < 35  # short and long outputs both win
    got = [n[0] for n in theirs.translate_nbest(sentences)]
    assert [t.text for t in got] == [t.text for t in expected]
    assert [t.score for t in got] == pytest.approx([t.score for t in expected], abs=1e-3)
    monkeypatch.setattr(theirs, "length_exponent", cfg.decode.alpha)
    naive = [n[0].text for n in theirs.translate_nbest(sentences)]
    assert naive != [t.text for t in expected]  # CTranslate2's own ranking would lose some


def test_exported_vocabularies_and_tokens_are_ours(ct2, tokenizer, tmp_path):
    run = make_run(tmp_path / "run", random_config("pre", True, False), tokenizer, {})
    out = export_run(run, tmp_path / "ct2")
    for side, sp in (("source", tokenizer.src), ("target", tokenizer.tgt)):
        pieces = json.loads((out / f"{side}_vocabulary.json").read_text(encoding="utf-8"))
        assert pieces == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    config = json.loads((out / "config.json").read_text())
    assert config["unk_token"] == "<unk>" and config["eos_token"] == "</s>"
    assert config["decoder_start_token"] == config["bos_token"] == "<s>"
    assert config["add_source_eos"] and not config["add_source_bos"]
    assert config["layer_norm_epsilon"] == pytest.approx(1e-5)
    for name in ("spm.src.model", "spm.tgt.model", "mtrain.yaml", "README.md", "model.bin"):
        assert (out / name).is_file(), name


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus) -> Path:
    """configs/tiny.yaml trained for 100 steps on the synthetic digits task."""
    out = tmp_path_factory.mktemp("runs") / "digits"
    settings = [f"--set={s}" for s in overrides(corpus, max_steps=100, eval_every=100)]
    train = [sys.executable, "-m", "mtrain", "train", "--config", "configs/tiny.yaml", "--out"]
    result = subprocess.run(
        [*train, str(out), *settings],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    return out


def test_trained_model_greedy_is_ours_token_for_token(ct2, trained_run, tmp_path):
    """Greedy, float32: every sentence the same, or it differs first where our two best next
    tokens score within 1e-4 of each other (a tie that float rounding may break either way)."""
    loaded = load_run(trained_run, CPU)
    cfg, model = loaded.cfg, loaded.model
    greedy = dataclasses.replace(cfg.decode, beam_size=1)
    ours, theirs = both_engines(trained_run, tmp_path / "ct2", greedy)
    sentences = [zh for zh, _ in number_pairs(100, seed=21)]
    differ = set()
    for i, text in enumerate(sentences):
        mine = ours.inspect(text, lambda event: None)
        a = mine.hypotheses[0].tokens
        b = theirs.inspect(text, lambda event: None).hypotheses[0].tokens
        if a == b:
            continue
        differ.add(i)
        a_end, b_end = [*a, EOS_ID], [*b, EOS_ID]  # </s>, where one ended, differs too
        step = next(t for t, (x, y) in enumerate(zip(a_end, b_end)) if x != y)
        with torch.inference_mode():
            logits = model(torch.tensor([mine.src]), torch.tensor([[BOS_ID, *a[:step]]]))[0, -1]
        log_probs = logits.index_fill(0, NEVER_OUTPUT, float("-inf")).log_softmax(-1)
        gap = (log_probs[a_end[step]] - log_probs[b_end[step]]).abs().item()
        assert gap <= 1e-4, f"{text!r} differs at step {step + 1}, not a tie: {gap:.2e}"
    assert len(differ) <= len(sentences) // 20  # ties are rare; many differences are a bug
    batched = zip(ours.translate(sentences), theirs.translate(sentences))
    assert all(x == y for i, (x, y) in enumerate(batched) if i not in differ)


def test_trained_model_beam_agrees_and_scores_match(ct2, trained_run, tmp_path):
    """Beam 4 with the run's length penalty: >= 99% of sentences the same, scores within 1e-3."""
    cfg = load_run(trained_run, CPU).cfg
    beam4 = dataclasses.replace(cfg.decode, beam_size=4)
    ours, theirs = both_engines(trained_run, tmp_path / "ct2", beam4, nbest=1)
    sentences = [zh for zh, _ in number_pairs(100, seed=22)]
    expected, got = ours.translate_nbest(sentences), theirs.translate_nbest(sentences)
    same = [a[0].text == b[0].text for a, b in zip(expected, got)]
    assert sum(same) >= 0.99 * len(sentences)
    for a, b, equal in zip(expected, got, same):
        if equal:
            assert b[0].score == pytest.approx(a[0].score, abs=1e-3)


def test_int8_export_translates(ct2, trained_run, tmp_path):
    out = export_run(trained_run, tmp_path / "int8", quantize="int8")
    cfg, tokenizer, engine = ct2_engine.load(out, "cpu")
    lines = ct2_engine.CT2Translator(engine, tokenizer, cfg).translate(["一二三", ""])
    assert lines[0] and lines[1] == ""


def test_readme_python_examples_run(ct2, trained_run, tmp_path):
    """The five lines in the exported README, and in ours, translate with the exported model."""
    out = export_run(trained_run, tmp_path / "ct2")
    exported = (out / "README.md").read_text(encoding="utf-8")
    for difference in ("`min_decoding_length` is 1", "past the 32 positions", "with one gap"):
        assert difference in exported
    ours = (REPO / "docs" / "export.md").read_text(encoding="utf-8")
    for text in ((out / "README.md").read_text(encoding="utf-8"), ours):
        code = text.split("```python\n")[1].split("```")[0].replace("zh-en", str(out))
        assert len([line for line in code.splitlines() if line]) == 5
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()


def test_export_command_prints_the_directory_and_guards_files(ct2, trained_run, tmp_path, capsys):
    out = tmp_path / "ct2"
    main_status(["export", str(trained_run), "-o", str(out)])
    assert capsys.readouterr().out == f"{out}\n"
    first = (out / "model.bin").stat().st_mtime_ns
    for args, message in (
        ([], "exists and is not empty; add --force"),  # an earlier export
        (["-o", str(trained_run), "--force"], "would replace the run"),
        (["-o", str(REPO / "configs"), "--force"], "replaces only an earlier export"),
        (["--quantize", "int4"], "'int4' is not one of"),
    ):
        command = ["export", str(trained_run), "-o", str(out), *args]
        assert main_status(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert (out / "model.bin").stat().st_mtime_ns == first
    assert main_status(["export", str(trained_run), "-o", str(out), "--force"]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name != "ct2"]  # no temporary left


def test_translate_with_the_ctranslate2_engine(ct2, trained_run, tmp_path, capsys):
    """The same lines out of `mtrain translate` with either engine (scores to float rounding);
    what the CTranslate2 engine cannot do is one line."""
    out = export_run(trained_run, tmp_path / "ct2")
    lines = "一二三\n\n四五\n"
    runs = {}
    translate = [sys.executable, "-m", "mtrain", "translate", "--beam", "2", "--nbest", "2"]
    for engine, run in (("mtrain", trained_run), ("ctranslate2", out)):
        result = subprocess.run(
            [*translate, "--engine", engine, "--run", str(run)],
            input=lines,
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0, result.stderr
        runs[engine] = [line.split(" ||| ") for line in result.stdout.splitlines()]
    assert len(runs["mtrain"]) == 5  # two for each sentence, one for the empty line
    for (n, text, score), (n2, text2, score2) in zip(runs["mtrain"], runs["ctranslate2"]):
        assert (n, text) == (n2, text2)
        assert float(score2) == pytest.approx(float(score), abs=2e-4)
    for args, message in (
        (["--run", str(trained_run)], "export it first: mtrain export"),
        (["--run", str(out), "--trace"], "need --engine mtrain"),
        (["--run", str(out), "--checkpoint", "last.pt"], "--checkpoint needs --engine mtrain"),
        ([], "needs --run DIR"),
    ):
        assert main_status(["translate", "--engine", "ctranslate2", "一", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def main_status(argv: list[str]) -> int:
    """`mtrain ARGV` in this process; its exit status."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code


def test_without_ctranslate2_both_commands_say_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` fails
    (tmp_path / "run").mkdir()
    assert main_status(["export", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "CTranslate2 is not installed: pip install ctranslate2" in err
    assert not (tmp_path / "out").exists()
    translate = ["translate", "--engine", "ctranslate2", "--run", str(tmp_path / "run"), "一"]
    assert main_status(translate) == 2
    assert capsys.readouterr().err == err


@dataclasses.dataclass
class FutureModelConfig(ModelConfig):
    activation: str = "gelu"


def test_options_ctranslate2_cannot_express_are_refused_by_name():
    future = Config(model=FutureModelConfig())
    with pytest.raises(ExportError, match=r"^model\.activation: "):
        check_expressible(future)
    rms = Config(model=ModelConfig(norm="rms"))  # a value the config may allow one day
    with pytest.raises(ExportError, match=r"^model\.norm: 'rms' cannot be expressed"):
        check_expressible(rms)
    check_expressible(Config())  # every option of today's models
    for variant in ("no-residual", "no-layernorm"):  # CTranslate2's sublayers have both
        refused = Config(model=ModelConfig(variant=variant))
        with pytest.raises(ExportError, match=rf"^model\.variant: '{variant}' cannot be"):
            check_expressible(refused)


@pytest.mark.parametrize("variant", ["no-positions", "learned-positions", "peek", "no-scale"])
def test_variants_ctranslate2_expresses_translate_alike(ct2, tokenizer, tmp_path, variant):
    """Positions of zeros or learned; peek decodes as the textbook; no-scale's queries are
    scaled up by as much as CTranslate2 scales them down."""
    cfg = random_config("pre", True, False)
    cfg.model.variant = variant
    run = make_run(tmp_path / "run", cfg, tokenizer, {})
    ours, theirs = both_engines(run, tmp_path / "ct2", cfg.decode)
    expected, got = ours.translate_nbest(SENTENCES), theirs.translate_nbest(SENTENCES)
    assert [[t.text for t in n] for n in got] == [[t.text for t in n] for n in expected]
    assert len({n[0].text for n in expected}) > 10  # outputs vary with the input


def test_a_learned_table_is_exported_with_the_rows_the_run_has(ct2, tokenizer, tmp_path):
    """Max lengths 20 and 50 make a table of 50 rows (not default.yaml's 64): the export holds
    those rows, translates as mtrain's greedy search does, and its README says how long a
    sentence its lines read (not the 1,024 pieces of a sinusoidal table)."""
    cfg = random_config("pre", True, False)
    cfg.model.variant = "learned-positions"
    cfg.data = dataclasses.replace(cfg.data, max_src_len=20, max_tgt_len=50)
    run = make_run(tmp_path / "run", cfg, tokenizer, {})
    ours, theirs = both_engines(run, tmp_path / "ct2", cfg.decode)
    spec = export.build_spec(cfg, tokenizer, ours.model)
    for side, stack in (("src", spec.encoder), ("tgt", spec.decoder)):
        table = getattr(ours.model, f"{side}_embed").positions.table.weight
        assert table.shape == (50, 32)
        assert torch.equal(torch.from_numpy(stack.position_encodings.encodings), table.detach())
    sentences = [*SENTENCES[:6], "七" * 30]  # the last one cut at 20 pieces
    assert theirs.translate(sentences) == ours.translate(sentences)
    readme = (tmp_path / "ct2" / "README.md").read_text("utf-8")
    assert "read and write up to 50 pieces, the rows of the learned position table" in readme
    assert "1,024" not in readme


def test_a_weight_with_no_place_in_the_spec_is_refused(ct2, tokenizer):
    cfg = random_config("pre", True, False)
    model = build_model(cfg, tokenizer)
    model.register_parameter("gate", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ExportError, match=r"weights with no place .*'gate'"):
        export.build_spec(cfg, tokenizer, model)


@pytest.fixture(scope="module")
def random_run(tmp_path_factory, tokenizer) -> Path:
    """A run holding a random pre-norm model: for the tests of files, devices and warnings."""
    root = tmp_path_factory.mktemp("random")
    return make_run(root / "run", random_config("pre", True, False), tokenizer, {})


def test_force_never_deletes_a_file_export_did_not_write(ct2, random_run, tmp_path, capsys):
    """An earlier export that also holds the user's notes is refused, with or without --force,
    naming the notes; without them, --force replaces what export wrote."""
    out = export_run(random_run, tmp_path / "ct2")
    (out / "notes.txt").write_text("mine\n")
    for force in ([], ["--force"]):
        assert main_status(["export", str(random_run), "-o", str(out), *force]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "did not write (notes.txt)" in err, err
        assert (out / "notes.txt").read_text() == "mine\n"
    (out / "notes.txt").unlink()
    assert main_status(["export", str(random_run), "-o", str(out), "--force"]) == 0
    written = json.loads((out / export.MANIFEST).read_text())["files"]
    assert written == sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize("where", [".", "..", "$PWD", "$PWD/../.."])
def test_the_current_directory_and_its_parents_are_refused(
    ct2, random_run, tmp_path, where, capsys, monkeypatch
):
    """Refused in one line before the checkpoint is read, empty or an earlier export, with
    --force: an export replaces its destination, and the shell would stand in a deleted one."""
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    out = where.replace("$PWD", str(cwd))
    assert main_status(["export", str(random_run), "-o", out, "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an export would replace" in err, err
    export_run(random_run, Path("model"))  # below it is fine
    assert sorted(p.name for p in cwd.iterdir()) == ["model"]


def test_a_full_disk_names_the_destination(ct2, random_run, tmp_path, monkeypatch, capsys):
    """A write that fails names the directory being written, not its hidden temporary one,
    and leaves nothing behind; the earlier export stays whole."""
    out = export_run(random_run, tmp_path / "ct2")
    before = (out / "model.bin").read_bytes()

    def fill_the_disk(spec, directory: str) -> None:
        with open(os.path.join(directory, "model.bin"), "wb") as f:
            f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write(2): no file name

    monkeypatch.setattr(ct2.specs.TransformerSpec, "save", fill_the_disk)
    assert main_status(["export", str(random_run), "-o", str(out), "--force"]) == 2
    assert capsys.readouterr().err == f"mtrain: error: {out}: No space left on device\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2"]
    assert (out / "model.bin").read_bytes() == before


# An export that dies as SIGKILL leaves it (no cleanup runs): once its directory is written, or
# between its two renames, where the earlier export has been moved aside.
KILLED_EXPORT = """
import os, sys
from pathlib import Path
from mtrain.export import converter as export

run, out, death = sys.argv[1:]
if death == "written":
    write = export.write_directory
    def write_and_die(*args):
        write(*args)
        os._exit(9)
    export.write_directory = write_and_die
else:
    rename = Path.rename
    def die_at_the_second(self, target):
        if self.name.endswith(".tmp"):
            os._exit(9)
        return rename(self, target)
    Path.rename = die_at_the_second
export.export_run(Path(run), Path(out), force=True)
"""


@pytest.mark.parametrize("death", ["written", "between renames"])
def test_the_next_export_cleans_up_after_a_killed_one(ct2, random_run, tmp_path, death, caplog):
    out = export_run(random_run, tmp_path / "ct2")
    before = (out / "model.bin").read_bytes()
    (out / "model.bin").write_bytes(before + b"earlier")  # to tell the earlier export apart
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, str(random_run), str(out), death],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert killed.returncode == 9, killed.stderr
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ct2.")]
    assert hidden and out.exists() == (death == "written"), hidden
    refused = pytest.raises(ExportError, match="exists and is not empty; add --force")
    with caplog.at_level(logging.WARNING), refused:  # without --force: restored, then refused
        export_run(random_run, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2"]
    assert (out / "model.bin").read_bytes() == before + b"earlier"
    restored = "restored the earlier export that a killed export had moved aside"
    assert (restored in caplog.text) == (death == "between renames")
    export_run(random_run, out, force=True)
    assert (out / "model.bin").read_bytes() == before


def test_a_stale_temporary_of_a_running_export_is_left_alone(ct2, random_run, tmp_path):
    """Another export still writing (its pid runs) keeps its temporary directory."""
    theirs = tmp_path / f".ct2.{os.getppid()}.tmp"
    theirs.mkdir()
    export_run(random_run, tmp_path / "ct2")
    assert theirs.is_dir()


def test_the_renames_reach_the_disk(ct2, random_run, tmp_path, monkeypatch):
    """The directory holding the export is synced after it is renamed into place, first
    export or replacement."""
    out, synced = tmp_path / "ct2", []
    monkeypatch.setattr(
        files, "sync_directory", lambda d: synced.append((d, export.is_export(out)))
    )
    for force in (False, True):
        synced.clear()
        export_run(random_run, out, force=force)
        assert synced[-1] == (tmp_path, True)


def test_a_second_export_to_one_directory_is_refused_while_the_first_holds_it(
    ct2, random_run, tmp_path, capsys
):
    """Not a race: the one that comes second says so in one line and writes nothing."""
    out = export_run(random_run, tmp_path / "ct2")
    before = (out / "model.bin").read_bytes()
    with files.lock_beside(out):  # the first export, at work
        assert main_status(["export", str(random_run), "-o", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mtrain: error: {out}: in use by another"), err
    assert (out / "model.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2"]  # the lock file goes too
    export_run(random_run, out, force=True)  # once it is released


def test_the_ctranslate2_engine_runs_on_the_gpu_asked_for(ct2, random_run, tmp_path, monkeypatch):
    """cuda:N loads on GPU N (checked on what ctranslate2.Translator is given: no GPU here)."""
    out = export_run(random_run, tmp_path / "ct2")
    given = []
    fake = types.SimpleNamespace(Translator=lambda path, **options: given.append(options))
    monkeypatch.setattr(ct2_engine, "require_ctranslate2", lambda: fake)
    monkeypatch.setattr(ct2_engine.runtime, "pick_device", torch.device)  # any GPU "exists"
    for device in ("cuda:1", "cuda:0", "cuda", "cpu"):
        ct2_engine.load(out, device)
    assert [(g["device"], g["device_index"]) for g in given] == [
        ("cuda", 1),
        ("cuda", 0),
        ("cuda", 0),
        ("cpu", 0),
    ]


def test_float16_on_a_cpu_is_said_at_export_and_at_load(
    ct2, random_run, tmp_path, caplog, monkeypatch
):
    """CTranslate2 computes float16 weights in float32 on a CPU: outputs are no longer the
    run's, which export (on a machine without a GPU) and loading on a CPU say."""
    monkeypatch.setattr(ct2, "get_cuda_device_count", lambda: 0)
    with caplog.at_level(logging.WARNING):
        out = export_run(random_run, tmp_path / "f16", quantize="float16")
        assert caplog.messages == [export.FLOAT16_ON_CPU % out]
        caplog.clear()
        cfg, tokenizer, engine = ct2_engine.load(out, "cpu")
        assert caplog.messages == [export.FLOAT16_ON_CPU % out]
        assert ct2_engine.CT2Translator(engine, tokenizer, cfg).translate(["一二三"])[0]
        caplog.clear()
        ct2_engine.load(out, "cpu", int8=True)  # computed in int8: asked for, not a surprise
        ct2_engine.load(export_run(random_run, tmp_path / "f32"), "cpu")
        assert not caplog.messages
