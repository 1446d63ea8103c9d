"""Soak: a steady rate of calls through a fleet for a bounded time. Does anything grow?

    .venv/bin/python -m bench.soak                               # 10 minutes
    .venv/bin/python -m bench.soak --duration-s 60 --bucket-s 10

The harness, its verdicts and what it starts are infra/soak.py's. Like every benchmark here it
prints what it measured and exits 0 unless something errored.
"""

from __future__ import annotations

import argparse

from infra.soak import (
    BUCKET_S,
    DURATION_S,
    INSTANCES,
    RATE_PER_S,
    SAMPLE_S,
    SoakConfig,
    report,
    run,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=DURATION_S)
    parser.add_argument("--rate", type=float, default=RATE_PER_S, help="calls per second")
    parser.add_argument("--instances", type=int, default=INSTANCES)
    parser.add_argument("--bucket-s", type=float, default=BUCKET_S)
    parser.add_argument("--sample-s", type=float, default=SAMPLE_S)
    args = parser.parse_args(argv)
    config = SoakConfig(args.duration_s, args.rate, args.instances, args.bucket_s, args.sample_s)
    print(report(run(config)))


if __name__ == "__main__":
    main()
