"""A run's tally: Counts, the cases per (entry point, kind, outcome) with the failure reports,
the KNOWN_FAILURES tags the run exercised, the case descriptions and the run's duration (it
pickles whole: the worker processes send theirs); the shares of edge and empty cases; and the
summary table."""

import collections
import sys

from .case import KNOWN_FAILURES


OUTCOMES = ("pass", "known", "fail", "crash")


class Counts(collections.Counter):
    """(entry, kind, outcome) -> cases; with the failure reports (`reports`, known ones in
    `known_reports`), the KNOWN_FAILURES tags the run exercised and those that failed, the case
    descriptions by index, and the run's duration."""

    def __init__(self):
        super().__init__()
        self.reports, self.known_reports = [], []
        self.tags_seen, self.tags_failed = set(), set()
        self.described = {}
        self.tagged = collections.Counter()  # cases per tag: "edge", "empty", "mask"
        self.calls = 0
        self.seconds = 0.0

    def failures(self, strict=False):
        return sum(n for (_, _, o), n in self.items()
                   if o in ("fail", "crash") or strict and o == "known")

    def __reduce__(self):  # (Counter's pickles the counts alone: the workers send all of it)
        return _counts_from, (dict(self), self.__dict__)

    def crashes(self):
        return sum(n for (_, _, o), n in self.items() if o == "crash")

    def merge(self, other):
        self.update(other)
        self.reports += other.reports
        self.known_reports += other.known_reports
        self.tags_seen |= other.tags_seen
        self.tags_failed |= other.tags_failed
        self.described.update(other.described)
        self.tagged.update(other.tagged)
        self.calls += other.calls
        self.seconds += other.seconds


def _counts_from(items, attributes):
    counts = Counts()
    counts.update(items)
    counts.__dict__.update(attributes)
    return counts


def shares(counts):
    """The share of the calls that are edge cases, that have an empty dim, and an empty dim
    beside a mask."""
    n = max(counts.calls, 1)
    return {tag: counts.tagged[tag] / n for tag in ("edge", "empty", "empty+mask")}


def summary(counts, out=sys.stdout):
    """The table per entry point x kind, calls/s, and the state of KNOWN_FAILURES."""
    rows = sorted({(e, k) for e, k, _ in counts})
    print(f"{'entry point':<26}{'kind':<14}" + "".join(f"{o:>7}" for o in OUTCOMES), file=out)
    for e, k in rows:
        print(f"{e:<26}{k:<14}" + "".join(f"{counts[e, k, o]:>7}" for o in OUTCOMES), file=out)
    totals = [sum(n for (_, _, o), n in counts.items() if o == oc) for oc in OUTCOMES]
    print(f"{'total':<40}" + "".join(f"{n:>7}" for n in totals), file=out)
    rate = counts.calls / counts.seconds if counts.seconds else 0.0
    print(f"{counts.calls} calls in {counts.seconds:.1f} s: {rate:.1f} calls/s", file=out)
    print("shares of the calls: " + ", ".join(f"{t} {100 * x:.1f}%" for t, x in shares(counts).items()),
          file=out)
    for tag in sorted(counts.tags_seen - counts.tags_failed):
        print(f"now passing: remove from KNOWN_FAILURES: {tag}", file=out)
    for tag in sorted(counts.tags_failed):
        print(f"still failing (known): {tag}", file=out)
    unseen = sorted(set(KNOWN_FAILURES) - counts.tags_seen)
    if unseen:
        print(f"not exercised in this run: {', '.join(unseen)}", file=out)
