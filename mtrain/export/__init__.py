"""Stage 7, export: a trained run converted to a CTranslate2 model directory (`converter`) and
translated with CTranslate2 behind the same interface as mtrain's own translator (`engine`),
and `engine.open_engine`, which opens a model on either engine for the commands, serve and
`mtrain.load`.

It imports only from the stages before it (`core`, `data`, `model`, `run`, `decoding`,
`figures`, `training`).
"""
