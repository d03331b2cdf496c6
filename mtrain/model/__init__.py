"""Stage 2, the model: the Transformer of the paper as pure `nn.Module`s (`transformer`) and
the map of its parameters by part (`parameter_map`).

No I/O and no device logic. It imports only from `mtrain.core`.
"""
