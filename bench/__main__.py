"""``python -m bench [NAME ...] [--quick] [--out FILE]``: run memkit's benchmarks and write RESULTS.md."""

import argparse
import sys
from pathlib import Path

from . import BENCHMARKS, RESULTS, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run memkit's benchmarks (all by default) and write the results as markdown.",
        epilog="example:\n  python -m bench tracking_overhead snapshot_load",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="smaller cases: checks that the benchmarks run")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown file to write (default: {RESULTS})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    sections = run(args.names or BENCHMARKS, quick=args.quick, path=args.out)
    return 1 if any(s.failed for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
