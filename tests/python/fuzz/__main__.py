"""The fuzzer's command line:

    python tests/python/fuzz --calls 20000 --seed 10      # the package directory as a script
    cd tests/python && python -m fuzz --calls 20000       # or as a module

Runs the cases in worker processes (run_isolated), or in this process with --in-process or
--only-case, and prints the summary table (or one line with --quiet). The worker processes are
this same command with --worker. Run as a script, the package directory is sys.path[0]: it is
replaced by its parent, so that the package imports as `fuzz` (as the workers and the pickled
Counts they send back name it) and its modules never shadow top-level ones."""

import os
import sys

if not __package__:  # python tests/python/fuzz
    _package_dir = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _package_dir]
    sys.path.insert(0, os.path.dirname(_package_dir))

import argparse  # noqa: E402

import torch  # noqa: E402

import fuzz  # noqa: E402
from fuzz.counts import OUTCOMES, shares, summary  # noqa: E402
from fuzz.runner import run, run_isolated, worker  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python tests/python/fuzz",
                                     description=fuzz.__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="cases to run (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    parser.add_argument("--only-case", type=int, default=None, help="replay this case index only")
    parser.add_argument("--strict", action="store_true", help="known failures fail the run too")
    parser.add_argument("--quiet", action="store_true", help="no reproducers, no table: a one-line result")
    parser.add_argument("--in-process", action="store_true",
                        help="run the cases in this process (a crash then ends the run)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--worker", nargs=2, metavar=("PROGRESS", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        worker(*args.worker, args.calls, args.seed, args.first, args.strict, args.quiet)
        return 0
    if args.only_case is not None or args.in_process:
        counts = run(args.calls, args.seed, only_case=args.only_case, strict=args.strict,
                     quiet=args.quiet)
    else:
        counts = run_isolated(args.calls, args.seed, strict=args.strict, quiet=args.quiet,
                              threads=args.threads)
    if args.quiet:
        totals = {o: sum(n for (_, _, oc), n in counts.items() if oc == o) for o in OUTCOMES}
        print(f"seed {args.seed}: {counts.calls} calls, " + ", ".join(f"{n} {o}" for o, n in totals.items())
              + "; " + ", ".join(f"{t} {100 * x:.1f}%" for t, x in shares(counts).items()))
        for text in counts.reports:  # (crashes and failures: each with its replay line)
            print(text)
    else:
        summary(counts)
    return 1 if counts.failures(args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
