"""The spend limits people ship, measured against the provider's bill, beside the enforced path.

    .venv/bin/python -m bench.baselines

The patterns, the race and what they run against are infra/baselines.py's. It prints what it
measured, and exits non-zero only when the enforced path let spend past its ceiling.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from infra.baselines import report, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baselines",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the stub provider's seed")
    args = parser.parse_args(argv)
    rows = run(args.seed)
    print(report(rows))
    # A benchmark reports; only an enforced path that let spend past its ceiling is an error.
    return 1 if any(r.enforced and r.billed_micros > r.ceiling_micros for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
