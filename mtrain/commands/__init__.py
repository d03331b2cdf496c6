"""Stage 9, the commands of `mtrain`, one thin module each; `mtrain/cli.py` puts them together.

A command reads its options, calls the stages before it and writes results to stdout; it may
import any stage.
"""
