from hypothesis import given
from hypothesis import strategies as st

from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, fit, too_long


def test_pinned_special_ids(tokenizer):
    for sp in (tokenizer.src, tokenizer.tgt):
        assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)


def test_round_trip(tokenizer):
    texts = ["three one four one five", "nine", "two six"]
    assert tokenizer.decode_tgt(tokenizer.encode_tgt(texts)) == texts


def test_unseen_characters_fall_back_to_bytes(tokenizer):
    ids = tokenizer.encode_src(["我是谁"])[0]  # none of these characters is in the corpus
    assert UNK_ID not in ids
    assert tokenizer.src.decode(ids) == "我是谁"


def test_separate_models_have_their_own_vocabularies(tokenizer):
    assert tokenizer.src.id_to_piece(4) != tokenizer.tgt.id_to_piece(4) or (
        tokenizer.src.serialized_model_proto() != tokenizer.tgt.serialized_model_proto()
    )


def test_load_and_joint(tmp_path):
    from mtrain.core.config import TokenizerConfig

    # tgt_vocab_size keeps its default (4,000): a joint vocabulary ignores it, one model serves both
    cfg = TokenizerConfig(joint=True, vocab_size=300, character_coverage=1.0)
    tok = Tokenizer.train(["一二三"] * 50, ["one two three"] * 50, cfg, "zh", "en", tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.src.serialized_model_proto() == again.tgt.serialized_model_proto()
    assert again.encode_src(["一二"]) == tok.encode_tgt(["一二"])
    assert tok.tgt_vocab_size == tok.src_vocab_size <= 300


def test_training_is_repeatable(tmp_path):
    from mtrain.core.config import TokenizerConfig

    cfg = TokenizerConfig(vocab_size=300, tgt_vocab_size=0, character_coverage=1.0)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    texts = [f"sentence number {i} of {i * 7}" for i in range(300)]
    Tokenizer.train(texts, texts, cfg, "en", "de", a)
    Tokenizer.train(texts, texts, cfg, "en", "de", b)
    assert (a / "spm.tgt.model").read_bytes() == (b / "spm.tgt.model").read_bytes()


@given(st.lists(st.integers(4, 300), max_size=40), st.integers(1, 40))
def test_the_length_rule_cuts_exactly_what_it_calls_too_long(pieces, max_len):
    """What is too long is cut to leave room for the one token its side gains; nothing else is."""
    assert (fit(pieces, max_len) != pieces) == too_long(pieces, max_len)
    assert len(fit(pieces, max_len)) + 1 <= max_len or not pieces
    assert not too_long(fit(pieces, max_len), max_len)


def test_the_target_model_takes_its_own_size(tmp_path):
    """tokenizer.tgt_vocab_size sizes the target model alone; the model built for the run has
    an output layer of that size."""
    from mtrain.core.config import TokenizerConfig

    cfg = TokenizerConfig(vocab_size=400, tgt_vocab_size=300, character_coverage=1.0)
    texts = [f"sentence number {i} of {i * 7} and {i * 13} more words" for i in range(400)]
    tok = Tokenizer.train(texts, texts, cfg, "en", "de", tmp_path)
    assert (tok.src_vocab_size, tok.tgt_vocab_size) == (400, 300)


def test_a_size_the_corpus_cannot_fill_is_said_with_what_was_made(tmp_path, caplog):
    import logging

    from mtrain.core.config import TokenizerConfig

    cfg = TokenizerConfig(vocab_size=400, tgt_vocab_size=10**9, character_coverage=1.0)
    texts = [f"sentence number {i} of {i * 7} and {i * 13} more words" for i in range(400)]
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.train(texts, texts, cfg, "en", "de", tmp_path)
    made = tok.tgt_vocab_size
    assert made < 10**9
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"tokenizer.tgt_vocab_size: 1000000000 asked, SentencePiece could make {made} from this "
        f"corpus; the model has {made}"
    ]
