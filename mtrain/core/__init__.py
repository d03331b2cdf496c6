"""The base every stage stands on: the typed config and its checks (`config`, `yaml_limits`),
safe files and locks (`files`), JSON lines (`jsonl`), the device and precision (`runtime`),
process groups (`distributed`) and BLEU/chrF scoring (`metrics`).

It imports nothing else of mtrain: any stage may import it.
"""
