"""The lab: a baseline config and variants of it, each one change (a part of the Transformer
taken out, or any `--set`), trained into ordinary run directories at an equal number of updates
or in equal time, then compared in one report: a table with the paired bootstrap against the
baseline, the translations of probe sentences, the training curves and each variant's
cross-attention. It opens its runs as every command does (`decoding.loaded`); the run is
trained by a function the caller hands it (`mtrain train`'s own), so it imports no command.
"""
