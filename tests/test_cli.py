"""End to end through the installed console script: train the tiny config, translate, evaluate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .console import REPO, mtrain
from .synthetic import overrides


def test_run_directory_contents(run_dir):
    for name in ("config.yaml", "spm.src.model", "spm.tgt.model", "last.pt", "best.pt"):
        assert (run_dir / name).is_file(), name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [60, 120]
    assert all({"dev_loss", "dev_bleu", "dev_chrf"} <= set(r) for r in records)
    assert records[1]["dev_loss"] < records[0]["dev_loss"]


def test_translate_arguments_and_stdin_agree(run_dir):
    args = mtrain("translate", "我是谁", "今天是星期二", "--run", str(run_dir))
    assert args.returncode == 0, args.stderr
    lines = args.stdout.splitlines()
    assert len(lines) == 2 and all(lines)
    piped = mtrain("translate", "--run", str(run_dir), input="我是谁\n\n今天是星期二\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.splitlines() == [lines[0], "", lines[1]]


def test_traditional_and_simplified_input_are_one(run_dir):
    result = mtrain("translate", "我是誰", "我是谁", "--run", str(run_dir))
    first, second = result.stdout.splitlines()
    assert first == second


def test_translate_uses_latest_run_by_default(run_dir, tmp_path):
    (tmp_path / "runs").symlink_to(run_dir.parent, target_is_directory=True)
    result = mtrain("translate", "我是谁", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"using run {Path('runs') / run_dir.name}" in result.stderr
    assert result.stdout.strip()


def test_eval_default_test_split(run_dir):
    result = mtrain("eval", "--run", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    scores = json.loads(result.stdout)
    assert scores["sentences"] == 2000
    assert 0 <= scores["bleu"] <= 100 and scores["chrf"] > 0
    assert "nrefs:var" in scores["bleu_signature"]
    hyps = Path(scores["hypotheses"]).read_text().splitlines()
    assert len(hyps) == 2000


def test_eval_of_a_test_set_given_as_two_files(run_dir, tmp_path):
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    src, tgt = tmp_path / "test.zh", tmp_path / "test.en"
    src.write_text("我是谁。\n今天是星期二。\n我是谁。\n", encoding="utf-8")
    tgt.write_text("Who am I?\nToday is Tuesday.\nWhat am I?\n", encoding="utf-8")
    cfg = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    cfg["data"]["test"] = {"src": str(src), "tgt": str(tgt)}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True), encoding="utf-8")
    result = mtrain("eval", "--run", str(run), "--json")
    assert result.returncode == 0, result.stderr
    scores = json.loads(result.stdout)
    assert scores["sentences"] == 2  # the repeated source, with both its references
    assert Path(scores["hypotheses"]).name == "test.hyp.en"


def test_another_search_keeps_the_hypotheses_of_the_runs_own(run_dir, tmp_path):
    src, ref = tmp_path / "src.zh", tmp_path / "ref.en"
    src.write_text("我是谁\n今天是星期二\n")
    ref.write_text("Who am I?\nToday is Tuesday.\n")
    files = {}
    for options in [(), ("--beam", "1"), ("--beam", "2", "--checkpoint", "last.pt")]:
        args = ["eval", "--run", str(run_dir), "--src", str(src), "--ref", str(ref), "--json"]
        result = mtrain(*args, *options)
        assert result.returncode == 0, result.stderr
        path = Path(json.loads(result.stdout)["hypotheses"])
        files[path.name] = path.read_text(encoding="utf-8")
    assert list(files) == ["src.zh.hyp.en", "src.zh.beam1.hyp.en", "src.zh.beam2.last.hyp.en"]
    greedy = mtrain("translate", "--run", str(run_dir), "--beam", "1", input=src.read_text())
    assert files["src.zh.beam1.hyp.en"] == greedy.stdout
    assert (run_dir / "src.zh.hyp.en").read_text(encoding="utf-8") == files["src.zh.hyp.en"]


def test_eval_files_with_several_references(run_dir, tmp_path):
    src, ref1, ref2 = tmp_path / "src.zh", tmp_path / "ref1.en", tmp_path / "ref2.en"
    src.write_text("我是谁\n今天是星期二\n")
    hyps = mtrain("translate", "--run", str(run_dir), input=src.read_text()).stdout
    assert all(hyps.splitlines())
    ref1.write_text(hyps)  # the model's own output as one reference: a perfect match
    ref2.write_text("Who am I?\n\n")  # a second reference for the first sentence only
    ref3 = tmp_path / "ref3.en"
    ref3.write_text("Who am I?\nIt is Tuesday.\n")

    def chrf(*refs):
        args = [a for r in refs for a in ("--ref", str(r))]
        result = mtrain("eval", "--run", str(run_dir), "--src", str(src), "--json", *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    both = chrf(ref1, ref2)
    assert both["chrf"] == pytest.approx(100.0)
    assert "nrefs:var" in both["chrf_signature"]
    assert chrf(ref3)["chrf"] < 100
    missing = mtrain("eval", "--run", str(run_dir), "--src", str(src), "--ref", str(ref2))
    assert missing.returncode == 2 and f"{src}:2: no reference in any --ref file" in missing.stderr
    assert (run_dir / "src.zh.hyp.en").read_text() == hyps


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--config", "configs/missing.yaml"], "cannot read config"),
        (
            ["train", "--config", "configs/tiny.yaml", "--set", "model.d_modle=3"],
            "unknown key 'model.d_modle'",
        ),
        (["translate", "x", "--run", "configs"], "not a run directory"),
    ],
)
def test_errors_are_one_line(args, message):
    result = mtrain(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_eval_rejects_misaligned_references(run_dir, tmp_path):
    src, ref = tmp_path / "s", tmp_path / "r"
    src.write_text("一\n二\n")
    ref.write_text("one\n")
    result = mtrain("eval", "--run", str(run_dir), "--src", str(src), "--ref", str(ref))
    assert result.returncode == 2 and "1 lines, but" in result.stderr


def test_help_lists_every_command():
    result = mtrain("--help")
    assert result.returncode == 0
    for command in ("train", "translate", "eval", "average", "info", "plot"):
        assert command in result.stdout


def test_train_rejects_a_corpus_with_no_usable_pairs(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("\t\n", encoding="utf-8")
    result = mtrain(
        "train",
        "--config",
        "configs/tiny.yaml",
        "--out",
        str(tmp_path / "run"),
        "--set",
        f"data.train={empty}",
    )
    assert result.returncode == 2
    assert f"{empty}: no sentence pairs with both sides non-empty" in result.stderr


def test_translate_file_stdin_and_arguments_agree(run_dir, tmp_path):
    sentences = ["我是谁", "", "今天是星期二", "我們試試看！", "他不会说英语。"]
    src, out = tmp_path / "in.zh", tmp_path / "out.en"
    src.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    from_file = mtrain("translate", "--run", str(run_dir), "--input", str(src), "-o", str(out))
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == ""
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 5 and lines[1] == ""
    piped = mtrain("translate", "--run", str(run_dir), input=src.read_text(encoding="utf-8"))
    assert piped.stdout.splitlines() == lines
    args = mtrain("translate", "--run", str(run_dir), *[s for s in sentences if s])
    assert args.stdout.splitlines() == [line for i, line in enumerate(lines) if i != 1]


def test_beam_and_nbest_output(run_dir):
    result = mtrain(
        "translate",
        "--run",
        str(run_dir),
        "--beam",
        "4",
        "--nbest",
        "3",
        input="我是谁\n\n今天是星期二\n",
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split(" ||| ") for line in result.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 0, 1, 2, 2, 2]
    assert rows[3][1:] == ["", "0.0000"]  # an empty line has one empty translation
    for sentence in (rows[:3], rows[4:]):
        scores = [float(r[2]) for r in sentence]
        assert scores == sorted(scores, reverse=True)
    one = mtrain("translate", "--run", str(run_dir), "--beam", "1", "我是谁")
    greedy = mtrain("translate", "--run", str(run_dir), "我是谁")
    assert one.stdout == greedy.stdout
    bad = mtrain("translate", "--run", str(run_dir), "--nbest", "3", "我是谁")
    assert bad.returncode == 2 and "--nbest 3 needs --beam 3 or more" in bad.stderr


def test_int8_quantization_translates(run_dir):
    result = mtrain("translate", "--run", str(run_dir), "--quantize", "int8", "我是谁")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1


def test_translate_rejects_invalid_utf8(run_dir, tmp_path):
    bad = tmp_path / "bad.zh"
    bad.write_bytes(b"\xff\xfe\xfa\n")
    result = mtrain("translate", "--run", str(run_dir), "--input", str(bad))
    assert result.returncode == 2 and "not valid UTF-8" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_byte_near_the_end_of_an_input_file_stops_before_any_translation(run_dir, tmp_path):
    """Past the first chunk of 2,000 lines: reading as it translates would print those first."""
    bad = tmp_path / "bad.zh"
    lines = ["我是谁".encode()] * 2600
    lines[2499] = b"\xe6\x88"  # line 2,500: a character cut short
    bad.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.en"
    for args in ([], ["--output", str(out)], ["--trace"]):
        result = mtrain("translate", "--run", str(run_dir), "--input", str(bad), *args)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.strip().endswith(f"mtrain: error: {bad}:2500: not valid UTF-8")
        assert not out.exists()


def unwritable_home(tmp_path: Path) -> Path:
    """A read-only HOME; for root, who may write anywhere, one below a regular file."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    if os.access(home, os.W_OK):
        (tmp_path / "file").write_text("")
        home = tmp_path / "file" / "home"
    return home


def test_plot_with_a_read_only_home_prints_no_matplotlib_warning(tmp_path):
    """matplotlib warns at length, at every start, when it cannot write its cache; mtrain gives
    it a directory of the user's own under TMPDIR, kept so that its font cache is built once."""
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME")}
    env.pop("XDG_CACHE_HOME", None)
    (tmp_path / "tmp").mkdir()
    env.update(HOME=str(unwritable_home(tmp_path)), TMPDIR=str(tmp_path / "tmp"))
    env["PYTHONPATH"] = str(REPO)
    errors = []
    for args in (["positional"], ["masks", "一二"], ["positional"]):
        result = subprocess.run(
            [sys.executable, "-m", "mtrain", "plot", *args, "-o", str(tmp_path / "f.png")],
            capture_output=True,
            text=True,
            cwd=tmp_path,  # no ./runs: the defaults are drawn
            env=env,
        )
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "f.png").is_file()
        errors.append(result.stderr)
    assert not any("MPLCONFIGDIR" in e or "writable" in e for e in errors)
    assert "matplotlib" not in errors[-1].lower()  # the font cache, built once, is kept
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [f"mtrain-matplotlib-{os.getuid()}"]


def test_corrupt_checkpoint_is_one_clear_error(run_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    best = broken / "best.pt"
    data = best.read_bytes()
    best.unlink()  # best.pt may be a hard link to last.pt: do not truncate both
    best.write_bytes(data[: len(data) // 2])
    result = mtrain("translate", "--run", str(broken), "我是谁")
    assert result.returncode == 2
    assert f"{best}: not a loadable mtrain checkpoint" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_average_checkpoints_then_evaluate_the_average(run_dir):
    result = mtrain("average", "--run", str(run_dir), "--last", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(run_dir / "averaged.pt")
    assert "steps 60, 120" in result.stderr
    result = mtrain("eval", "--run", str(run_dir), "--checkpoint", "averaged.pt", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["checkpoint"] == "averaged.pt"

    too_many = mtrain("average", "--run", str(run_dir), "--last", "3")
    assert too_many.returncode == 2 and "2 step checkpoints, fewer than --last 3" in too_many.stderr
    missing = mtrain("translate", "一", "--run", str(run_dir), "--checkpoint", "nothing.pt")
    assert missing.returncode == 2 and "nothing.pt: no such checkpoint" in missing.stderr


def test_trace_goes_to_stderr_and_leaves_stdout_alone(run_dir):
    for beam in ("1", "3"):
        args = ("translate", "我是谁", "今天是星期二", "--run", str(run_dir), "--beam", beam)
        plain, traced = mtrain(*args), mtrain(*args, "--trace", "--trace-k", "3")
        assert traced.returncode == 0, traced.stderr
        assert traced.stdout == plain.stdout
        assert traced.stderr.count("source: ") == 2  # each sentence in turn
        assert "source: 我是谁\n  pieces: " in traced.stderr
        if beam == "1":
            assert "step 1   decoder input: <s>   (log-probability so far 0.0000)" in traced.stderr
            assert traced.stderr.count("  3. ") == traced.stderr.count("step ")
        else:
            assert "live hypotheses, cumulative log-probability" in traced.stderr
            assert "finished " in traced.stderr


def test_attention_maps_are_written_per_sentence(run_dir, tmp_path):
    out = tmp_path / "maps"
    args = ("translate", "--run", str(run_dir), "--beam", "2")
    result = mtrain(*args, "--attention", str(out), input="我是谁\n\n今天是星期二\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == mtrain(*args, input="我是谁\n\n今天是星期二\n").stdout
    kinds = ("cross", "encoder", "decoder")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{n}-{kind}.png" for n in ("001", "003") for kind in kinds
    )


def test_typed_lines_are_those_typed_until_end_of_input():
    from mtrain.commands.translate import typed_lines

    typed = iter(["我是谁", "", "  今天是星期二 ", KeyboardInterrupt, "他不会说英语。"])
    prompts = []

    def read(prompt):
        prompts.append(prompt)
        line = next(typed, EOFError)
        if isinstance(line, type):
            raise line
        return line

    assert list(typed_lines("zh> ", read)) == ["我是谁", "今天是星期二", "他不会说英语。"]
    assert prompts == ["zh> "] * 6


def read_until(fd: int, text: str, seconds: float = 120) -> str:
    """Read a terminal's output until `text` appears (or fail after `seconds`)."""
    import select
    import time

    out, deadline = b"", time.monotonic() + seconds
    while text.encode() not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"no {text!r} in {out.decode(errors='replace')!r}"
        if select.select([fd], [], [], left)[0]:
            out += os.read(fd, 4096)
    return out.decode()


def test_translate_on_a_terminal_prompts_for_sentences(run_dir):
    import pty

    expected = mtrain("translate", "--run", str(run_dir), "我是谁", "今天是星期二").stdout
    master, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtrain", "translate", "--run", str(run_dir)],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb"},
        start_new_session=True,
    )
    os.close(terminal)
    try:
        read_until(master, "zh> ")
        os.write(master, "我是谁\n".encode())
        first = read_until(master, "zh> ")
        os.write(master, "今天是星期二\n".encode())
        second = read_until(master, "zh> ")
        os.write(master, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)
    for answer, line in zip((first, second), expected.splitlines()):
        assert line in answer.replace("\r\n", "\n").splitlines()


def test_english_to_chinese_trains_and_is_scored_with_the_zh_tokenizer(corpus, tmp_path):
    out = tmp_path / "en-zh"
    # The corpus holds zh<TAB>en, as the shipped one: read swapped, as default-en-zh.yaml does.
    settings = [
        *overrides(corpus, max_steps=20, eval_every=20),
        *("data.src_lang=en", "data.tgt_lang=zh", "data.swap_columns=true"),
    ]
    command = ["train", "--config", "configs/tiny.yaml", "--out", str(out)]
    result = mtrain(*command, *(f"--set={s}" for s in settings))
    assert result.returncode == 0, result.stderr
    import sentencepiece as spm

    src = spm.SentencePieceProcessor(model_file=str(out / "spm.src.model"))
    tgt = spm.SentencePieceProcessor(model_file=str(out / "spm.tgt.model"))
    assert src.piece_to_id("▁one") != src.unk_id()  # English source pieces
    assert tgt.piece_to_id("一") != tgt.unk_id()  # Chinese target pieces
    scores = mtrain("eval", "--run", str(out), "--json")
    assert scores.returncode == 0, scores.stderr
    scores = json.loads(scores.stdout)
    assert "tok:zh" in scores["bleu_signature"]
    assert scores["hypotheses"].endswith("test.hyp.zh")
    assert 0 <= scores["bleu"] <= 100
