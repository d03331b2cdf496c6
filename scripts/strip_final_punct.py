"""Write a test split as `mtrain eval --src/--ref` files, with and without each source's final
punctuation, to measure how a model translates sentences typed without it.

    python scripts/strip_final_punct.py data/tatoeba/test.tsv --out /tmp/nopunct
    mtrain eval --src /tmp/nopunct/test.nopunct.zh \
        $(printf -- '--ref %s ' /tmp/nopunct/test.ref*.en)

It writes `test.zh` (the sources as the run's test split has them, normalised), `test.nopunct.zh`
(the same with trailing punctuation marks removed: 。 ？ ！ … and the like, Unicode category Po,
so closing quotes and brackets stay) and `test.ref1.en` ... `test.refK.en` (every source's
references, an empty line where a source has fewer than K). `mtrain eval --src test.zh` with the
same references scores exactly what plain `mtrain eval` does.
"""

from __future__ import annotations

import argparse
import unicodedata
from itertools import zip_longest
from pathlib import Path

from mtrain.data.pairs import group_references, read_parallel


def strip_final_punctuation(sentence: str) -> str:
    end = len(sentence)
    while end and unicodedata.category(sentence[end - 1]) == "Po":
        end -= 1
    return sentence[:end].rstrip() or sentence  # a sentence of punctuation alone stays


def write_lines(path: Path, lines) -> None:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("test", type=Path, help="a TSV test split, e.g. data/tatoeba/test.tsv")
    parser.add_argument("--out", type=Path, required=True, help="directory for the files")
    parser.add_argument("--src-lang", default="zh")
    parser.add_argument("--tgt-lang", default="en")
    args = parser.parse_args()
    sources, references = group_references(read_parallel(args.test, args.src_lang, args.tgt_lang))
    args.out.mkdir(parents=True, exist_ok=True)
    stem, src, tgt = args.test.stem, args.src_lang, args.tgt_lang
    write_lines(args.out / f"{stem}.{src}", sources)
    write_lines(args.out / f"{stem}.nopunct.{src}", map(strip_final_punctuation, sources))
    for k, refs in enumerate(zip_longest(*references, fillvalue=""), 1):
        write_lines(args.out / f"{stem}.ref{k}.{tgt}", refs)
    changed = sum(strip_final_punctuation(s) != s for s in sources)
    print(f"{len(sources)} sources ({changed} lost final punctuation) -> {args.out}")


if __name__ == "__main__":
    main()
