"""Running cases: run() judges cases in this process, each under a watchdog (a hang dumps the
stacks and exits non-zero); run_isolated() runs them in worker processes (this package run as
a script with --worker), so that a case that kills its process (a signal, an abort, the
watchdog) is reported as a crash, with its reproducer, and a new worker goes on from the next
case. FUSEDMHA_FUZZ_KILL_CASE=N makes the worker kill itself at case N (test_fuzz.py's check
of that path)."""

import faulthandler
import os
import sys
import time
import traceback

from .case import KNOWN_FAILURES
from .counts import Counts
from .judge import judge
from .registry import draw_case


CASE_TIMEOUT_S = 60.0  # a case that runs longer is a hang
# The package directory: the workers run it as a script, and the replay lines name it.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPLAY = "python tests/python/fuzz"


def reproducer(seed, index, entry, kind, what, tags, why):
    lines = [f"=== FAIL seed {seed} case {index}: {entry} / {kind}" +
             (f" (known: {', '.join(sorted(tags))})" if tags else ""),
             f"case: {what}", why.rstrip(),
             f"replay: {REPLAY} --seed {seed} --only-case {index}"]
    return "\n".join(lines)


def run(calls, seed, only_case=None, strict=False, time_budget=None, quiet=False, out=sys.stdout):
    """Run cases 0 .. calls-1 of `seed` (or only case `only_case`), each under the watchdog;
    returns a Counts. Stops early after `time_budget` seconds. Prints each failure's reproducer
    (known ones too with strict), unless quiet."""
    counts = Counts()
    indices = [only_case] if only_case is not None else range(calls)
    start = time.perf_counter()
    for index in indices:
        if time_budget is not None and time.perf_counter() - start > time_budget:
            break
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        try:
            entry, kind, make_case = draw_case(seed, index)
            what, tags = "(the case could not be drawn)", set()
            try:
                case = make_case()
                what, tags = case.what, set(case.tags)
                why = judge(case)
            except Exception as exc:  # noqa: BLE001  (drawing the case failed)
                why = f"drawing the case raised {type(exc).__name__}: {exc}\n" + traceback.format_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
        counts.calls += 1
        counts.described[index] = f"{entry} / {kind}: {what}"
        counts.tagged.update(tags & {"edge", "empty", "mask", "empty+mask"})
        known = tags & set(KNOWN_FAILURES)
        counts.tags_seen |= known
        if why is None:
            outcome = "pass"
        else:
            outcome = "known" if known else "fail"
            counts.tags_failed |= known
            text = reproducer(seed, index, entry, kind, what, known, why)
            (counts.known_reports if known else counts.reports).append(text)
            if not quiet and (outcome == "fail" or strict):
                print(text, file=out, flush=True)
        counts[entry, kind, outcome] += 1
        if only_case is not None and not quiet:
            print(f"case {index}: {counts.described[index]}\n-> {outcome}", file=out)
    counts.seconds = time.perf_counter() - start
    return counts


def crash_report(seed, index, returncode, stderr_tail):
    what = f"killed by signal {-returncode}" if returncode < 0 else f"exited with {returncode}"
    entry, kind, make_case = draw_case(seed, index)
    try:
        described = make_case().what
    except Exception as exc:  # noqa: BLE001
        described = f"(could not be drawn again: {exc})"
    return entry, kind, described, (f"=== CRASH seed {seed} case {index}: {entry} / {kind}\n"
                                    f"case: {described}\nthe process was {what}; its last words:\n"
                                    f"{stderr_tail.rstrip()}\n"
                                    f"replay: {REPLAY} --seed {seed} "
                                    f"--only-case {index}")


def run_isolated(calls, seed, strict=False, quiet=False, threads=None, out=sys.stdout):
    """run() over cases 0 .. calls-1 in a worker process; where a case kills the worker (a
    signal, an abort, the hang watchdog), it is counted as a crash with its reproducer, and a
    new worker goes on from the next case. Returns the Counts of all the cases."""
    import pickle
    import subprocess
    import tempfile
    counts = Counts()
    start = 0
    with tempfile.TemporaryDirectory() as tmp:
        progress, results, errors = (os.path.join(tmp, n) for n in ("progress", "results", "stderr"))
        while start < calls:
            cmd = [sys.executable, PACKAGE_DIR, "--worker", progress, results,
                   "--seed", str(seed), "--first", str(start), "--calls", str(calls)]
            cmd += (["--strict"] if strict else []) + (["--quiet"] if quiet else [])
            cmd += ["--threads", str(threads)] if threads else []
            with open(errors, "w") as err:
                proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=err)
            with open(results, "rb") as f:  # each judged case's Counts (a torn last one: lost)
                while True:
                    try:
                        counts.merge(pickle.load(f))
                    except (EOFError, pickle.UnpicklingError):
                        break
            with open(progress) as f:
                started = [int(line) for line in f.read().split()]
            if proc.returncode == 0 and started and started[-1] == calls - 1:
                break
            index = started[-1] if started else start
            with open(errors) as f:
                tail = "\n".join(f.read().splitlines()[-25:])
            entry, kind, described, text = crash_report(seed, index, proc.returncode, tail)
            counts[entry, kind, "crash"] += 1
            counts.calls += 1
            counts.described[index] = f"{entry} / {kind}: {described}"
            counts.reports.append(text)
            if not quiet:
                print(text, file=out, flush=True)
            start = index + 1
    return counts


def worker(progress, results, calls, seed, first, strict, quiet):
    """The worker side of run_isolated: writes each case's index to `progress` before it runs
    it (the case that was running when the process died is the last one there), and appends
    each judged case's Counts, pickled, to `results`."""
    import pickle
    import signal
    faulthandler.enable()  # a fatal signal prints the Python stack to stderr: the report's tail
    # (test_fuzz.py checks that a crash is reported and the run goes on: this case dies.)
    kill = os.environ.get("FUSEDMHA_FUZZ_KILL_CASE")
    with open(progress, "w") as marks, open(results, "wb") as judged:
        for index in range(first, calls):
            marks.write(f"{index}\n")
            marks.flush()
            if kill is not None and index == int(kill):
                os.kill(os.getpid(), signal.SIGFPE)
            counts = run(calls, seed, only_case=index, strict=strict, quiet=True)
            if not quiet:
                for text in counts.reports + (counts.known_reports if strict else []):
                    print(text, flush=True)
            pickle.dump(counts, judged)
            judged.flush()
