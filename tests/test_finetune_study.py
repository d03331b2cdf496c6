"""scripts/finetune_study.py: its options, every run's settings and the slice are checked before
anything trains, a bad one said in one line as `mtrain` says its errors; a run that fails makes
the study's exit status 1."""

from __future__ import annotations

import subprocess

import pytest

from .console import REPO, run_script, script

PREFIX = "finetune_study.py: error: "
TINY = str(REPO / "configs" / "tiny.yaml")


def on(corpus: dict[str, str], **named: str) -> list[str]:
    """The --set options of the synthetic corpus, with `named` splits instead of its own."""
    return [f"--set=data.{split}={path}" for split, path in ({**corpus, **named}).items()]


def one_line(result: subprocess.CompletedProcess) -> str:
    """The one error line of a refusal (exit status 2): nothing trained, no traceback."""
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(PREFIX), line
    return line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--config", "nope.yaml"], "nope.yaml: cannot read config (No such file or directory)"),
        (["--slice-target", "("], "argument --slice-target: '(': not a regular expression"),
        (["--slice-source", "[a"], "argument --slice-source: '[a': not a regular expression"),
        (["--out", "a-file"], "--out a-file: exists and is not a directory"),
        (["--slice-heldout", "2"], "argument --slice-heldout: 2: expected a share above 0"),
        (["--slice-heldout", "0"], "argument --slice-heldout: 0: expected a share above 0"),
        (["--mix-pairs", "0"], "argument --mix-pairs: 0: expected 1 or more"),
        (["--slice-target", "^one", "--mix-pairs", "9999"], "--mix-pairs 9999: more than the"),
        (["--max-steps", "-3"], "--minutes/--max-steps: "),
        (["--finetune-minutes", "-1"], "--finetune-minutes/--finetune-max-steps: "),
        (["--restart", "train.lr"], "--restart 'train.lr': "),
        (["--seeds", "1", "-2"], "--seeds -2: "),
        (
            ["--slice-target", "^zz$", "--slice-source", "^zz$"],
            "the slice's 0 sources leave its test and dev and train no pairs",
        ),
    ],
)
def test_a_bad_option_is_refused_in_one_line_before_anything_trains(
    tmp_path, monkeypatch, capsys, corpus, args, said
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    common = ["--config", TINY, "--out", "study", *on(corpus)]
    result = run_script("finetune_study.py", *common, *args, monkeypatch=monkeypatch, capsys=capsys)
    assert said in one_line(result)
    assert not (tmp_path / "study").exists()


def test_a_missing_config_is_one_line_from_the_script(tmp_path):
    """What a user sees: the script's own process."""
    result = script("finetune_study.py", "--config", "nope.yaml", cwd=tmp_path)
    assert one_line(result) == PREFIX + "nope.yaml: cannot read config (No such file or directory)"


def test_a_failed_run_makes_the_exit_status_1(tmp_path, monkeypatch, capsys, corpus):
    """Each run is refused (its corpus is missing): its row says why, and the study fails."""
    monkeypatch.chdir(tmp_path)
    args = ["--config", TINY, "--out", "study", "--study", "longer", "--max-steps", "5"]
    args += on(corpus, train="missing.tsv")
    result = run_script("finetune_study.py", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert result.returncode == 1, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4 and all("data.train: no such file missing.tsv" in row for row in rows)
    assert result.stderr.splitlines()[-1] == PREFIX + "4 rows failed (the table says why)"
