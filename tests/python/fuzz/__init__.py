"""A seeded fuzzer over fusedmha's entry points, checked against the float64 reference.

    python tests/python/fuzz --calls 20000 --seed 0       # a long run
    python tests/python/fuzz --seed 3 --only-case 1234    # replay one case
    cd tests/python && python -m fuzz --calls 2000        # the same, as a module

Each case is one call as a user makes it, to one of: fusedmha.scaled_dot_product_attention
(forward, and backward when the inputs require grad), fusedmha.flash_attn_func,
fusedmha.flash_attn_varlen_func, fusedmha.flash_attn_with_kvcache, fusedmha.MultiheadAttention,
and the ops torch.ops.fusedmha.attention_forward / attention_backward. Case `index` of run
`seed` draws everything (entry point, kind, shapes, values, the dropout seed) from
random.Random(seed * CASE_STRIDE + index), so any case replays alone with --only-case.

Kinds of case and what each must give (anything else is a failure, with a reproducer):

- valid: random shapes (0-2 batch dims, heads, GQA, L, S, E, Ev from 1 to a few blocks),
  dtypes, layouts (transposed, sliced, strided, expand()ed, overlapping as_strided, flipped),
  masks (bool, float, broadcast, fully masked rows), causal, dropout (checked against the
  kernels' own keep-mask), the variants; the result (and the gradients) within the test
  suite's tolerances of the float64 reference (reference.py).
- nonfinite: NaN/+-inf in q, k, v or a float mask. Keys a row attends to give the float64
  reference's exact result: a NaN or +inf score makes the row NaN (docs/differences.md), a non-finite value
  of V reaches the columns it is in. A key a row does not attend to (masked, outside the
  causal band or the window) may still turn the row NaN, as in PyTorch, whose masks are
  additive (-inf + NaN = NaN, 0 * inf = NaN); what is never allowed is a finite value that
  differs from the truth, or a finite value where the truth is NaN/inf. (A float mask's lowest
  value, read as hiding, has two truths in a row whose visible keys all score -inf: its hidden
  keys averaged, as PyTorch's additive mask does, or left out, as a band does.)
- empty: a dim of size 0 (batch, heads, L, S, E, Ev): PyTorch's F.scaled_dot_product_attention
  on the same inputs gives the shapes (or both raise).
- huge: cheap but extreme sizes (E = 4096 with L = S = 2, S = 100000 with L = 1, ...), within
  the tolerances.
- overflow: logical sizes past 2^31 elements held in stride-0 views (a mask, keys) or skipped by
  a window, so the work stays small; checked on slices against the reference.
- meta: every tensor on the meta device: the same shapes, dtypes and strides as on the CPU.
- wrong_device / wrong_dtype / wrong_shape: a tensor on the meta device among CPU tensors, an
  integer or mismatched dtype, an impossible shape: a RuntimeError/ValueError/TypeError whose
  message names the entry point called (or the op it hands the call to, as the error tests
  expect); for MultiheadAttention, the exception type nn.MultiheadAttention raises for the
  same call.
- overlap: flash_attn_with_kvcache's caches are written in place: a cache whose elements
  overlap (an expand()ed view), or k_cache and v_cache being one tensor, must raise.
- edge: dims of 0 and 1, batch dims that broadcast, masks of every kind beside them (edges.py),
  for every entry point and for merge_attention and the ring's local step.

Every case runs under a watchdog (faulthandler): a hang dumps the stacks and exits non-zero.
KNOWN_FAILURES lists classes of input that fail today for reasons in the C++ code, each with a
minimal reproducer; their cases still run, and are counted apart unless --strict.

The modules: case.py (the Case record, the entry points, expected errors), draw.py (the random
inputs the generators share), judge.py (references, tolerances, judge()), nonfinite.py (the
truth of NaN/inf inputs), one generator per entry point: sdpa.py (scaled_dot_product_attention
and attention_forward), backward.py (attention_backward), flash_attn.py, varlen.py,
kvcache.py, mha.py, and edges.py (the edge cases of all of them); registry.py (which case a
seed and index draw), counts.py (a run's tally and summary), runner.py (run, run_isolated and
the worker processes), __main__.py (the command line). This file is the surface the tests use.
"""

import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if HERE not in sys.path:  # reference.py and the other helpers of the test suite
    sys.path.insert(0, HERE)

import fusedmha  # noqa: E402  (what the cases call: a test may patch its functions)

from . import edges  # noqa: E402
from .case import ENTRY_POINTS, KNOWN_FAILURES, Case, Mismatch  # noqa: E402
from .counts import OUTCOMES, Counts, shares, summary  # noqa: E402
from .draw import Problem  # noqa: E402
from .judge import FLOOR_SCORE_SIZE, check_forward, judge, score_size  # noqa: E402
from .registry import CASE_STRIDE, ENTRY_WEIGHTS, GENERATORS, KINDS, draw_case  # noqa: E402
from .runner import run, run_isolated  # noqa: E402

__all__ = [
    "CASE_STRIDE", "ENTRY_POINTS", "ENTRY_WEIGHTS", "FLOOR_SCORE_SIZE", "GENERATORS", "KINDS",
    "KNOWN_FAILURES", "OUTCOMES", "Case", "Counts", "Mismatch", "Problem", "check_forward",
    "draw_case", "edges", "fusedmha", "judge", "run", "run_isolated", "score_size", "shares",
    "summary",
]
