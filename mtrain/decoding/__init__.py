"""Stage 4, decoding: greedy and beam search over the model with a key/value cache (`search`),
a translator from text to text in length-sorted batches (`translator`), and what a search can
show of itself: the step-by-step trace (`trace`) and the attention maps (`attention`); a run
opened, its checkpoint in a translator: the one module that opens a run (`loaded`); and a
given translation scored piece by piece by teacher forcing (`score`).

It imports only from the stages before it (`core`, `data`, `model`, `run`).
"""
