"""A bounded run of the seeded fuzzer (the fuzz package) in the ordinary test suite: every
entry point and kind of case, each case checked as the fuzzer checks it (within the parity
bounds of the float64 reference, or an error naming the entry point called), in a worker
process, so that a case that kills its process is reported as a crash and the run goes on.
Failures print their reproducers (`--seed S --only-case N` replays one). tests/sanitize.sh runs
another seed under ASan + UBSan; a long local run: `python tests/python/fuzz --calls 20000`."""

import io

import pytest
import torch
import torch.nn.functional as F

import fuzz

CALLS = 500  # about a minute on 2 cores


@pytest.fixture(scope="module")
def counts():
    return fuzz.run_isolated(CALLS, seed=0, quiet=True, threads=1)


def test_bounded_fuzz_run_has_no_failures(counts):
    assert counts.calls == CALLS
    assert counts.failures(strict=True) == 0, "\n\n".join(counts.reports + counts.known_reports)


def test_bounded_fuzz_run_draws_edge_cases(counts):
    """At least a tenth of the calls have an empty dim (fuzz/edges.py), most of those beside a
    mask."""
    shares = fuzz.shares(counts)
    assert shares["empty"] >= 0.1, shares
    assert shares["empty+mask"] >= 0.08, shares


def test_a_crash_is_reported_and_the_run_goes_on(monkeypatch):
    """A case that kills its worker (here case 3 of 6, by a signal) is counted as a crash, with
    the case and the signal named and its replay line, and the cases after it still run."""
    monkeypatch.setenv("FUSEDMHA_FUZZ_KILL_CASE", "3")
    counts = fuzz.run_isolated(6, seed=0, quiet=True, threads=1)
    assert counts.calls == 6
    assert counts.crashes() == 1 and counts.failures() == 1, dict(counts)
    report = next(r for r in counts.reports if r.startswith("=== CRASH"))
    assert "case 3:" in report and "signal 8" in report and "--only-case 3" in report, report
    assert sorted(counts.described) == list(range(6))


def test_bounded_fuzz_run_reaches_every_entry_point_and_kind(counts):
    """The run is not vacuous: every entry point the fuzzer knows is called, and every kind of
    case (valid, nonfinite, empty, errors, ...) is drawn."""
    entries = {e for e, _, _ in counts}
    kinds = {k for _, k, _ in counts}
    assert entries == set(fuzz.ENTRY_POINTS), sorted(entries)
    every_kind = {k for ks in fuzz.KINDS.values() for k in ks}
    missing = every_kind - kinds
    assert not missing, f"kinds never drawn in {CALLS} cases: {sorted(missing)}"


def test_a_wrong_result_is_caught(monkeypatch, one_thread):
    """The fuzzer can fail: with fusedmha.scaled_dot_product_attention made slightly wrong (its
    output scaled by 1.001), the sdpa cases among the first 40 fail, each with its replay line."""
    right = fuzz.fusedmha.scaled_dot_product_attention

    def wrong(*args, **kwargs):
        return right(*args, **kwargs) * 1.001

    monkeypatch.setattr(fuzz.fusedmha, "scaled_dot_product_attention", wrong)
    counts = fuzz.run(40, seed=0, quiet=True)
    failed = sum(n for (e, k, o), n in counts.items() if e == "sdpa" and k == "valid" and o == "fail")
    assert failed > 0, dict(counts)
    assert all("--seed 0 --only-case" in r for r in counts.reports)
    out = io.StringIO()
    fuzz.summary(counts, out=out)
    assert "40 calls" in out.getvalue()


@pytest.mark.parametrize("scale,dim,grown", [(None, 64, False), (2.0, 100, True)])
def test_output_floor_grows_only_with_large_scores(scale, dim, grown):
    """check_forward's floor grows with the scores' size past FLOOR_SCORE_SIZE (float32
    rounding of scores of ~50 moves outputs by ~1e-5), and not below it: PyTorch's own output
    passes, an error of 1e-4 fails at the default scale and one of 1e-3 at either."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, dim, generator=g) for n in (23, 40, 40))
    pb = fuzz.Problem(q, k, v, scale=scale)
    assert (fuzz.score_size(pb) > fuzz.FLOOR_SCORE_SIZE) == grown
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    fuzz.check_forward(pb, out, ref)
    for error in (1e-3,) if grown else (1e-4, 1e-3):
        wrong = out.clone()
        wrong[0, 1, 3, 5] += error
        with pytest.raises(AssertionError, match="max error"):
            fuzz.check_forward(pb, wrong, ref)
