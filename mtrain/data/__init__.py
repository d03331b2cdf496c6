"""Stage 1, data: from parallel text files to batches of token ids.

Reading corpora (`corpus`) and normalising text (`text`); the SentencePiece tokenizers
(`tokenizer`); encoding a corpus once into the prepared on-disk format (`prepare`,
`encode_corpus`, `encode_worker`), whose one owner is `prepared`; reading it back a batch at a
time (`token_corpus`); pairs, examples and padded batches (`pairs`); planning batches by shape
(`batching`) and subword sampling (`subword_sampling`).

It imports only from `mtrain.core`.
"""
