"""Build mtrain's shipped corpus (data/tatoeba/{train,dev,test}.tsv) from a Tatoeba export.

The input is Tatoeba's "sentence pairs" download for Mandarin Chinese - English: four
tab-separated columns (cmn_id, Chinese, eng_id, English), possibly with a byte-order mark and
CRLF line endings. The output keeps that form and the sentence ids (CC-BY 2.0 FR attribution).

Pairs are split by connected group: two pairs are connected when they share a Chinese sentence
(compared after conversion to simplified script) or an English sentence, so no sentence of the
test or dev split is ever seen in training. The split is a pure function of the input.

    python scripts/prepare_tatoeba.py ../shared/data/tatoeba-cmn-eng.tsv --out data/tatoeba
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import defaultdict
from pathlib import Path

from mtrain.data.text import normalize

Row = tuple[str, str, str, str]  # cmn_id, Chinese, eng_id, English


def read_export(path: Path) -> tuple[list[Row], int]:
    """Read a four-column export; return its whitespace-normalised rows and the count skipped."""
    rows, skipped = [], 0
    with path.open(encoding="utf-8-sig", newline="") as f:
        for line in f:
            fields = line.rstrip("\r\n").split("\t")
            if len(fields) != 4:
                skipped += 1
                continue
            cmn_id, zh, eng_id, en = (" ".join(x.split()) for x in fields)
            if zh and en:
                rows.append((cmn_id, zh, eng_id, en))
            else:
                skipped += 1
    return rows, skipped


def drop_duplicates(rows: list[Row]) -> list[Row]:
    """Keep the first of each exact (Chinese, English) text pair."""
    seen, kept = set(), []
    for row in rows:
        key = (row[1], row[3])
        if key not in seen:
            seen.add(key)
            kept.append(row)
    return kept


def connected_groups(rows: list[Row]) -> list[list[Row]]:
    """Group rows that share a (simplified) Chinese or an English sentence, transitively."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(node):
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for _, zh, _, en in rows:
        parent[find(("zh", normalize(zh, "zh")))] = find(("en", en))
    groups = defaultdict(list)
    for row in rows:
        groups[find(("en", row[3]))].append(row)
    return list(groups.values())


def split(groups: list[list[Row]], n_test: int, n_dev: int, max_group: int):
    """Deal groups, in an order fixed by a hash of their content, to test, dev and train."""

    def distinct_zh(group):
        return len({normalize(r[1], "zh") for r in group})

    def order(group):
        return hashlib.sha256(min(r[1] for r in group).encode()).hexdigest()

    test, dev, train = [], [], []
    n_test_zh = n_dev_zh = 0
    for group in sorted(groups, key=order):
        size = distinct_zh(group)
        if size <= max_group and n_test_zh < n_test:
            test += group
            n_test_zh += size
        elif size <= max_group and n_dev_zh < n_dev:
            dev += group
            n_dev_zh += size
        else:
            train += group
    return train, dev, test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export", type=Path, help="Tatoeba cmn-eng sentence-pairs TSV")
    parser.add_argument("--out", type=Path, default=Path("data/tatoeba"))
    parser.add_argument("--test", type=int, default=2000, help="distinct Chinese sentences")
    parser.add_argument("--dev", type=int, default=2000, help="distinct Chinese sentences")
    parser.add_argument(
        "--max-group",
        type=int,
        default=8,
        help="groups with more distinct Chinese sentences than this always go to train",
    )
    args = parser.parse_args()

    rows, skipped = read_export(args.export)
    unique = drop_duplicates(rows)
    groups = connected_groups(unique)
    splits = split(groups, args.test, args.dev, args.max_group)
    position = {row: i for i, row in enumerate(unique)}
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"{len(rows)} rows read, {skipped} malformed or empty skipped, "
        f"{len(rows) - len(unique)} duplicates dropped, {len(groups)} groups",
        file=sys.stderr,
    )
    for name, part in zip(("train", "dev", "test"), splits):
        part.sort(key=position.__getitem__)  # keep the export's order inside each split
        with (args.out / f"{name}.tsv").open("w", encoding="utf-8", newline="\n") as f:
            f.writelines("\t".join(row) + "\n" for row in part)
        n_zh = len({normalize(r[1], "zh") for r in part})
        print(f"{name}: {len(part)} pairs, {n_zh} distinct Chinese sentences", file=sys.stderr)


if __name__ == "__main__":
    main()
