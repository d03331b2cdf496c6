"""`mtrain serve` on a run still training: the log reader, the checkpoint watcher, the page."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import torch

from mtrain.core import jsonl
from mtrain.core.files import LOCK_FILE, DirectoryLock, stamp
from mtrain.decoding.translator import Translator
from mtrain.run.directory import BEST, EXAMPLES, LAST, METRICS, TRAIN_LOG, load_checkpoint, load_run
from mtrain.serve import reload, training_view
from mtrain.serve.reload import ModelWatcher
from mtrain.serve.service import Service
from mtrain.serve.training_view import TrainingView

from .console import REPO
from .test_serve import Served, chromium

# The log reader ---------------------------------------------------------------------------------


def line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def example(source: str, translation: str, step: int) -> dict:
    """One example as training writes it: 1 layer, 2 heads, (tgt, src) weights."""
    src, tgt = ["▁我", "是", "谁", "</s>"], ["▁Who", "▁am", "▁I", "?", "</s>"]
    row = [round(1 / len(src), 3)] * len(src)
    return {
        "source": source,
        "reference": "Who am I?" if source == "我是谁" else None,
        "translation": translation,
        "src_pieces": src,
        "tgt_pieces": tgt,
        "attention": [[[row] * len(tgt), [[step / 1000] * len(src)] * len(tgt)]],
    }


def validation(step: int, *translations: str) -> dict:
    sources = ["我是谁", "你好"]
    items = [example(s, t, step) for s, t in zip(sources, translations)]
    return {"event": "validation", "step": step, "minutes": step / 100, "examples": items}


def view_of(run: Path) -> dict:
    return json.loads(TrainingView(run).read().body)


def test_a_run_with_no_logs_yet_reads_as_empty(tmp_path):
    view = view_of(tmp_path)
    assert view["train"] == {"step": [], "minutes": [], "loss": [], "lr": []}
    assert view["validations"] == [] and view["errors"] == []
    assert view["examples"] == {"sources": [], "references": [], "validations": []}
    assert TrainingView(tmp_path).attention(0, "我是谁") is None


def test_a_torn_last_line_waits_for_its_end_and_no_change_is_read_once(tmp_path, caplog):
    logs = TrainingView(tmp_path)
    records = [
        {"event": "train", "step": s, "minutes": s / 60, "loss": 9 - s / 10, "lr": 1e-3}
        for s in (10, 20, 30)
    ]
    text = "".join(line(r) for r in records)
    (tmp_path / TRAIN_LOG).write_text(text[:-9], "utf-8")  # the third line half written
    with caplog.at_level(logging.WARNING):
        first = logs.read()
    assert json.loads(first.body)["train"]["step"] == [10, 20]
    assert not caplog.records  # a line still being written is no warning
    assert logs.read() is first  # nothing changed: nothing parsed again
    (tmp_path / TRAIN_LOG).write_text(text, "utf-8")
    second = logs.read()
    assert json.loads(second.body)["train"]["step"] == [10, 20, 30]
    assert second.etag != first.etag


def test_a_damaged_line_keeps_the_last_good_reading_and_is_reported(tmp_path):
    metrics = tmp_path / METRICS
    good = line(
        {"event": "validation", "step": 100, "minutes": 1.0, "dev_bleu": 3.5, "dev_loss": 5}
    )
    metrics.write_text(good, "utf-8")
    logs = TrainingView(tmp_path)
    assert [v["dev_bleu"] for v in json.loads(logs.read().body)["validations"]] == [3.5]
    metrics.write_text(good + "{not json\n" + good, "utf-8")
    view = json.loads(logs.read().body)
    assert [v["dev_bleu"] for v in view["validations"]] == [3.5]
    assert f"{metrics}:2: not a log record" in view["errors"][0]


def test_examples_grow_a_row_per_validation_with_their_attention(tmp_path):
    path = tmp_path / EXAMPLES
    path.write_text(line(validation(50, "I", "Hi")) + line(validation(100, "Who am I?", "Hello")))
    logs = TrainingView(tmp_path)
    examples = json.loads(logs.read().body)["examples"]
    assert examples["sources"] == ["我是谁", "你好"]
    assert examples["references"] == ["Who am I?", None]
    assert [(v["step"], v["translations"]) for v in examples["validations"]] == [
        (50, ["I", "Hi"]),
        (100, ["Who am I?", "Hello"]),
    ]
    with path.open("a", encoding="utf-8") as f:  # a third validation, half written
        f.write(line(validation(150, "Who am I?", "Hello"))[:100])
    assert len(json.loads(logs.read().body)["examples"]["validations"]) == 2
    att = logs.attention(1, "你好")
    assert att["step"] == 100 and att["tgt_pieces"][0] == "▁Who"
    layers = att["attention"]  # [layer][head][tgt][src]
    assert (len(layers), len(layers[0]), len(layers[0][1]), len(layers[0][1][0])) == (1, 2, 5, 4)
    assert layers[0][1][0][0] == 0.1
    assert logs.attention(2, "你好") is None and logs.attention(0, "谁") is None


def test_only_appended_lines_are_parsed_and_attention_stays_on_disk(tmp_path, monkeypatch):
    path = tmp_path / EXAMPLES
    path.write_text(line(validation(50, "I", "Hi")), "utf-8")
    logs = TrainingView(tmp_path)
    logs.read()
    parsed = []
    real = jsonl.parse
    monkeypatch.setattr(jsonl, "parse", lambda raw: parsed.append(raw) or real(raw))
    with path.open("a", encoding="utf-8") as f:
        f.write(line(validation(100, "Who am I?", "Hello")))
    view = json.loads(logs.read().body)
    assert len(view["examples"]["validations"]) == 2
    assert len(parsed) == 1  # the appended line, not the whole file again
    assert all("attention" not in ex for r in logs.examples.records for ex in r["examples"])
    assert logs.attention(0, "我是谁")["attention"][0][1][0][0] == 0.05
    path.write_text(line(validation(70, "Me", "Yo")), "utf-8")  # cut back: read again
    view = json.loads(logs.read().body)
    assert [v["step"] for v in view["examples"]["validations"]] == [70]


def test_a_fifo_for_a_log_is_reported_not_opened(tmp_path):
    os.mkfifo(tmp_path / EXAMPLES)
    done = []
    reader = threading.Thread(target=lambda: done.append(view_of(tmp_path)), daemon=True)
    reader.start()
    reader.join(30)
    assert done, "reading the view hung on a FIFO"
    assert "not a regular file" in done[0]["errors"][0]
    assert TrainingView(tmp_path).attention(0, "我是谁") is None


def train_line(step: int) -> str:
    return line({"event": "train", "step": step, "minutes": step / 10, "loss": 1.5, "lr": 1e-3})


def test_two_looks_at_once_read_each_record_once(tmp_path, monkeypatch):
    """A request's thread is parsing the log when a line is appended and a second request's
    thread looks: each record is read once, in order, and the next line is not cut."""
    path = tmp_path / TRAIN_LOG
    path.write_text("".join(train_line(s) for s in (10, 20, 30)), "utf-8")
    logs = TrainingView(tmp_path)
    first_in, second_in, real = threading.Event(), threading.Event(), jsonl.lines

    def lines(*args, **kwargs):
        if not first_in.is_set():
            first_in.set()
            second_in.wait(1)  # a second look held outside meets no one: it goes on
        else:
            second_in.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(jsonl, "lines", lines)
    first = threading.Thread(target=logs.read)
    first.start()
    assert first_in.wait(60)
    with path.open("a", encoding="utf-8") as f:
        f.write(train_line(40))
    second = threading.Thread(target=logs.read)
    second.start()
    first.join()
    second.join()
    with path.open("a", encoding="utf-8") as f:  # past where a doubled reading would be
        f.write("".join(train_line(s) for s in (50, 60, 70, 80)))
    view = json.loads(logs.read().body)
    assert view["train"]["step"] == [10, 20, 30, 40, 50, 60, 70, 80] and view["errors"] == []


def test_a_look_for_attention_leaves_the_change_to_the_next_read(tmp_path):
    path = tmp_path / EXAMPLES
    path.write_text(line(validation(50, "I", "Hi")), "utf-8")
    logs = TrainingView(tmp_path)
    logs.read()
    with path.open("a", encoding="utf-8") as f:
        f.write(line(validation(100, "Who am I?", "Hello")))
    assert logs.attention(1, "你好")["step"] == 100  # this look reads the new line
    steps = [v["step"] for v in json.loads(logs.read().body)["examples"]["validations"]]
    assert steps == [50, 100]


def test_a_line_longer_than_the_read_window_is_skipped_and_said_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(training_view, "READ_CHUNK", 256)
    path = tmp_path / TRAIN_LOG
    long = line({"event": "train", "step": 15, "minutes": 0.25, "note": "x" * 700})
    path.write_text(train_line(10) + long + train_line(20), "utf-8")
    logs = TrainingView(tmp_path)
    with caplog.at_level(logging.WARNING):
        for _ in range(10):  # a few looks catch up, 256 bytes at a time
            view = json.loads(logs.read().body)
        assert view["train"]["step"] == [10, 20]
        with path.open("a", encoding="utf-8") as f:
            f.write(train_line(30) + long + train_line(40))
        for _ in range(10):
            view = json.loads(logs.read().body)
    assert view["train"]["step"] == [10, 20, 30, 40]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("over 256 bytes" in s for s in said), said
    assert f"{path}:2: " in said[0] and f"{path}:5: " in said[1]
    assert view["errors"] == [f"{path}: 2 lines over 256 bytes skipped"]


@pytest.mark.parametrize("same_mtime", [False, True])
def test_a_log_rewritten_in_place_at_its_size_is_read_again(tmp_path, same_mtime):
    path = tmp_path / TRAIN_LOG
    path.write_text(train_line(10) + train_line(20), "utf-8")
    before = os.stat(path)
    logs = TrainingView(tmp_path)
    assert json.loads(logs.read().body)["train"]["step"] == [10, 20]
    with path.open("r+", encoding="utf-8") as f:  # same inode, same size
        f.write(train_line(30) + train_line(40))
    if same_mtime:  # a rewrite within the clock's tick
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_ino == before.st_ino
    assert json.loads(logs.read().body)["train"]["step"] == [30, 40]


# The checkpoint watcher ---------------------------------------------------------------------


@pytest.fixture
def live_run(run_dir, tmp_path) -> Path:
    """A copy of the trained tiny run whose best.pt the test may replace."""
    run = tmp_path / "live"
    shutil.copytree(run_dir, run)
    return run


def rename_into_place(run: Path, step: int) -> None:
    """Replace best.pt the way training does: a whole file renamed over it (here, the same
    weights under another step)."""
    state = load_checkpoint(run / LAST)
    state["step"] = step
    tmp = run / "incoming.tmp"
    torch.save(state, tmp)
    os.replace(tmp, run / BEST)


def watcher_of(run: Path) -> tuple[ModelWatcher, Service]:
    before = stamp(run / BEST)
    loaded = load_run(run, torch.device("cpu"))
    cfg, tokenizer, model = loaded.cfg, loaded.tokenizer, loaded.model
    translator = Translator(model, tokenizer, cfg, torch.device("cpu"))
    watcher, step = ModelWatcher.after_load(run / BEST, translator, False, before)
    return watcher, Service(translator, run, "mtrain", BEST, step)


def test_a_torn_checkpoint_is_logged_once_and_a_whole_one_is_served(live_run, caplog):
    watcher, service = watcher_of(live_run)
    served = service.step
    assert served == load_checkpoint(live_run / BEST)["step"]
    assert watcher.poll() is None  # unchanged
    data = (live_run / BEST).read_bytes()
    with caplog.at_level(logging.WARNING, logger="mtrain.serve.reload"):
        for cut in (len(data) // 2, len(data) // 3):  # written in place, cut short, twice
            (live_run / BEST).write_bytes(data[:cut])
            assert watcher.poll() is None
    assert len(caplog.records) == 1 and "truncated or corrupt" in caplog.records[0].message
    assert service.step == served
    rename_into_place(live_run, 999)
    loaded = watcher.poll()
    assert loaded is not None and loaded.step == 999
    service.adopt(loaded)
    (decoded,) = service.translate(service.sources(["我是谁"]), service_options(service))
    assert decoded.step == 999 and decoded.nbest[0].text


def service_options(service: Service):
    from mtrain.serve.api import SearchOptions

    return SearchOptions(beam=1, alpha=service.base.decode.alpha)


def test_a_checkpoint_renamed_into_place_mid_read_is_read_again(live_run, monkeypatch, caplog):
    watcher, _ = watcher_of(live_run)
    rename_into_place(live_run, 500)
    real = reload.load_model
    renamed = []

    def load_then_rename(*args):
        loaded = real(*args)
        if not renamed:  # another save lands while the first is read
            rename_into_place(live_run, 600)
            renamed.append(True)
        return loaded

    monkeypatch.setattr(reload, "load_model", load_then_rename)
    with caplog.at_level(logging.WARNING):
        assert watcher.poll() is None  # what was read is no longer the file there
        loaded = watcher.poll()
    assert loaded is not None and loaded.step == 600 and not caplog.records


def test_requests_in_flight_while_best_pt_is_replaced_all_get_answers(live_run):
    served = Served(live_run)
    try:
        status, model = served.request("GET", "/model")
        first = model["checkpoint_step"]
        assert status == 200 and first == load_checkpoint(live_run / BEST)["step"]
        answers: list[list[tuple[int, dict]]] = [[] for _ in range(4)]  # per client, in order
        swapped, stop = threading.Event(), threading.Event()
        answered = threading.Semaphore(0)  # released at each client's first answer

        def client(mine: list[tuple[int, dict]]) -> None:
            while not stop.is_set():
                mine.append(served.post("/translate", {"text": ["我是谁", "你好"]}))
                if len(mine) == 1:
                    answered.release()
                if mine[-1][1].get("checkpoint_step") == 999:
                    swapped.set()

        clients = [threading.Thread(target=client, args=(a,)) for a in answers]
        for c in clients:
            c.start()
        for _ in clients:  # every client has an answer from the first model
            assert answered.acquire(timeout=120)
        rename_into_place(live_run, 999)
        assert swapped.wait(120)
        stop.set()
        for c in clients:
            c.join()
        for mine in answers:
            assert all(status == 200 for status, _ in mine), mine
            steps = [a["checkpoint_step"] for _, a in mine]
            assert steps == sorted(steps, key=lambda s: s == 999)  # never the old after the new
        steps = {a["checkpoint_step"] for mine in answers for _, a in mine}
        assert steps == {first, 999}
        assert served.request("GET", "/model")[1]["checkpoint_step"] == 999
        status, explained = served.post("/explain", {"text": "我是谁"})
        assert status == 200 and explained["checkpoint_step"] == 999
        status, view = served.request("GET", "/training")
        assert status == 200 and view["validations"] and view["train"]["step"]
    finally:
        status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr
    assert "loaded" in stderr and "(step 999)" in stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_on_a_run_before_its_first_validation_waits_for_best_pt(live_run):
    held = live_run / "held.pt"
    os.replace(live_run / BEST, held)
    port = free_port()
    # This test's process stands in for the trainer that holds the run directory.
    with DirectoryLock(live_run):
        served = Served.__new__(Served)  # started by hand: it must be seen waiting first
        served.proc = subprocess.Popen(
            [sys.executable, "-m", "mtrain", "serve", "--run", str(live_run), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            waiting = served._read_until(rb"waiting for .*best\.pt")
            assert served.proc.poll() is None, waiting
            assert f"pid {os.getpid()} on" in waiting
            # while it waits, a client is refused at once rather than left unanswered
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            os.replace(held, live_run / BEST)  # the first validation
            served.stderr = waiting + served._read_until(rb"http://[\d.]+:\d+/")
            served.host, served.port = "127.0.0.1", port
            status, model = served.request("GET", "/model")
            step = load_checkpoint(live_run / BEST)["step"]
            assert status == 200 and model["checkpoint_step"] == step
        finally:
            status, stderr = served.stop()
    assert status == 0 and "Traceback" not in stderr, stderr


# Journey (d): the page's clients poll the training view while a run writes its logs --------------


def grown_logs(run: Path, rounds: int) -> list[tuple[str, dict]]:
    """The tiny run's records, (log, record) in the order training writes them, `rounds` times
    over with later steps: a longer run's logs, each line as training wrote it."""
    logs = {name: jsonl.read(run / name) for name in (TRAIN_LOG, METRICS, EXAMPLES)}
    last = max(r["step"] for records in logs.values() for r in records)
    grown = []
    for k in range(rounds):
        for name, records in logs.items():
            for r in records:
                grown.append((name, {**r, "step": r["step"] + k * last}))
    order = {TRAIN_LOG: 0, METRICS: 1, EXAMPLES: 2}  # a validation: metrics, then examples
    return sorted(grown, key=lambda item: (item[1]["step"], order[item[0]]))


def expected_view(records: list[tuple[str, dict]]) -> dict[str, list]:
    """The steps the view shows of each log once all of `records` are written."""
    kept = {
        "train": lambda r: r.get("event", "train") == "train",
        "validations": lambda r: r.get("event") in ("validation", "average") and "dev_bleu" in r,
        "examples": lambda r: True,
    }
    name = {"train": TRAIN_LOG, "validations": METRICS, "examples": EXAMPLES}
    return {k: [r["step"] for n, r in records if n == name[k] and kept[k](r)] for k in kept}


def steps_of(view: dict) -> dict[str, list]:
    return {
        "train": view["train"]["step"],
        "validations": [v["step"] for v in view["validations"]],
        "examples": [v["step"] for v in view["examples"]["validations"]],
    }


class Client(threading.Thread):
    """One page polling /training (with its ETag) and each validation's attention map, checking
    every answer: each log's steps a prefix of the whole, never shorter than before."""

    def __init__(self, served: Served, whole: dict[str, list], source: str, polled):
        super().__init__(daemon=True)
        self.served, self.whole, self.source, self.polled = served, whole, source, polled
        self.seen = {k: [] for k in whole}
        self.etag: str | None = None
        self.done, self.problems = threading.Event(), []

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self.look()
            self.look()  # once more after the writer stopped
        except Exception as e:  # told to the test, which asserts there were none
            self.problems.append(repr(e))

    def look(self) -> None:
        conn = http.client.HTTPConnection(self.served.host, self.served.port, timeout=300)
        conn.request("GET", "/training", headers={"If-None-Match": self.etag or ""})
        answer = conn.getresponse()
        body = answer.read()
        conn.close()
        self.polled()
        if answer.status == 304:
            return
        assert answer.status == 200, (answer.status, body[:300])
        view = json.loads(body)
        assert view["errors"] == [], view["errors"]
        steps = steps_of(view)
        for k, got in steps.items():
            assert got == self.whole[k][: len(got)], (k, got)
            assert len(got) >= len(self.seen[k]), (k, got, self.seen[k])
        self.seen, self.etag = steps, answer.getheader("ETag")
        for i, step in enumerate(steps["examples"]):
            query = urllib.parse.urlencode({"validation": i, "source": self.source})
            status, att = self.served.request("GET", f"/training/attention?{query}")
            assert status == 200 and att["step"] == step and att["attention"], (i, status, att)


def test_clients_polling_the_training_view_while_a_run_writes_see_each_record_once(live_run):
    """Journey (d): a run's logs grow line by line, each line written in two pieces, while four
    clients poll serve's training view; every record is seen once, in order, never a 500,
    and after the writer stops every client has the whole of each log."""
    records = grown_logs(live_run, rounds=4)
    whole = expected_view(records)
    source = records[[n for n, _ in records].index(EXAMPLES)][1]["examples"][0]["source"]
    for name in (TRAIN_LOG, METRICS, EXAMPLES):
        (live_run / name).unlink()
    served = Served(live_run)
    polls, looked = [0], threading.Condition()

    def polled() -> None:
        with looked:
            polls[0] += 1
            looked.notify_all()

    def after_a_poll() -> None:  # the writer goes on once a client has looked at what it wrote
        with looked:
            seen = polls[0]
            looked.wait_for(lambda: polls[0] > seen, timeout=60)

    clients = [Client(served, whole, source, polled) for _ in range(4)]
    try:
        for client in clients:
            client.start()
        files = {name: (live_run / name).open("ab") for name in (TRAIN_LOG, METRICS, EXAMPLES)}
        for name, record in records:
            data = line(record).encode("utf-8")
            for piece in (data[: len(data) // 2], data[len(data) // 2 :]):
                files[name].write(piece)
                files[name].flush()
                after_a_poll()
        for f in files.values():
            f.close()
        for client in clients:
            client.done.set()
        for client in clients:
            client.join(600)
    finally:
        status, stderr = served.stop()
    for client in clients:
        assert not client.is_alive() and client.problems == [], client.problems
        assert client.seen == whole
    assert status == 0 and "Traceback" not in stderr and " 500 " not in stderr, stderr


@pytest.mark.parametrize("pid", [999999999, os.getpid()])  # gone; alive but no trainer
def test_serve_on_a_run_no_process_trains_says_the_checkpoint_is_missing(live_run, pid):
    (live_run / BEST).unlink()
    (live_run / LOCK_FILE).write_text(f"pid {pid} on {socket.gethostname()}\n")
    result = subprocess.run(  # bounded: a server that waits for best.pt would never return
        [sys.executable, "-m", "mtrain", "serve", "--run", str(live_run), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert result.returncode == 2 and "no such checkpoint" in result.stderr
    assert "waiting" not in result.stderr


# The page, in headless Chromium driven by selenium --------------------------------------------

CHROMEDRIVER = Path("/usr/bin/chromedriver")


def browser_missing() -> str | None:
    """Why the browser test cannot run here; None if it can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "no selenium: pip install 'mtrain[dev]'"
    if chromium() is None or not CHROMEDRIVER.exists():
        return "no chromium or chromedriver: apt-get install chromium chromium-driver"
    return None


def wait_for(condition, seconds: float, what: str):
    """Wait until `condition()` is true, looking every tenth of a second."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.1)
    return value


def browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as ChromeService

    options = webdriver.ChromeOptions()
    options.binary_location = chromium()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,1500"):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    return webdriver.Chrome(service=ChromeService(str(CHROMEDRIVER)), options=options)


@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_the_training_view_follows_a_run_while_it_trains(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    run, dev = tmp_path / "run", tmp_path / "dev.tsv"
    dev_lines = (REPO / "data/tatoeba/dev.tsv").read_text("utf-8").splitlines(keepends=True)
    dev.write_text("".join(dev_lines[:40]), "utf-8")  # a validation in a second or two
    args = ["train", "--config", "configs/tiny.yaml", "--out", str(run), "--set", f"data.dev={dev}"]
    args += ["--set", "train.eval_every=20", "--set", "train.max_steps=1000"]
    args += ["--set", "train.max_minutes=0"]  # it trains until the test stops it
    with (tmp_path / "train.err").open("wb") as err:
        train = subprocess.Popen(
            [sys.executable, "-m", "mtrain", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    driver = served = None
    try:
        wait_for(lambda: (run / BEST).exists() or train.poll() is not None, 900, "best.pt")
        assert train.poll() is None, (tmp_path / "train.err").read_text()
        served = Served(run)
        driver = browser(tmp_path / "profile")
        wait = WebDriverWait(driver, 600)  # minutes on a loaded machine; seconds alone
        driver.get(served.url)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
        driver.find_element(By.CSS_SELECTOR, '#views button[data-view="training"]').click()

        def rows(d) -> int:
            return len(d.find_elements(By.CSS_SELECTOR, "#examples-table tbody tr"))

        def points(d, title: str) -> int:
            chart = d.find_element(By.CSS_SELECTOR, f'svg.chart[data-title="{title}"]')
            return int(chart.get_attribute("data-points"))

        wait.until(lambda d: rows(d) >= 1)
        seen = (rows(driver), points(driver, "training loss"), points(driver, "dev BLEU"))
        wait.until(lambda d: rows(d) >= max(2, seen[0] + 1))  # a validation more, unreloaded
        assert points(driver, "training loss") > seen[1]
        assert points(driver, "dev BLEU") > seen[2]
        train.terminate()
        train.wait(120)
        lines = jsonl.read(run / EXAMPLES)
        wait.until(lambda d: rows(d) == len(lines))
        first = lines[0]["examples"][0]
        header = driver.find_element(By.CSS_SELECTOR, "#examples-table th.chosen").text
        assert first["source"] in header
        slider = driver.find_element(By.ID, "validation")
        slider.send_keys(Keys.HOME)
        for line in lines:  # the slider walks the validations; the map follows
            step = str(line["step"])
            wait.until(
                lambda d, step=step: (
                    d.find_element(By.ID, "ex-heatmap").get_attribute("data-step") == step
                )
            )
            (ex,) = [e for e in line["examples"] if e["source"] == first["source"]]
            cells = driver.find_elements(By.CSS_SELECTOR, "#ex-heatmap rect.cell")
            assert len(cells) == len(ex["tgt_pieces"]) * len(ex["src_pieces"])
            current = driver.find_element(By.CSS_SELECTOR, "#examples-table tr.current td")
            assert current.text == step
            slider.send_keys(Keys.RIGHT)
        driver.find_element(By.CSS_SELECTOR, '#x-axis button[data-x="minutes"]').click()
        ticks = driver.find_elements(By.CSS_SELECTOR, 'svg.chart[data-title="dev BLEU"] .axis-name')
        assert ticks[0].text == "minutes"
        assert not driver.find_elements(By.CSS_SELECTOR, "#training-status.bad")
        driver.save_screenshot(str(tmp_path / "training.png"))  # for a look when it fails
    finally:
        if driver is not None:
            driver.quit()
        if train.poll() is None:
            train.kill()
            train.wait()
        if served is not None:
            status, stderr = served.stop()
            assert status == 0 and "Traceback" not in stderr, stderr
