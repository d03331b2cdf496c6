import dataclasses
import itertools
from pathlib import Path

import pytest

from mtrain.core import config
from mtrain.core.config import ConfigError

from .console import mtrain

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["default", "default-en-zh", "tiny", "base-gpu"])
def test_shipped_configs_load(name):
    cfg = config.load(REPO / "configs" / f"{name}.yaml")
    assert cfg.model.d_model % cfg.model.n_heads == 0


def test_shipped_configs_spell_out_every_key():
    """Every option is used by the config files, so none is dead."""
    import yaml

    defaults = config.Config().to_dict()
    for path in (REPO / "configs").glob("*.yaml"):
        raw = yaml.safe_load(path.read_text())
        for section, keys in defaults.items():
            assert set(raw[section]) == set(keys), f"{path.name}: {section}"


def test_a_config_naming_only_its_corpora_gets_default_yaml_in_every_other_key(tmp_path):
    """One set of defaults: the dataclasses' are configs/default.yaml's."""
    default = config.load(REPO / "configs" / "default.yaml")
    text = "data:\n  train: t.tsv\n  dev: d.tsv\n  test: e.tsv\n"
    cfg = config.load(write(tmp_path, text), require_data=True)
    corpora = {"train": "t.tsv", "dev": "d.tsv", "test": "e.tsv"}
    assert cfg == dataclasses.replace(default, data=dataclasses.replace(default.data, **corpora))
    assert config.Config() == default


def test_unknown_key_is_named(tmp_path):
    path = write(tmp_path, "model:\n  d_modle: 128\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'model\.d_modle'"):
        config.load(path)


def test_unknown_section_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'optim'"):
        config.load(write(tmp_path, "optim:\n  lr: 1\n"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("model:\n  d_model: big\n", r"model\.d_model: expected int, got 'big'"),
        ("model:\n  n_heads: 1.5\n", r"model\.n_heads: expected int"),
        ("model:\n  norm: middle\n", r"model\.norm: expected one of pre, post"),
        ("model:\n  d_model: 250\n  n_heads: 4\n", r"model\.d_model: 250 is not divisible"),
        ("model:\n  d_ff: -4\n", r"model\.d_ff: must be positive"),
        ("model:\n  dropout: 1.5\n", r"model\.dropout"),
        ("train:\n  batch_tokens: 10\n", r"train\.batch_tokens"),
        ("tokenizer:\n  joint: 1\n", r"tokenizer\.joint: expected bool"),
        ("train:\n  ema_decay: 1\n", r"train\.ema_decay: must be in \[0, 1\)"),
        ("tokenizer:\n  tgt_vocab_size: 200\n", r"tokenizer\.tgt_vocab_size: must be at least"),
        ("data:\n  swap_columns: zh-en\n", r"data\.swap_columns: expected bool"),
        ("train:\n  dev_examples: 1000000000\n", r"train\.dev_examples: at most 32 .*1000000000"),
        ("train:\n  examples: [" + "我, " * 40 + "我]\n", r"train\.examples: at most 32 .*41"),
        ("model: 3\n", r"model: expected a mapping"),
        ("- a\n- b\n", r"expected a mapping"),
        ("model: [\n", r"not valid YAML"),
        ("train:\n  seed: -1\n", r"^[^\n]*train\.seed: must be in \[0, 2\*\*64 - 1\], got -1$"),
        ("train:\n  seed: 18446744073709551616\n", r"train\.seed: must be in"),
        ("decode:\n  beam_size: 65\n", r"decode\.beam_size: at most 64, got 65"),
    ],
)
def test_bad_values_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        config.load(write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        config.load(tmp_path / "nope.yaml")


def test_int_accepted_for_float(tmp_path):
    cfg = config.load(write(tmp_path, "train:\n  lr: 1\n"))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_a_joint_vocabulary_has_one_size_whatever_tgt_vocab_size_says(tmp_path):
    cfg = config.load(write(tmp_path, "tokenizer:\n  joint: true\n  vocab_size: 6000\n"))
    assert cfg.tokenizer.tgt_vocab_size == 4000 and cfg.tokenizer.tgt_size == 6000
    cfg.tokenizer.joint = False
    assert cfg.tokenizer.tgt_size == 4000


def test_overrides(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.1\n")
    cfg = config.load(path, ["train.lr=3e-4", "model.norm=post", "tokenizer.joint=true"])
    assert cfg.train.lr == 3e-4 and cfg.model.norm == "post" and cfg.tokenizer.joint is True
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lrr'"):
        config.load(path, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        config.load(path, ["lr=1"])


def test_python_values_are_set_as_given_and_checked_as_the_config_checks_them(tmp_path):
    """The API's overrides are values, not YAML: a " #" is no comment, "no" no False, "" no
    None; `--set` strings stay YAML."""
    path = write(tmp_path, "data:\n  train: a.tsv\n")
    given = [("data.train", "corpus #2.tsv"), ("data.src_lang", "no"), ("train.init_from", "")]
    cfg = config.load(path, [*given, ("data.dev", tmp_path / "dev.tsv"), "train.max_steps=7"])
    assert (cfg.data.train, cfg.data.src_lang, cfg.train.init_from) == ("corpus #2.tsv", "no", "")
    assert cfg.data.dev == str(tmp_path / "dev.tsv") and cfg.train.max_steps == 7
    with pytest.raises(ConfigError, match=r"data\.src_lang: expected str, got False"):
        config.load(path, ["data.src_lang=no"])  # YAML's no
    with pytest.raises(ConfigError, match=r"train\.max_steps: expected int, got '7'"):
        config.load(path, [("train.max_steps", "7")])
    with pytest.raises(ConfigError, match=r"train\.max_steps: expected int, got True"):
        config.load(path, [("train.max_steps", True)])
    with pytest.raises(ConfigError, match=r"override 'max_steps': expected a key as section\.key"):
        config.load(path, [("max_steps", 7)])
    examples = ["我是谁"]
    cfg = config.load(path, [("train.examples", examples)])
    cfg.train.examples.append("你好")
    assert examples == ["我是谁"]  # the caller's list stays theirs


def test_round_trip_through_dict():
    cfg = config.load(REPO / "configs" / "default.yaml")
    assert config.from_dict(cfg.to_dict()) == cfg


def test_exponent_without_dot_is_a_float(tmp_path):
    cfg = config.load(write(tmp_path, "train:\n  lr: 3e-4\n"))
    assert cfg.train.lr == 3e-4
    with pytest.raises(ConfigError, match=r"train\.lr: expected float, got 'fast'"):
        config.load(write(tmp_path, "train:\n  lr: fast\n"))


def test_yaml_cannot_construct_python_objects(tmp_path):
    path = write(tmp_path, "model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(path)


@pytest.mark.parametrize("src, tgt", [(40, 72), (72, 40), (64, 64)])
def test_max_positions_cover_the_longest_source_and_output(src, tgt):
    data = config.DataConfig(max_src_len=src, max_tgt_len=tgt)
    assert data.max_positions() == max(src, tgt)


def alias_bomb(levels: int = 9) -> str:
    """A billion laughs: each level an alias list of nine of the level below."""
    lines = ['  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    names = "abcdefghijklmnop"[: levels + 1]
    for prev, name in itertools.pairwise(names):
        lines.append(f"  {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "x:\n" + "\n".join(lines) + f"\ndata:\n  train: *{names[-1]}\n"


@pytest.mark.parametrize(
    "text, message",
    [
        (alias_bomb(), "more than 10,000 values once aliases are expanded"),
        ("data: &d\n  train: *d\n", "an alias refers to a node that contains it"),
        ("data:\n  train: " + "[" * 30_000 + "\n", "nested more than 32 deep"),
        ("data:\n  train: [" + ", ".join(["1"] * 20_000) + "]\n", "more than 10,000 values"),
        ("# " + "x" * (64 << 10) + "\n", "larger than 64 KiB"),
        ("model:\n  d_model: 128\n   n_heads: 8\n", r"not valid YAML: .* \(line 3, column 11\)"),
        (b"model:\n  norm: \xff\n", r"c\.yaml:2: not valid UTF-8"),
    ],
    ids=["alias bomb", "recursive", "deep", "wide", "large", "bad indent", "not UTF-8"],
)
def test_hostile_yaml_is_refused_in_one_line(tmp_path, text, message):
    """Each is refused before it is expanded: an alias bomb would take hours and all memory."""
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=message) as e:
        config.load(path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_aliases_and_merge_keys_that_stay_small_still_load(tmp_path):
    text = "model: &m\n  d_model: 128\n  n_heads: 8\ndecode:\n  max_len_offset: &n 12\n"
    cfg = config.load(write(tmp_path, text))
    assert cfg.model.d_model == 128 and cfg.decode.max_len_offset == 12
    text = "model:\n  <<: {d_model: 128, n_heads: 8}\n  d_ff: 256\n"
    assert config.load(write(tmp_path, text)).model.d_model == 128


def test_a_set_value_that_is_not_yaml_is_one_line(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"--set 'train\.lr=\[': value: not valid YAML") as e:
        config.load(path, ["train.lr=["])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", r"c\.yaml: empty config"),
        ("# nothing yet\n", r"c\.yaml: empty config"),
        ("model:\n  d_model: 128\n", r"names no data\.train, data\.dev, data\.test"),
        ("data:\n  train: t.tsv\n  dev: d.tsv\n", r"names no data\.test;"),
    ],
)
def test_training_needs_a_config_that_names_its_corpora(tmp_path, text, message):
    """The defaults are the bundled corpus: an empty config would silently train on it."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        config.load(path, require_data=True)
    config.load(path)  # describing a model (`mtrain info --config`) needs no data
    named = ["data.train=t.tsv", "data.dev=d.tsv", "data.test=e.tsv"]
    assert config.load(path, named, require_data=True).data.test == "e.tsv"


def test_a_negative_seed_is_refused_before_anything_is_made(tmp_path):
    """Refused at config load: no run directory, no prepared corpus left behind."""
    out, prepared = tmp_path / "run", tmp_path / "prepared"
    result = mtrain(
        "train",
        "--config",
        "configs/tiny.yaml",
        "--out",
        str(out),
        "--set",
        "train.seed=-1",
        "--set",
        f"data.prepared_dir={prepared}",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("mtrain: error: ") and "train.seed: must be in" in line
    assert not out.exists() and not prepared.exists()


def test_every_key_declares_its_policy():
    """Resume, init_from, the upgrade and info read each key's rules from its declaration."""
    keys = {(s, k) for s, values in config.Config().to_dict().items() for k in values}
    assert set(config.POLICIES) == keys
    assert all(isinstance(policy, config.Policy) for policy in config.POLICIES.values())


def test_a_key_declared_without_its_policy_is_refused():
    @dataclasses.dataclass
    class Section:
        kept: int = config.key(1, config.Resume.KEPT, config.Child.OWN)
        plain: int = 2  # a key added without its policy

    @dataclasses.dataclass
    class Schema:
        section: Section = dataclasses.field(default_factory=Section)

    with pytest.raises(TypeError, match=r"section\.plain: declared without its policy"):
        config.policies(Schema)


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("train.compile=1", "train.compile"),  # 1 == True, but not a bool
        ("train.compile=0", "train.compile"),
        ("train.compile=1.0", "train.compile"),
        ("model.norm=1", "model.norm"),
    ],
)
def test_a_literal_key_takes_its_choices_only_not_equal_numbers(setting, key):
    with pytest.raises(ConfigError, match=rf"{key}: expected one of"):
        config.load(REPO / "configs" / "tiny.yaml", [setting])


def test_a_literal_key_takes_each_of_its_choices():
    for value, expected in (("true", True), ("false", False), ("auto", "auto")):
        cfg = config.load(REPO / "configs" / "tiny.yaml", [f"train.compile={value}"])
        assert cfg.train.compile is expected if value != "auto" else cfg.train.compile == "auto"


@pytest.mark.parametrize("setting", ["train.init_from=", 'train.init_from=""'])
def test_an_empty_override_is_the_empty_string(setting):
    """What a shell leaves of `--set train.init_from=""`: the key's documented default."""
    cfg = config.load(REPO / "configs" / "tiny.yaml", [setting])
    assert cfg.train.init_from == ""


@pytest.mark.parametrize(
    ("value", "dropped"),
    [("corpus #2.tsv", "#2.tsv"), ("#2.tsv", "#2.tsv"), ("[a, b] # c", "# c")],
)
def test_a_set_value_yaml_cuts_at_a_comment_is_refused_saying_what_went(value, dropped):
    """` #` starts a YAML comment: `--set 'data.train=corpus #2.tsv'` would train on `corpus`."""
    with pytest.raises(ConfigError) as refused:
        config.apply_override({}, f"data.train={value}")
    message = str(refused.value)
    assert "\n" not in message and f"reads {dropped!r} as a comment" in message, message
    assert f"data.train='{value}'" in message  # how to quote it, which then keeps it
    raw: dict = {}
    config.apply_override(raw, f"data.train='{value}'")
    assert raw == {"data": {"train": value}}


@pytest.mark.parametrize("value", ["a#b", "'a #b'", '"it\'s #1"', '["x #y", z]'])
def test_a_hash_yaml_keeps_is_no_comment(value):
    raw: dict = {}
    config.apply_override(raw, f"data.train={value}")
    assert "#" in str(raw["data"]["train"])


def test_the_command_line_says_what_yaml_dropped_from_a_set_value():
    result = mtrain("train", "-c", "configs/tiny.yaml", "--set", "data.train=corpus #2.tsv")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "reads '#2.tsv' as a comment" in result.stderr


@pytest.mark.parametrize(
    ("command", "text", "setting", "said"),
    [
        (
            "train",
            "data:\n  train: x\x00\n",
            None,
            r"c\.yaml: not valid YAML: .*\(U\+0000\) \(line 2, column 11\)",
        ),
        (
            "lab",
            "data:\n  train: x\x01\n",
            None,
            r"c\.yaml: not valid YAML: .*\(U\+0001\) \(line 2, column 11\)",
        ),
        (
            "train",
            None,
            "train.examples=[\x01]",
            r"--set 'train\.examples=\[\\x01\]': value: .*\(U\+0001\)",
        ),
        (
            "lab",
            None,
            "data.train=a\udcffb.tsv",
            r"--set 'data\.train=.*': value: .*not UTF-8 \(0xff\)",
        ),
    ],
    ids=["NUL in train's file", "control in lab's file", "control in --set", "not UTF-8 in --set"],
)
def test_a_character_yaml_forbids_is_one_line_naming_where(tmp_path, command, text, setting, said):
    """PyYAML's reader checks the whole text as its loader is built: refused in one line, the
    file and line or the --set named (a byte that is not UTF-8 reaches Python as a surrogate)."""
    import re

    path = tmp_path / "c.yaml"
    if text is None:
        path.write_text((REPO / "configs" / "tiny.yaml").read_text())
    else:
        path.write_bytes(text.encode())
    args = [command, "--config", str(path), "--out", str(tmp_path / "out")]
    args += ["--updates", "5"] if command == "lab" else []
    args += ["--set", setting] if setting else []
    result = mtrain(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("mtrain: error: ") and re.search(said, line), line
    assert not (tmp_path / "out").exists()
