"""The base every stage stands on: the typed config and its checks (`config`, `yaml_limits`),
safe files and locks (`files`), JSON lines (`jsonl`), the device and precision (`runtime`),
process groups (`distributed`), BLEU/chrF scoring (`metrics`), the paired bootstrap and
the other statistics that compare systems (`significance`), the progress bar (`progress`)
and `MtrainError`, the base of every error of the user's making (`errors`).

It imports nothing else of mtrain: any stage may import it.
"""
