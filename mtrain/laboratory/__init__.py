"""The lab: a baseline config and variants of it, each one change (a part of the Transformer
taken out, or any `--set`), trained into ordinary run directories at an equal number of updates
or in equal time, then compared in one report: dev and test BLEU, the paired bootstrap against
the baseline with Holm's correction and a verdict on each variant's mean over seeds, the
translations of probe sentences, the training curves and the cross-attention of the baseline
beside no-positions. Each run is checked and trained by `training.start`, as `mtrain train`
checks and trains one, and opened to translate as every command opens one (`decoding.loaded`).
"""
