"""Faults lose nothing and say one line: overwritten inputs, concurrent trainers, full disks,
bad bytes, bad options, misleading messages."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from mtrain.core import config
from mtrain.core.config import ConfigError
from mtrain.core.files import DirectoryLock, atomic_open
from mtrain.run.directory import CheckpointError, load_checkpoint
from mtrain.training.build import build_trainer

from .synthetic import REPO, overrides, small_config

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def mtrain(*args, input=None, file_size_limit=None):
    """Run the CLI; `file_size_limit` makes every write past that many bytes fail, as on a full
    disk (EFBIG instead of ENOSPC: the same path through the code)."""

    def limit_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(
        [sys.executable, "-m", "mtrain", *args],
        input=input,
        capture_output=True,
        cwd=REPO,
        env=ENV,
        preexec_fn=limit_writes if file_size_limit else None,
    )


def one_line_error(result, message: str) -> str:
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mtrain: error:")]
    assert len(lines) == 1 and message in lines[0], stderr
    return lines[0]


def train_args(run: Path, corpus, **train_keys) -> list[str]:
    settings = [f"--set={s}" for s in overrides(corpus, **train_keys)]
    return ["train", "--config", "configs/tiny.yaml", "--out", str(run), *settings]


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("faults") / "run"
    result = mtrain(*train_args(run, corpus, max_steps=4, eval_every=2))
    assert result.returncode == 0, result.stderr.decode()
    return run


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


# Data loss


def test_output_that_is_the_input_is_refused(run_dir, tmp_path):
    source = tmp_path / "f.zh"
    source.write_text("一二\n三\n", encoding="utf-8")
    link = tmp_path / "link.zh"
    link.symlink_to(source)
    for output in (source, link):
        result = mtrain("translate", "--run", str(run_dir), "-i", str(source), "-o", str(output))
        one_line_error(result, "is the input file")
        with source.open("rb") as stdin:  # mtrain translate -o f.zh < f.zh
            command = [sys.executable, "-m", "mtrain", "translate", "--run", str(run_dir)]
            result = subprocess.run(
                [*command, "-o", str(output)], stdin=stdin, capture_output=True, cwd=REPO, env=ENV
            )
        one_line_error(result, "is the input file")
    assert source.read_text(encoding="utf-8") == "一二\n三\n"


def read_fifo_in_background(fifo: Path) -> tuple[threading.Thread, list[bytes]]:
    """A reader waiting on `fifo`, as `cat fifo` would; what it read lands in the list."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    return reader, got


def test_output_onto_a_fifo_is_written_to_its_reader(run_dir, tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader, got = read_fifo_in_background(fifo)
    result = mtrain("translate", "--run", str(run_dir), "-o", str(fifo), "一", "二")
    assert result.returncode == 0, result.stderr.decode()
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # a rename would have put a file in its place
    reader.join(timeout=60)  # the writer has exited: the reader has its end of file
    assert len(got[0].decode().splitlines()) == 2
    assert leftovers(tmp_path) == []


def test_plot_onto_a_fifo_is_written_to_its_reader(tmp_path):
    fifo = tmp_path / "positional.png"
    os.mkfifo(fifo)
    reader, got = read_fifo_in_background(fifo)
    result = subprocess.run(
        [sys.executable, "-m", "mtrain", "plot", "positional", "-o", str(fifo)],
        capture_output=True,
        cwd=tmp_path,  # no runs/ here: the default config's sizes
        env=ENV,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    reader.join(timeout=60)
    assert got[0].startswith(b"\x89PNG")


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a device needs root")
def test_output_onto_a_character_device_keeps_the_device(run_dir, tmp_path):
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)  # a copy of /dev/null
    result = mtrain("translate", "--run", str(run_dir), "-o", str(null), "一")
    assert result.returncode == 0, result.stderr.decode()
    kept = null.lstat()
    assert stat.S_ISCHR(kept.st_mode) and kept.st_rdev == os.stat("/dev/null").st_rdev


def test_output_to_dev_stdout_goes_down_the_pipe(run_dir):
    to_stdout = mtrain("translate", "--run", str(run_dir), "一", "二")
    result = mtrain("translate", "--run", str(run_dir), "-o", "/dev/stdout", "一", "二")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == to_stdout.stdout and len(result.stdout.splitlines()) == 2


def test_output_onto_a_directory_or_a_socket_is_refused(run_dir, tmp_path):
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "s.png"))
    (tmp_path / "d.png").mkdir()
    for name, kind in (("d.png", "a directory"), ("s.png", "a socket")):
        path = tmp_path / name
        translate = mtrain("translate", "--run", str(run_dir), "-o", str(path), "一")
        one_line_error(translate, f"--output {path}: is {kind}")
        plot = mtrain("plot", "positional", str(run_dir), "-o", str(path))
        one_line_error(plot, f"{path}: is {kind}")
    assert stat.S_ISSOCK((tmp_path / "s.png").lstat().st_mode)
    server.close()


def test_failed_translation_leaves_the_previous_output_untouched(run_dir, tmp_path):
    source, output = tmp_path / "in.zh", tmp_path / "out.en"
    source.write_bytes("一二\n三\n".encode() + b"\xff\n")
    output.write_text("an earlier translation\n", encoding="utf-8")
    result = mtrain("translate", "--run", str(run_dir), "-i", str(source), "-o", str(output))
    one_line_error(result, f"{source}:3: not valid UTF-8")
    assert output.read_text(encoding="utf-8") == "an earlier translation\n"
    assert leftovers(tmp_path) == []
    # The error starts its own line, not glued to the progress bar's.
    assert "\nmtrain: error:" in "\n" + result.stderr.decode().replace("\r", "\n")


def test_atomic_open_keeps_the_old_file_when_the_block_fails(tmp_path):
    path = tmp_path / "file"
    path.write_text("old")
    for failure in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        with pytest.raises(type(failure)), atomic_open(path, "w") as f:
            f.write("half of the new")
            raise failure
        assert path.read_text() == "old" and leftovers(tmp_path) == []
    with atomic_open(path, "w") as f:
        f.write("new")
    assert path.read_text() == "new" and leftovers(tmp_path) == []


def test_second_trainer_on_a_run_directory_is_refused(corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with DirectoryLock(run):  # this process trains into it
        result = mtrain(*train_args(run, corpus, max_steps=2, eval_every=2))
        one_line_error(result, f"in use by another mtrain process (pid {os.getpid()} on")
        average = mtrain("average", "--run", str(run))
        assert average.returncode == 2
    assert not (run / "last.pt").exists()


def test_a_killed_holder_releases_the_lock(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from mtrain.core.files import DirectoryLock; "
            f"lock = DirectoryLock(pathlib.Path({str(tmp_path)!r})).__enter__(); "
            "print('locked', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(Exception, match="in use by another mtrain process"):
        DirectoryLock(tmp_path).__enter__()
    holder.kill()
    holder.wait()
    with DirectoryLock(tmp_path):  # the kernel released the dead holder's lock
        pass


def test_full_disk_at_start_up_leaves_no_partial_file(run_dir, corpus, tmp_path):
    run = tmp_path / "run"  # the corpus is prepared (by run_dir): the run copies its tokenizer
    result = mtrain(*train_args(run, corpus, max_steps=2, eval_every=2), file_size_limit=1000)
    one_line_error(result, f"{run / 'spm.src.model'}: File too large")
    assert leftovers(run) == []
    assert not (run / "spm.src.model").exists()


def test_full_disk_at_a_checkpoint_keeps_the_last_one(run_dir, corpus, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = (run / "last.pt").read_bytes()
    args = train_args(run, corpus, max_steps=6, eval_every=2)
    result = mtrain(*args, file_size_limit=len(before) // 2)
    line = one_line_error(result, f"{run / 'last.pt'}: File too large; ")
    assert f"{run / 'last.pt'} (step 4) is intact" in line
    assert (run / "last.pt").read_bytes() == before
    assert leftovers(run) == []


def test_leftovers_of_a_killed_run_are_removed_at_start_up(run_dir, corpus, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    killed = subprocess.Popen([sys.executable, "-c", ""])
    killed.wait()  # a writer that is gone, as a killed run is
    for name in (f".last.pt.{killed.pid}.tmp", "last.pt.tmp"):
        (run / name).write_bytes(b"half a checkpoint")
    # A file another process is writing right now (`translate -o run/out.en`) is its own.
    writing = run / f".out.en.{os.getpid()}.tmp"
    writing.write_bytes(b"a translation under way")
    result = mtrain(*train_args(run, corpus, max_steps=6, eval_every=2))
    assert result.returncode == 0, result.stderr.decode()
    assert leftovers(run) == [writing.name]
    assert load_checkpoint(run / "last.pt")["step"] == 6


# The test split counts too: training pairs whose source is a test source are dropped.
@pytest.mark.parametrize("key", ["train", "test"])
def test_changed_training_data_is_refused_on_resume(corpus, tmp_path, key):
    data = tmp_path / f"{key}.tsv"
    data.write_text(Path(corpus[key]).read_text(encoding="utf-8"), encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    cfg = small_config({**corpus, key: str(data)}, max_steps=2, eval_every=2)
    build_trainer(cfg, run, torch.device("cpu")).run()
    with data.open("a", encoding="utf-8") as f:
        f.write("一\tone\n")
    with pytest.raises(
        CheckpointError, match=rf"data\.{key}: .* is not what .*last\.pt was trained on"
    ):
        build_trainer(cfg, run, torch.device("cpu"), resume=True)


# One line where a traceback was


def test_invalid_utf8_on_stdin_names_the_line(run_dir):
    result = mtrain("translate", "--run", str(run_dir), input="一\n二\n".encode() + b"\xc3\x28\n")
    one_line_error(result, "<stdin>:3: not valid UTF-8")


@pytest.mark.parametrize(
    "args, message",
    [
        (["translate", "--beam", "0", "一"], "Invalid value for '--beam'"),
        (["translate", "-i", "configs", "一"], "is a directory"),
        (["train"], "Missing option '--config'"),
        (["nonsense"], "No such command 'nonsense'"),
        (["translate", "--device", "gpu", "一"], "--device 'gpu': expected auto, cpu, cuda"),
    ],
)
def test_option_errors_are_one_line(args, message):
    one_line_error(mtrain(*args), message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line(run_dir):
    result = mtrain("translate", "--run", str(run_dir), "--device", "cuda", "一")
    one_line_error(result, "no CUDA GPU is available here")


def float_keys() -> list[str]:
    cfg = config.Config()
    return [
        f"{section}.{key}"
        for section, values in cfg.to_dict().items()
        for key, value in values.items()
        if isinstance(value, float)
    ]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan"])
def test_non_finite_numbers_are_refused(value):
    assert len(float_keys()) >= 8
    for key in float_keys():
        with pytest.raises(ConfigError, match=f"{key}: expected a finite number"):
            config.load(REPO / "configs" / "tiny.yaml", [f"{key}={value}"])
    result = mtrain("train", "--config", "configs/tiny.yaml", "--set", f"train.lr={value}")
    one_line_error(result, "train.lr: expected a finite number")


def test_out_that_is_a_file_is_one_line(corpus, tmp_path):
    out = tmp_path / "file"
    out.write_text("mine")
    one_line_error(mtrain(*train_args(out, corpus)), "exists and is not a directory")
    assert out.read_text() == "mine"


def test_output_in_a_missing_directory_is_one_line(run_dir, tmp_path):
    result = mtrain("translate", "--run", str(run_dir), "-o", str(tmp_path / "no" / "x"), "一")
    one_line_error(result, "no such directory")


def test_eval_of_nothing_is_one_line(run_dir, tmp_path):
    empty = tmp_path / "empty.zh"
    empty.write_text("")
    result = mtrain("eval", "--run", str(run_dir), "--src", str(empty), "--ref", str(empty))
    one_line_error(result, "no sentences to evaluate")


def test_eval_prints_scores_when_the_hypotheses_cannot_be_saved(run_dir, tmp_path):
    src, ref = tmp_path / "s.zh", tmp_path / "r.en"
    src.write_text("一二三\n" * 50, encoding="utf-8")
    ref.write_text("one two three\n" * 50, encoding="utf-8")
    args = ["eval", "--run", str(run_dir), "--src", str(src), "--ref", str(ref), "--json"]
    result = mtrain(*args, file_size_limit=10)  # the hypotheses are longer than 10 bytes
    assert result.returncode == 0, result.stderr.decode()
    scores = json.loads(result.stdout)
    assert scores["hypotheses"] is None and scores["sentences"] == 50
    assert "cannot write" in result.stderr.decode()
    assert not (run_dir / "s.zh.hyp.en").exists()


# Messages that mislead


def test_unloadable_checkpoints_never_suggest_unsafe_loading(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    unsafe, cut = tmp_path / "unsafe.pt", tmp_path / "cut.pt"
    torch.save({"model": Payload()}, unsafe)
    torch.save({"model": {"w": torch.zeros(1000)}}, cut)
    cut.write_bytes(cut.read_bytes()[:500])
    for path in (unsafe, cut):
        with pytest.raises(CheckpointError, match="not a loadable mtrain checkpoint") as e:
            load_checkpoint(path)
        assert "weights_only" not in str(e.value)


def test_checkpoint_outside_the_run_is_refused(run_dir):
    for name in ("../run/best.pt", str(run_dir / "best.pt")):
        result = mtrain("translate", "--run", str(run_dir), "--checkpoint", name, "一")
        one_line_error(result, "not a path")


# The child runs `mtrain` as the console script does. Its tokenizer phase ends only once the test
# has sent SIGINT: the signal lands during SentencePiece's C++ trainer (Python runs its handler
# when the call returns) or while the phase waits, however fast the machine.
HELD_TOKENIZER = """
import sys
from mtrain.data import tokenizer
from mtrain.__main__ import main

train_model = tokenizer._train_model

def held(*args, **kwargs):
    sys.stderr.write("tokenizer phase\\n")
    sys.stderr.flush()
    model = train_model(*args, **kwargs)
    sys.stdin.readline()  # the test writes a line once it has sent SIGINT
    return model

tokenizer._train_model = held
main()
"""

# Ctrl-C as the import of $MODULE begins: torch's import takes seconds.
INTERRUPTED_IMPORT = """
import os, signal, sys
from mtrain.__main__ import main

class Interrupt:  # one Ctrl-C, the first time $MODULE is imported
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("MODULE"):
            del os.environ["MODULE"]
            os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before kill returns
        return None

sys.meta_path.insert(0, Interrupt())
main()
"""


def ignoring_sigint() -> None:
    """What a script's `cmd &` does to its jobs; Python then keeps SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_stop_before_the_first_checkpoint_does_not_claim_one(corpus, tmp_path):
    """Ctrl-C while the tokenizers train; even one that started ignoring SIGINT counts."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        # A corpus of its own to prepare: the shared one may be prepared (no tokenizer trains).
        [
            sys.executable,
            "-c",
            HELD_TOKENIZER,
            *train_args(run, {**corpus, "prepared_dir": tmp_path / "prepared"}, max_steps=2),
        ],
        cwd=REPO,
        env=ENV,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignoring_sigint,
    )
    for line in proc.stderr:
        if line == "tokenizer phase\n":
            proc.send_signal(signal.SIGINT)
            proc.stdin.write("sent\n")
            proc.stdin.close()
            break
    stderr = proc.stderr.read()
    assert proc.wait() == 130, stderr
    assert not (run / "last.pt").exists()
    assert "no checkpoint had been written" in stderr and "intact" not in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("inherited", ["default", "ignored"])
# numpy: torch's C extension imports it, and would drop the KeyboardInterrupt.
@pytest.mark.parametrize("module", ["torch", "numpy.__config__"])
def test_ctrl_c_during_the_slow_imports_is_one_line(inherited, module):
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IMPORT, "info", "--config", "configs/tiny.yaml"],
        cwd=REPO,
        env={**ENV, "MODULE": module},
        capture_output=True,
        text=True,
        preexec_fn=ignoring_sigint if inherited == "ignored" else None,
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr == "mtrain: interrupted\n" and result.stdout == ""


def test_out_that_holds_other_files_is_refused(corpus, tmp_path):
    (tmp_path / "config.yaml.bak").write_text("mine")
    (tmp_path / "notes.tmp").write_text("mine too")
    one_line_error(mtrain(*train_args(tmp_path, corpus)), "holds other files and no run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml.bak", "notes.tmp"]


def test_output_onto_a_file_of_the_run_is_refused(run_dir):
    result = mtrain("translate", "--run", str(run_dir), "-o", str(run_dir / "best.pt"), "一")
    one_line_error(result, "is a file of the run")
    assert load_checkpoint(run_dir / "best.pt")["step"] > 0


def test_argument_that_is_not_utf8_is_one_line(run_dir):
    one_line_error(
        mtrain("translate", "--run", str(run_dir), b"\xff\xfe"), "argument 1: not valid UTF-8"
    )
