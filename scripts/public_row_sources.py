"""Writes data/public/row_sources.tsv: each row of public_training_memory.csv with its source
normalised to one environment (the GitHub org/repo, or the documentation page's URL).

    python3 scripts/public_row_sources.py ../shared/data/public_training_memory.csv > data/public/row_sources.tsv

The environment evaluation (tests/api/environment.rs) groups the published rows by it.
"""

import csv
import re
import sys


def environment(source: str) -> str:
    if source.startswith("http"):
        return source.split()[0]
    match = re.search(r"github\.com/([^/\s]+)/([^/\s@]+)", source)
    return f"{match.group(1)}/{match.group(2)}" if match else source.split()[0]


def main() -> None:
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    print("row\tsource")
    for i, row in enumerate(rows):
        print(f"{i}\t{environment(row['source_url_or_repo_path'])}")


if __name__ == "__main__":
    main()
