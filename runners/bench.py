"""Benchmarks that print figures.

    python -m runners.bench calibration --out DIR    cost model vs published figures
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def calibration(out: Path) -> int:
    from runners.calibration import TOLERANCE, evaluate

    records = evaluate()
    table = Table(title=f"emulated cost model vs published figures (tolerance {TOLERANCE:.0%})")
    for column in ("point", "predicted", "published", "unit", "error", "source"):
        table.add_column(column, justify="right" if column in ("predicted", "published", "error") else "left")
    for r in records:
        ok = abs(r["rel_error"]) <= TOLERANCE
        table.add_row(
            r["point"], f"{r['predicted']:.4g}", f"{r['published']:.4g}", r["unit"],
            f"[{'green' if ok else 'red'}]{r['rel_error']:+.1%}", r["source"],
        )  # fmt: skip
    Console(width=200).print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {out / 'calibration.json'}")
    return 0 if all(abs(r["rel_error"]) <= TOLERANCE for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    cal = sub.add_parser("calibration", help="cost model vs published figures")
    cal.add_argument("--out", type=Path, default=Path("runs/calibration"))
    args = parser.parse_args(argv)
    if args.bench == "calibration":
        return calibration(args.out)
    return 2


if __name__ == "__main__":
    sys.exit(main())
