"""Every command that reads a run directory survives damage to any file of it: it exits 0, 2
(one `mtrain: error:` line) or 130, never with a traceback, and changes no other file.

The commands run in this process through `mtrain.cli.main` (a subprocess costs seconds of
`import torch`); an exception that escapes `main` is what a user would see as a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mtrain import cli

from .synthetic import REPO, overrides

FILES = (
    "config.yaml",
    "spm.src.model",
    "spm.tgt.model",
    "best.pt",
    "last.pt",
    "step-00000010.pt",
    "step-00000020.pt",
    "metrics.jsonl",
    "train.jsonl",
)


def run_cli(*args: str) -> tuple[int, str, str]:
    """`mtrain ARGS` in this process: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    sigterm = signal.getsignal(signal.SIGTERM)  # `translate` maps SIGTERM to Ctrl-C
    status = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main(list(args))
    except SystemExit as e:
        status = e.code
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A small run: validations at steps 10 and 20, both kept; training records at both."""
    run = tmp_path_factory.mktemp("damage") / "run"
    settings_ = overrides(corpus, max_steps=20, eval_every=10, keep_last=2)
    config = str(REPO / "configs" / "tiny.yaml")
    args = ["train", "--config", config, "--out", str(run), *(f"--set={s}" for s in settings_)]
    status, _, err = run_cli(*args)
    assert status == 0, err
    assert sorted(p.name for p in run.iterdir() if p.name in FILES) == sorted(FILES)
    return run


def readers(run: Path, out: Path) -> dict[str, list[str]]:
    """Each reading command, by name."""
    r = str(run)
    return {
        "info": ["info", r],
        "info --json": ["info", r, "--json"],
        "plot curves": ["plot", "curves", r, "-o", str(out / "c.png")],
        "plot positional": ["plot", "positional", r, "-o", str(out / "p.png")],
        "plot masks": ["plot", "masks", "一二", "--run", r, "-o", str(out / "m.png")],
        "translate": ["translate", "--run", r, "一二三"],
        "translate last.pt": ["translate", "--run", r, "--checkpoint", "last.pt", "四"],
        "eval": ["eval", "--run", r],
        "average": ["average", "--run", r, "--last", "2"],
        # The run's own config: max_steps is reached, so a resume reads everything and stops.
        "resume": ["train", "--config", str(run / "config.yaml"), "--out", r],
    }


# The commands that read each file.
READ_BY = {
    "config.yaml": [
        "info",
        "plot positional",
        "plot masks",
        "translate",
        "eval",
        "average",
        "resume",
    ],
    "spm.src.model": ["info --json", "plot masks", "translate", "resume"],
    "spm.tgt.model": ["info", "eval", "resume"],
    "best.pt": ["translate", "eval", "plot masks"],
    "last.pt": ["resume", "translate last.pt"],
    "step-00000010.pt": ["average"],
    "step-00000020.pt": ["average"],
    "metrics.jsonl": ["info", "plot curves", "resume"],
    "train.jsonl": ["info --json", "plot curves", "resume"],
}
OUTPUTS = {"averaged.pt", "test.hyp.en", ".lock"}  # what the commands may write into the run


def snapshot(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.name not in OUTPUTS}


def check(run: Path, out: Path, damaged: set[str], commands: list[str]) -> None:
    """Run `commands` on the damaged run; each exits 0, 2 or 130 and keeps the other files."""
    before = snapshot(run)
    for name in commands:
        status, _, err = run_cli(*readers(run, out)[name])  # an exception fails the test here
        errors = [line for line in err.splitlines() if line.startswith("mtrain: error:")]
        assert status in (0, 2, 130), (name, status, err)
        assert len(errors) == (status == 2), (name, err)
        if name == "resume" and status == 0:  # a resume that can go on trains, and writes
            before = snapshot(run)
            continue
        after = snapshot(run)
        for file, data in before.items():
            assert file in damaged or after.get(file) == data, (name, file, "changed")
        assert set(after) <= set(before), (name, set(after) - set(before))


@contextlib.contextmanager
def working_directory(path: Path):
    """Run from `path`: a config key lost to damage falls back to a default path relative to
    the working directory (data/tatoeba/...), which must not be the repository's bundled data."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


# Damage, one kind at a time. Each returns the files it changed.


def truncate(run: Path, file: str, rng: random.Random) -> set[str]:
    data = (run / file).read_bytes()
    (run / file).write_bytes(data[: rng.randrange(len(data))])
    return {file}


def random_bytes(run: Path, file: str, rng: random.Random) -> set[str]:
    (run / file).write_bytes(rng.randbytes(rng.choice([0, 1, 7, 100, 3000])))
    return {file}


WRONG_SHAPES = [[1, 2, 3], "text", None, 42, {}, {"step": "2"}, {"model": 5}, {"model": [1]}]


def wrong_shape(run: Path, file: str, rng: random.Random) -> set[str]:
    """Valid data of the wrong shape: a JSON line, a YAML document, a torch.save."""
    value = rng.choice(WRONG_SHAPES)
    path = run / file
    if file.endswith(".jsonl"):
        lines = path.read_text().splitlines(keepends=True)
        lines[rng.randrange(len(lines))] = json.dumps(value) + "\n"
        path.write_text("".join(lines))
    elif file.endswith(".pt"):
        torch.save(value, path)
    else:  # JSON is YAML; a SentencePiece model gets the same bytes
        path.write_text(json.dumps(value))
    return {file}


def missing_key(run: Path, file: str, rng: random.Random) -> set[str]:
    """A record, config or checkpoint without one of its keys."""
    path = run / file
    if file.endswith(".jsonl"):
        lines = path.read_text().splitlines(keepends=True)
        i = rng.randrange(len(lines))
        record = json.loads(lines[i])
        del record[rng.choice(sorted(record))]
        lines[i] = json.dumps(record) + "\n"
        path.write_text("".join(lines))
    elif file.endswith(".pt"):
        state = torch.load(path, weights_only=True)
        del state[rng.choice(sorted(state))]
        torch.save(state, path)
    elif file == "config.yaml":
        raw = yaml.safe_load(path.read_text())
        section = rng.choice(sorted(raw))
        if rng.random() < 0.3:
            del raw[section]
        else:
            del raw[section][rng.choice(sorted(raw[section]))]
        path.write_text(yaml.safe_dump(raw))
    else:  # a SentencePiece model has no keys to lose: lose its second half
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return {file}


def swapped(run: Path, file: str, rng: random.Random) -> set[str]:
    other = rng.choice([f for f in FILES if f != file])
    a, b = (run / file).read_bytes(), (run / other).read_bytes()
    (run / file).write_bytes(b)
    (run / other).write_bytes(a)
    return {file, other}


def torn_last_line(run: Path, file: str, rng: random.Random) -> set[str]:
    """What a trainer killed mid-append leaves; for a file that is not a log, a truncation."""
    if not file.endswith(".jsonl"):
        return truncate(run, file, rng)
    with (run / file).open("a") as f:
        f.write('{"event": "validation", "step": 30, "minu')
    return {file}


DAMAGES = {
    f.__name__: f
    for f in (truncate, random_bytes, wrong_shape, missing_key, swapped, torn_last_line)
}


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI never flakes
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    file=st.sampled_from(FILES),
    damage=st.sampled_from(sorted(DAMAGES)),
    seed=st.integers(0, 2**32 - 1),
)
# The cases an adversarial run found, kept whatever Hypothesis draws.
@example(file="metrics.jsonl", damage="random_bytes", seed=3)
@example(file="train.jsonl", damage="wrong_shape", seed=0)
@example(file="metrics.jsonl", damage="missing_key", seed=0)
@example(file="spm.src.model", damage="random_bytes", seed=0)
@example(file="last.pt", damage="wrong_shape", seed=0)
@example(file="train.jsonl", damage="torn_last_line", seed=0)
def test_every_reader_survives_damage_to_any_file(trained, file, damage, seed):
    with tempfile.TemporaryDirectory() as tmp, working_directory(Path(tmp)):
        run, out = Path(tmp) / "run", Path(tmp) / "out"
        shutil.copytree(trained, run)  # copies: best.pt is a hard link to a step checkpoint
        out.mkdir()
        damaged = DAMAGES[damage](run, file, random.Random(seed))
        commands = sorted({c for f in damaged for c in READ_BY[f]})
        check(run, out, damaged, commands)


# The cases, with the message each must give.


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


@pytest.mark.parametrize(
    "line, message",
    [
        (b"\x8f\xffbinary\x00", "metrics.jsonl:1: not a log record: not UTF-8 text"),
        (b"[1, 2, 3]", "metrics.jsonl:1: not a log record: expected a JSON object"),
        (
            b'{"event": "validation", "minutes": 1.0}',
            'metrics.jsonl:1: not a log record: no "step"',
        ),
    ],
)
def test_a_bad_log_line_is_named_by_plot_and_info(run, tmp_path, line, message):
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(line + b"\n" + metrics.read_bytes())
    for args in (["plot", "curves", str(run), "-o", str(tmp_path / "c.png")], ["info", str(run)]):
        status, out, err = run_cli(*args)
        assert status == 2 and out == ""
        assert err.strip().startswith("mtrain: error:") and message in err, err


def test_a_torn_last_line_is_skipped_by_plot_info_and_resume(run, tmp_path, caplog):
    for name in ("metrics.jsonl", "train.jsonl"):
        with (run / name).open("a") as f:
            f.write('{"event": "validation", "step": 30, "minu')
    status, out, _ = run_cli("plot", "curves", str(run), "-o", str(tmp_path / "c.png"))
    assert status == 0 and out.strip() == str(tmp_path / "c.png")
    status, out, _ = run_cli("info", str(run), "--json")
    assert status == 0 and json.loads(out)["training"]["steps"] == 20
    assert "train.jsonl:3: skipped a torn last line" in caplog.text
    status, _, err = run_cli("train", "--config", str(run / "config.yaml"), "--out", str(run))
    assert status == 0, err
    assert (run / "metrics.jsonl").read_text().endswith("}\n")  # resume cut the torn line


def test_info_without_tokenizer_models_is_one_line(run):
    (run / "spm.src.model").unlink()
    status, out, err = run_cli("info", str(run))
    assert status == 2 and out == ""
    model = run / "spm.src.model"
    assert err == f"mtrain: error: {model}: no such file (a SentencePiece model of the run)\n"


@pytest.mark.parametrize("command", [["curves", "{run}"], ["positional"], ["masks", "一"]])
@pytest.mark.parametrize("suffix", [".txt", ".csv", ""])
def test_plot_refuses_an_output_format_it_cannot_write_before_drawing(
    run, tmp_path, command, suffix, monkeypatch
):
    from mtrain.figures import curves, masks, positional

    def no_drawing(*args, **kwargs):
        raise AssertionError("drew a figure it cannot write")

    drawings = {curves: "draw_curves", positional: "draw_positional", masks: "draw_masks"}
    for module, name in drawings.items():
        monkeypatch.setattr(module, name, no_drawing)
    output = tmp_path / f"figure{suffix}"
    args = [a.format(run=run) for a in command]
    status, _, err = run_cli("plot", *args, "-o", str(output))
    assert status == 2, err
    assert f"{output}: cannot draw a figure into" in err
    assert ".pdf" in err and ".svg" in err and not output.exists()


def test_a_directory_as_training_data_is_named(corpus, tmp_path):
    args = overrides({**corpus, "train": str(tmp_path)})
    status, _, err = run_cli(
        "train", "--config", str(REPO / "configs" / "tiny.yaml"), *(f"--set={s}" for s in args)
    )
    assert status == 2
    assert f"data.train: {tmp_path} is a directory" in err


def test_resume_without_last_pt_keeps_the_other_checkpoints(run):
    (run / "last.pt").unlink()
    best = (run / "best.pt").read_bytes()
    status, _, err = run_cli("train", "--config", str(run / "config.yaml"), "--out", str(run))
    assert status == 2 and "holds checkpoints but no last.pt" in err
    assert (run / "best.pt").read_bytes() == best


# Prepared corpora damaged as a disk or a careless copy leaves them.


def cut_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def overwrite_ff(path: Path) -> None:
    """0xFF over the whole file, its size kept: every id past the vocabulary."""
    path.write_bytes(b"\xff" * path.stat().st_size)


PREPARED_DAMAGE = {
    "truncated src_offsets.npy": ("src_offsets.npy", cut_half),
    "truncated src.bin": ("src.bin", cut_half),
    "truncated tgt_len.npy": ("tgt_len.npy", cut_half),
    "0xFF over src.bin": ("src.bin", overwrite_ff),
}


@pytest.fixture(scope="module")
def prepared_once(corpus, tmp_path_factory) -> Path:
    """A prepared corpus to copy: preparing it costs a tokenizer's training."""
    from mtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    return prepare(prepared_config({**corpus, "prepared_dir": str(root)}))


def prepared_config(corpus):
    from mtrain.core import config

    return config.load(REPO / "configs" / "tiny.yaml", overrides(corpus))


@pytest.mark.parametrize("damage", sorted(PREPARED_DAMAGE))
def test_a_damaged_prepared_corpus_is_refused_then_prepared_again(
    corpus, prepared_once, tmp_path, damage
):
    """Training refuses it in one line naming the directory; `mtrain prepare` prepares it
    again, to the same bytes."""
    root = tmp_path / "prepared"
    shutil.copytree(prepared_once, root / prepared_once.name)
    target = root / prepared_once.name
    files = {p.name: p.read_bytes() for p in target.iterdir()}
    name, damage_it = PREPARED_DAMAGE[damage]
    damage_it(target / name)
    sets = [f"--set={s}" for s in overrides({**corpus, "prepared_dir": str(root)}, max_steps=2)]
    config = str(REPO / "configs" / "tiny.yaml")
    status, _, err = run_cli("train", "--config", config, "--out", str(tmp_path / "run"), *sets)
    errors = [line for line in err.splitlines() if line.startswith("mtrain: error:")]
    assert status == 2 and len(errors) == 1, err
    assert errors[0].startswith(f"mtrain: error: {target}: damaged prepared corpus: ")
    assert errors[0].endswith("; `mtrain prepare` prepares it again")
    # One path, one reason, one advice: a reason wrapped in another names none of them again.
    for part in (str(target), "damaged prepared corpus", "prepares it again"):
        assert errors[0].count(part) == 1, errors[0]
    status, out, err = run_cli("prepare", "--config", config, *sets)
    assert status == 0, err
    assert out.strip() == str(target)
    again = {p.name: p.read_bytes() for p in target.iterdir()}
    for file in ("src.bin", "tgt.bin", "src_len.npy", "tgt_len.npy", "src_offsets.npy"):
        assert again[file] == files[file], file
    status, out, err = run_cli("prepare", "--config", config, *sets)  # now it is sound
    assert status == 0 and "damaged" not in err and "prepared " not in err


@pytest.mark.parametrize("manifest", ["[]", '{"inputs": 3}', '{"format": 1, "inputs": [3]}'])
@pytest.mark.parametrize("command", ["train", "prepare"])
def test_a_manifest_of_the_wrong_shape_is_prepared_again(
    corpus, prepared_once, tmp_path, caplog, manifest, command
):
    """Valid JSON that is no manifest is a damaged corpus, prepared again as a torn one is:
    by training and by `mtrain prepare`, with one warning, no traceback."""
    from mtrain.data.prepared import MANIFEST, read_manifest

    root = tmp_path / "prepared"
    shutil.copytree(prepared_once, root / prepared_once.name)
    target = root / prepared_once.name
    tokens = (target / "src.bin").read_bytes()
    (target / MANIFEST).write_text(manifest)
    sets = [f"--set={s}" for s in overrides({**corpus, "prepared_dir": str(root)}, max_steps=2)]
    out = ["--out", str(tmp_path / "run")] if command == "train" else []
    status, _, err = run_cli(command, "--config", str(REPO / "configs" / "tiny.yaml"), *out, *sets)
    assert status == 0 and "Traceback" not in err, err
    warnings = [r.getMessage() for r in caplog.records if "preparing it again" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"{target}: {MANIFEST} "), warnings
    assert read_manifest(target)["pairs"] > 0 and (target / "src.bin").read_bytes() == tokens


def test_a_damaged_prepared_corpus_is_named_once(prepared_once, tmp_path):
    """The reason of a check that fails inside another check is not wrapped in a second one."""
    from mtrain.data.prepared import DamagedCorpus
    from mtrain.data.token_corpus import TokenCorpus

    target = tmp_path / prepared_once.name
    shutil.copytree(prepared_once, target)
    cut_half(target / "src_offsets.npy")
    with pytest.raises(DamagedCorpus) as refused:
        TokenCorpus(target)
    reason = "src_offsets.npy is truncated or unreadable ("
    assert str(refused.value).startswith(f"{target}: damaged prepared corpus: {reason}")
    assert str(refused.value).endswith("; `mtrain prepare` prepares it again")
    for part in (str(target), "damaged prepared corpus", "prepares it again"):
        assert str(refused.value).count(part) == 1, refused.value


def test_a_corpus_prepared_before_manifests_recorded_vocab_and_checksums_is_read(
    prepared_once, tmp_path
):
    from mtrain.data.prepared import MANIFEST
    from mtrain.data.token_corpus import TokenCorpus

    target = tmp_path / prepared_once.name
    shutil.copytree(prepared_once, target)
    manifest = json.loads((target / MANIFEST).read_text())
    older = {k: v for k, v in manifest.items() if k not in ("vocab", "files")}
    (target / MANIFEST).write_text(json.dumps(older))
    assert len(TokenCorpus(target)) == manifest["pairs"]


@pytest.mark.parametrize("cut", ["src_offsets.npy", "src.bin"])
def test_a_token_file_cut_short_after_opening_is_named_not_read_as_zeros(
    prepared_once, tmp_path, cut
):
    from mtrain.data.prepared import DamagedCorpus
    from mtrain.data.token_corpus import TokenCorpus

    target = tmp_path / prepared_once.name
    shutil.copytree(prepared_once, target)
    prepared = TokenCorpus(target)
    os.truncate(target / cut, 64)  # a pread past the end returns nothing
    last = np.array([len(prepared) - 1])
    with pytest.raises(DamagedCorpus, match=rf"^{target}: damaged prepared corpus: {cut} ends"):
        prepared.collate(last)


def test_offsets_that_disagree_with_the_lengths_are_refused(prepared_once, tmp_path):
    from mtrain.data.prepared import DamagedCorpus
    from mtrain.data.token_corpus import TokenCorpus

    target = tmp_path / prepared_once.name
    shutil.copytree(prepared_once, target)
    offsets = np.load(target / "tgt_offsets.npy")
    offsets[5] += 1  # the same size, one pair shifted
    np.save(target / "tgt_offsets.npy", offsets)
    with pytest.raises(DamagedCorpus, match=r"tgt_offsets\.npy disagrees with tgt_len\.npy"):
        TokenCorpus(target)
