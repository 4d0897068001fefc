"""The fla tree GDN paths with fla's real Triton kernels on a machine without a GPU (Triton's interpreter).

    python benchmarks/fla_interpret_check.py [--seeds 0 1 2]

Runs ``tree_gated_delta_rule_fla`` in float32 on small random trees (long and 1-3-token nodes, fan-out; a prompt
and its sampled completions padded to a bucket, whose padding root runs in a later call) three
ways: whole fla calls (``levels=False``), levelled with each recurrence one launch over the tree
(``fla_gdn_levels.TREE``, replay budget 0), levelled with fla's recurrence kernels launched per call, and levelled
through fla's functions (``fla_gdn_levels.DIRECT = False``), at replay budgets 0 and 8, with a root initial
state.  Checks that the levelled outputs and every input gradient (q, k, v, g, beta, initial state) equal whole
calls bit for bit, and that all of them are within 1e-5 of the float64 reference tree op
(``ops.tree_gdn.tree_gated_delta_rule``).  Exit status 1 on a mismatch.

It needs Triton and fla importable, and two fixes that fla 0.6's kernels need under Triton 3.6's interpreter
(dev-only, in a private target folder, never in the project's environment)::

    pip install --no-deps --target /tmp/fla-interp triton==3.6.0 fla-core==0.6.0 flash-linear-attention==0.6.0 einops
    # 1. a 1-element array as an index (numpy 2 refuses int() of it):
    sed -i 's/int(self.handle.data))/int(self.handle.data.item()))/' /tmp/fla-interp/triton/runtime/interpreter.py
    # 2. a loop counter that is a Python int in the interpreter:
    sed -i 's/i_t_int64 = i_t.to(tl.int64)/i_t_int64 = tl.cast(i_t, tl.int64)/' \\
        /tmp/fla-interp/fla/ops/common/chunk_delta_h.py
    PYTHONPATH=/tmp/fla-interp:$PWD python benchmarks/fla_interpret_check.py

The autotuner cannot time configs without a GPU: this script makes it take the first config (same config for
every call, so the comparison stays exact).  Each seed takes ~20 s on two CPU cores.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402


def _no_bench():
    import triton.runtime.autotuner as at

    at.Autotuner._bench = lambda self, *a, config=None, **k: [0.0, 0.0, 0.0]


def sampled_completions(seed: int) -> list[list[int]]:
    """A prompt and its sampled completions (a GRPO group): padded to a bucket, the plan is already in DFS order
    (no gather) and the padding's root runs in the completions' call."""
    import random

    rnd = random.Random(seed)
    prompt = [rnd.randrange(2, 50) for _ in range(70)]
    return [prompt + [60 + i] + [rnd.randrange(2, 50) for _ in range(rnd.randint(5, 90))] for i in range(5)]


def check(seed: int) -> bool:
    from benchmarks.trees import short_node_paths
    from treecompile import Tree

    deep = Tree.from_paths(short_node_paths(seed, root_len=90, branches=6, tails=(1, 2, 3, 20, 70))).to_batch()
    group = Tree.from_paths(sampled_completions(seed)).to_batch(pad_to_multiple=128)
    return check_batch(seed, "deep", deep) & check_batch(seed, "group", group)


def check_batch(seed: int, name: str, b) -> bool:
    from treecompile.ops import fla_gdn_levels
    from treecompile.ops.fla_gdn import plan_calls, tree_gated_delta_rule_fla
    from treecompile.ops.tree_gdn import tree_gated_delta_rule

    T, H, Hv, K, V = b.seq_len, 1, 2, 16, 16
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    xs = [mk(1, T, H, K), mk(1, T, H, K), mk(1, T, Hv, V),
          -torch.rand(1, T, Hv, generator=gen, dtype=torch.float64) * 0.3,
          torch.rand(1, T, Hv, generator=gen, dtype=torch.float64)]
    h0, do = mk(Hv, K, V) * 0.1, mk(1, T, Hv, V)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)

    def run(fn, dtype, **kw):
        x = [t.to(dtype).requires_grad_() for t in xs]
        i0 = h0.to(dtype).requires_grad_()
        o = fn(*x, *nodes, i0, use_qk_l2norm_in_kernel=True, **kw)
        return [o.detach().double()] + [g.double() for g in torch.autograd.grad(o, x + [i0], do.to(o.dtype))]

    ref = run(tree_gated_delta_rule, torch.float64)
    ok = True
    for replay in (0, 8):
        whole = run(tree_gated_delta_rule_fla, torch.float32, levels=False, replay_max=replay)
        # the recurrence as one launch over the tree (plans without replay), per call launched directly, per call
        # through fla's functions
        for mode in ("tree", "direct", "fla") if replay == 0 else ("direct", "fla"):
            fla_gdn_levels.TREE, fla_gdn_levels.DIRECT = mode == "tree", mode != "fla"
            got = run(tree_gated_delta_rule_fla, torch.float32, levels=True, replay_max=replay)
            same = all(torch.equal(a, w) for a, w in zip(got, whole))
            err = max(float((a - r).abs().max() / r.abs().max()) for a, r in zip(got, ref))
            plan = plan_calls(*nodes[:3], replay_max=replay)
            print(f"{name} seed {seed} replay {replay} ({plan.calls} calls, {T} tokens, rows "
                  f"{plan.rows_read(mode != 'fla')}) {mode}: "
                  f"equal to whole calls {same}, max rel err vs float64 {err:.1e}")
            ok &= same and err < 1e-5
    fla_gdn_levels.TREE, fla_gdn_levels.DIRECT = True, True
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args(argv)
    _no_bench()
    ok = all([check(s) for s in args.seeds])
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
