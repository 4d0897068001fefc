"""``fla_direct.Launcher``: a ``@triton.heuristics`` / ``@triton.autotune`` kernel launched with its config looked up
once per key gives what ``kernel[grid](...)`` gives, and tunes each of Triton's keys once (Triton's CPU interpreter,
no GPU and no fla needed; fla's own kernels: ``benchmarks/fla_interpret_check.py`` and ``tests/test_fla_gdn.py``)."""

from __future__ import annotations

import pytest

from treecompile.ops import triton_support
from tests.helpers import run_interpreted

_INTERPRETED = r"""
import torch, triton, triton.language as tl
import triton.runtime.autotuner as at
from treecompile.ops.fla_direct import Launcher

tuned = []
def bench(self, *args, config=None, **kwargs):  # the interpreter cannot time: the config with BLOCK 32 wins
    tuned.append(config.kwargs["BLOCK"])
    return [0.0 if config.kwargs["BLOCK"] == 32 else 1.0] * 3
at.Autotuner._bench = bench

@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["D"])
@triton.jit
def scale_rows(x, y, bias, n, D: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x + i, mask=m) * D
    if HAS_BIAS:
        v += tl.load(bias + i, mask=m)
    tl.store(y + i, v, mask=m)

launch = Launcher(scale_rows)
runs, counting, tuner_run = [], [False], launch.tuner.run
launch.tuner.run = lambda *a, **k: (counting[0] and runs.append(1)) or tuner_run(*a, **k)
out = {"equal": 1.0}
for n, D, dtype, bias in [(40, 2, torch.float32, True), (70, 2, torch.float32, False), (33, 3, torch.float32, True),
                          (50, 2, torch.float64, True), (45, 2, torch.float32, True)]:
    x = torch.randn(n, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    want, got = torch.empty_like(x), torch.empty_like(x)
    scale_rows[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x=x, y=want, bias=b, n=n, D=D)
    counting[0] = True  # the launcher's trips through the tuner
    launch(lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x=x, y=got, bias=b, n=n, D=D)
    counting[0] = False
    out["equal"] = min(out["equal"], float(torch.equal(got, want) and torch.equal(want, x * D + (b if bias else 0))))
out["tunings"] = float(len(tuned) // 2)   # Triton's keys: (D, dtypes): (2, f32 f32 f32), (2, f32 f32), (3, ...), (2, f64 ...)
out["memo"] = float(len(launch._configs))  # the launcher's: the same four
out["through_tuner"] = float(len(runs))  # once per key: the fifth launch takes the memo
print(repr(out))
"""


@pytest.mark.skipif(not triton_support.available(), reason="triton is not importable")
def test_launcher_equals_kernel_launch_and_tunes_once_per_key():
    got = run_interpreted(_INTERPRETED)
    assert got == {"equal": 1.0, "tunings": 4.0, "memo": 4.0, "through_tuner": 4.0}, got
