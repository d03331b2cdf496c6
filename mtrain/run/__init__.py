"""Stage 3, the run directory: its layout, the resolved config.yaml, the tokenizer models and
the checkpoints (state dicts, never modules), written atomically and read safely
(`directory`).

It imports only from `mtrain.core`, `mtrain.data` and `mtrain.model`.
"""
