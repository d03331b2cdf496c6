"""A user's journeys across features and versions, each test one story told by the console.

(a) A run begun and interrupted by an older release (tests/fixtures/old_releases, written by
that release itself) is resumed with today's mtrain: with today's shipped config, typed again,
and with the run's own; then info, translate, eval and serve on it. A start that does nothing
rewrites none of its files, so the release that wrote it can still read it.
(b) Train, fine-tune with --init-from on a corpus of one's own, interrupt and resume the child,
export it, serve it, load it from Python, score with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import mtrain
from mtrain.core.config_upgrade import VERSION
from mtrain.core.files import LOCK_FILE

from .console import REPO
from .console import mtrain as run_mtrain
from .synthetic import number_pairs, overrides
from .test_serve import Served

RELEASES = REPO / "tests/fixtures/old_releases"
SHIPPED = REPO / "configs/tiny.yaml"
SENTENCES = ["我是谁", "你好。"]


def step_of(checkpoint: Path) -> int:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["step"]


def weights_equal(a: Path, b: Path) -> None:
    first = torch.load(a, map_location="cpu", weights_only=True)["model"]
    second = torch.load(b, map_location="cpu", weights_only=True)["model"]
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def files_of(run: Path) -> dict[str, tuple[bytes, int]]:
    """Each file of a run directory: its bytes and its modification time. The lock file is
    left out: any start takes the run's lock to read it safely, and writes who holds it."""
    return {
        str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def changed(run: Path, before: dict[str, tuple[bytes, int]]) -> list[str]:
    """The files of `run` written, removed or added since `before` (files_of)."""
    after = files_of(run)
    names = before.keys() | after.keys()
    return sorted(name for name in names if before.get(name) != after.get(name))


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# (a) An old release's run, upgraded -------------------------------------------------------------


def made(commit: str) -> dict:
    return json.loads((RELEASES / commit / "made.json").read_text())


def old_release(commit: str, place: Path) -> Path:
    """A copy of the release's folder (its run and corpus) at `place`: the absolute paths its
    config.yaml records are moved along, as when a user moves a project."""
    shutil.copytree(RELEASES / commit, place)
    for config in place.glob("*/config.yaml"):
        text = config.read_text("utf-8").replace(made(commit)["root"], str(place))
        config.write_text(text, "utf-8")
    return place


def typed_again(
    commit: str, place: Path, *more: str, out: str = "run"
) -> subprocess.CompletedProcess:
    """The command that began the run `out`, typed again in its directory: the shipped config
    is today's configs/tiny.yaml, the rest as the user wrote it."""
    args = made(commit)["command"][1:]
    args[args.index("configs/tiny.yaml")] = str(SHIPPED)
    args[args.index("--out") + 1] = out
    return run_mtrain(*args, *more, cwd=place)


def said_upgraded(text: str) -> bool:
    """A line saying the run was upgraded, and from which version (both releases wrote
    config.yaml without a version line: version 1)."""
    return re.search(r"(?i)upgrad[^\n]*\b1\b", text) is not None


@pytest.fixture(scope="module", params=["0770be8", "da5aa77"])
def release(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def resumed(release, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The release's interrupted run, resumed by the command that began it, typed again."""
    place = old_release(release, tmp_path_factory.mktemp("old") / release)
    return place / "run", typed_again(release, place)


def test_an_old_run_resumes_with_the_shipped_config_typed_again(resumed):
    run, done = resumed
    assert done.returncode == 0, done.stderr
    assert "resuming run at step 6" in done.stderr
    assert step_of(run / "last.pt") == 20  # the 14 steps the interrupt left
    assert said_upgraded(done.stderr), done.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["version"] == VERSION


def test_an_old_run_resumes_with_its_own_config_to_the_same_weights(release, resumed, tmp_path):
    place = old_release(release, tmp_path / release)
    own = run_mtrain("train", "--config", "run/config.yaml", "--out", "run", cwd=place)
    assert own.returncode == 0, own.stderr
    assert step_of(place / "run/last.pt") == 20
    assert said_upgraded(own.stderr), own.stderr
    # The shipped config, typed again, means what the run's own record means: the same model.
    shipped_run, shipped = resumed
    assert shipped.returncode == 0, shipped.stderr
    weights_equal(place / "run/last.pt", shipped_run / "last.pt")


def test_info_translate_eval_and_serve_on_the_upgraded_run(resumed):
    run, done = resumed
    assert done.returncode == 0, done.stderr
    info = run_mtrain("info", str(run))
    assert info.returncode == 0, info.stderr
    assert "training: 20 steps" in info.stdout
    assert said_upgraded(info.stdout), info.stdout
    translated = run_mtrain("translate", "--run", str(run), input="\n".join(SENTENCES) + "\n")
    assert translated.returncode == 0, translated.stderr
    assert len(translated.stdout.split("\n")[:-1]) == len(SENTENCES)
    scored = run_mtrain("eval", "--run", str(run))
    assert scored.returncode == 0, scored.stderr
    assert "BLEU" in scored.stdout and "chrF" in scored.stdout
    # the server translates as the command
    assert served_translations(run) == translated.stdout.split("\n")[:-1]


def served_translations(run: Path, *options: str) -> list[str]:
    """SENTENCES translated by `mtrain serve` on `run`, healthy and stopped cleanly."""
    served = Served(run, *options)
    try:
        status, health = served.request("GET", "/health")
        assert status == 200 and health["status"] == "ok", health
        status, answer = served.post("/translate", {"text": SENTENCES})
        assert status == 200, answer
    finally:
        status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr
    return [t["text"] for t in answer["translations"]]


def old_code(commit: str, place: Path) -> Path:
    """The release's own mtrain package at `place`, from this clone's history. Where this clone
    cannot give it (no git, no history, a shallow clone) the test is skipped saying why, in the
    summary (pytest's -rs), never passed in silence."""
    if shutil.which("git") is None:
        why = "git is not installed"
    else:
        archive = subprocess.run(
            ["git", "archive", commit, "mtrain"], cwd=REPO, capture_output=True
        )
        if archive.returncode == 0:
            place.mkdir()
            subprocess.run(["tar", "-x", "-C", str(place)], input=archive.stdout, check=True)
            return place
        said = archive.stderr.decode("utf-8", errors="replace").strip().splitlines() or [""]
        why = f"git archive {commit}: {said[0] or f'status {archive.returncode}'}"
    message = (
        f"release {commit}'s own mtrain is not in this clone ({why}); a shallow clone gets it "
        "with `git fetch --unshallow`"
    )
    pytest.skip(message)


def old_release_reads(commit: str, run: Path, place: Path) -> None:
    """`mtrain info RUN` by the release itself."""
    code = old_code(commit, place)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    info = [sys.executable, "-m", "mtrain", "info", str(run)]
    old = subprocess.run(info, cwd=code, capture_output=True, text=True, env=env)
    assert old.returncode == 0, old.stderr
    assert "Transformer" in old.stdout


@pytest.fixture(scope="module")
def left_alone(release, tmp_path_factory) -> tuple[Path, dict, list[subprocess.CompletedProcess]]:
    """The release's run after starts of today's mtrain that do nothing to it (one refused, an
    info, a translate), its files as they were before them, and the starts."""
    place = old_release(release, tmp_path_factory.mktemp("left") / release)
    run = place / "run"
    before = files_of(run)
    starts = [typed_again(release, place, "--set=model.d_model=32")]  # not the run's model
    for command in (["info", str(run)], ["translate", "--run", str(run)]):
        starts.append(run_mtrain(*command, input="我是谁\n"))
    return run, before, starts


def test_a_start_that_does_nothing_rewrites_no_file_of_an_old_run(left_alone):
    run, before, (refused, *done) = left_alone
    assert refused.returncode == 2
    assert "model.d_model" in one_line(refused.stderr)
    for start in done:
        assert start.returncode == 0, start.stderr
    assert changed(run, before) == []


def test_the_old_release_reads_its_run_after_those_starts(release, left_alone, tmp_path):
    old_release_reads(release, left_alone[0], tmp_path / "code")


@pytest.fixture(scope="module")
def finished_again(tmp_path_factory) -> tuple[Path, dict, list[subprocess.CompletedProcess]]:
    """0770be8's run trained to its 20 steps, started again by today's mtrain with its own
    config and with the command typed again, its files before, and the starts."""
    place = old_release("0770be8", tmp_path_factory.mktemp("finished") / "0770be8")
    run = place / "finished"
    before = files_of(run)
    own = ["train", "--config", "finished/config.yaml", "--out", "finished"]
    starts = [run_mtrain(*own, cwd=place), typed_again("0770be8", place, out="finished")]
    return run, before, starts


def test_a_finished_old_run_started_again_does_nothing_and_rewrites_no_file(finished_again):
    run, before, starts = finished_again
    for again in starts:
        assert again.returncode == 0, again.stderr
        assert "raise train.max_steps to train on" in again.stderr  # nothing left to train
    assert changed(run, before) == []


def test_the_old_release_reads_its_finished_run_after_those_starts(finished_again, tmp_path):
    old_release_reads("0770be8", finished_again[0], tmp_path / "code")


# (b) Train, fine-tune, resume, export, serve, load, score ----------------------------------------


@pytest.fixture(scope="module")
def parent(corpus, tmp_path_factory) -> Path:
    """The tiny config trained from scratch, 10 updates on the synthetic corpus."""
    out = tmp_path_factory.mktemp("parent") / "run"
    settings = overrides(corpus, max_steps=10, eval_every=5)
    done = run_mtrain("train", "--config", str(SHIPPED), "--out", str(out), *sets(settings))
    assert done.returncode == 0, done.stderr
    return out


def sets(settings: list[str]) -> list[str]:
    return [f"--set={s}" for s in settings]


@pytest.fixture(scope="module")
def own_corpus(corpus, tmp_path_factory) -> dict[str, str]:
    """The user's own training corpus (another TSV), with the same dev and test sets."""
    root = tmp_path_factory.mktemp("own")
    path = root / "mine.tsv"
    path.write_text("".join(f"{zh}\t{en}\n" for zh, en in number_pairs(150, 7)), "utf-8")
    return {**corpus, "train": str(path), "prepared_dir": str(root / "prepared")}


def fine_tune(parent: Path, own_corpus, out: Path) -> list[str]:
    """`mtrain train` of a child of `parent` on the user's corpus: 12 updates."""
    settings = overrides(own_corpus, max_steps=12, eval_every=4)
    args = ["train", "--config", str(SHIPPED), "--out", str(out), "--init-from", str(parent)]
    return [*args, *sets(settings)]


@pytest.fixture(scope="module")
def child(parent, own_corpus, tmp_path_factory) -> dict[str, Path]:
    """The child, interrupted by Ctrl-C once its first checkpoint is written (a copy kept as
    it was then), and resumed by the same command typed again."""
    root = tmp_path_factory.mktemp("child")
    out = root / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtrain", *fine_tune(parent, own_corpus, out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not (out / "last.pt").exists() and proc.poll() is None:
        proc_wait(proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    interrupted = root / "interrupted"
    shutil.copytree(out, interrupted)
    again = run_mtrain(*fine_tune(parent, own_corpus, out))
    assert again.returncode == 0, again.stderr
    return {"run": out, "interrupted": interrupted, "stderr": again.stderr}


def proc_wait(proc: subprocess.Popen) -> None:
    """Wait a little for `proc`: the checkpoint is looked for again after."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=0.02)


def test_a_fine_tuned_run_interrupted_resumes_by_the_same_command(child, parent):
    interrupted = step_of(child["interrupted"] / "last.pt")
    assert interrupted < 12
    assert f"resuming {child['run']} at step {interrupted}\n" in child["stderr"], child["stderr"]
    assert step_of(child["run"] / "last.pt") == 12
    record = yaml.safe_load((child["run"] / "config.yaml").read_text())
    assert record["parent"]["run"] == str(parent)


def test_a_child_resumes_from_elsewhere_with_a_config_that_does_not_name_its_parent(
    child, own_corpus, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(child["interrupted"], run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    settings = sets(overrides(own_corpus, max_steps=12, eval_every=4))
    args = ["train", "--config", str(SHIPPED), "--out", str(run), *settings]
    done = run_mtrain(*args, cwd=elsewhere)
    assert done.returncode == 0, done.stderr  # a resume never reads the parent
    weights_equal(run / "last.pt", child["run"] / "last.pt")


def test_the_child_loaded_from_python_translates_and_scores_as_the_commands(child):
    run = child["run"]
    model = mtrain.load(run)
    mine = model.translate(SENTENCES)
    command = run_mtrain("translate", "--run", str(run), input="\n".join(SENTENCES) + "\n")
    assert command.returncode == 0, command.stderr
    assert mine == command.stdout.split("\n")[:-1]
    pairs = [(source, target or "one") for source, target in zip(SENTENCES, mine, strict=True)]
    scored = run_mtrain("score", "--run", str(run), input="".join(f"{s}\t{t}\n" for s, t in pairs))
    assert scored.returncode == 0, scored.stderr
    totals = [float(line.split("\t")[0]) for line in scored.stdout.splitlines()]
    expected = [score.total for score in model.score(*map(list, zip(*pairs, strict=True)))]
    assert totals == pytest.approx(expected, abs=1e-3)
    assert all(total < 0 for total in totals)


def test_the_child_exported_serves_and_loads_as_it_translates(child, tmp_path):
    pytest.importorskip("ctranslate2", reason="mtrain export needs ctranslate2")
    run, out = child["run"], tmp_path / "ct2"
    exported = run_mtrain("export", str(run), "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.strip() == str(out)
    expected = mtrain.load(run).translate(SENTENCES)
    assert mtrain.load(out, engine="ctranslate2").translate(SENTENCES) == expected
    assert served_translations(out, "--engine", "ctranslate2") == expected
