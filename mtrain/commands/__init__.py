"""The commands of `mtrain`, one module each; `mtrain/cli.py` puts them together."""
