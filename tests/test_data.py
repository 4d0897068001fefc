"""Trajectory JSONL: schema, streaming, grouping, and one error test per malformed input."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from treecompile import reference
from treecompile.models import DenseConfig, DenseForCausalLM
from treecompile.runtime.data import read_trajectories, scatter_to_dfs
from treecompile.runtime.objectives import KLPenalty, PPOClip


def write(tmp_path, lines, name="rollouts.jsonl"):
    f = tmp_path / name
    f.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return f


def ok(tid, ids, **kw):
    return {"tree_id": tid, "input_ids": ids, **kw}


# ---------------------------------------------------------------------- reading
def test_roundtrip_two_trees(tmp_path):
    lines = [
        ok("a", [1, 2, 3, 4], loss_mask=[0, 0, 1, 1], advantage=1.0, weight=2.0, meta={"k": 1},
           old_logprobs=[None, None, -0.5, -0.25], reward=3),
        ok("a", [1, 2, 3, 5, 6], advantage=-0.5, old_logprobs=[0, -1, -0.5, -2, -3], reward=0),
        ok(7, [9, 8], advantage=0.0, old_logprobs=[None, -0.1], reward=1),
    ]
    f = write(tmp_path, lines)
    trees = list(read_trajectories(f))
    assert [t.tree_id for t in trees] == ["a", 7]
    a, b = trees
    assert [a.tree.path(p) for p in range(2)] == [[1, 2, 3, 4], [1, 2, 3, 5, 6]]
    assert a.lines == [1, 2] and b.lines == [3]
    assert a.path_labels == [f"{f}:1", f"{f}:2"]
    assert a.advantages.tolist() == [1.0, -0.5] and a.rewards.tolist() == [3.0, 0.0]
    assert a.tree.path_weights.tolist() == [2.0, 1.0]  # missing weight -> 1
    # missing loss_mask next to a given one -> the default (all but token 0)
    assert a.tree.loss_mask.tolist() == [False, False, True, True, False, True, True, True, True]
    assert a.meta == [{"k": 1}, None]
    assert math.isnan(a.old_logprobs[0]) and a.old_logprobs[2].item() == -0.5
    assert b.tree.has_default_masks and b.advantages.tolist() == [0.0]
    assert a.ref_logprobs is None


def test_streams_one_tree_at_a_time(tmp_path):
    """The first tree comes out before a later bad line is read; the error then names that line."""
    f = write(tmp_path, [ok(1, [1, 2]), ok(1, [1, 3]), ok(2, [4, 5]), "{broken"])
    it = read_trajectories(f)
    first = next(it)
    assert first.tree_id == 1 and first.tree.num_paths == 2
    with pytest.raises(ValueError, match=re.escape(f"{f}:4: bad JSON")):
        next(it)


def test_blank_lines_and_id_types(tmp_path):
    f = write(tmp_path, ["", ok(1, [1, 2]), "   ", ok("1", [1, 2]), ""])
    trees = list(read_trajectories(f))
    assert [t.tree_id for t in trees] == [1, "1"]  # 1 and "1" are different ids
    assert trees[1].lines == [4]


def test_bool_masks_and_int_logprobs(tmp_path):
    f = write(tmp_path, [ok(0, [1, 2, 3], loss_mask=[False, True, 0], ref_logprobs=[None, -1, 0])])
    (t,) = read_trajectories(f)
    assert t.tree.loss_mask.tolist() == [False, True, False]
    assert t.ref_logprobs[1:].tolist() == [-1.0, 0.0] and math.isnan(t.ref_logprobs[0])


def test_duplicate_and_prefix_paths_are_kept(tmp_path):
    f = write(tmp_path, [ok(0, [1, 2, 3]), ok(0, [1, 2, 3]), ok(0, [1, 2])])
    (t,) = read_trajectories(f)
    assert t.tree.num_paths == 3 and t.tree.num_tokens == 3 and t.tree.num_path_tokens == 8


def test_to_batch_extras_padded(tmp_path):
    f = write(tmp_path, [ok(0, [1, 2, 3], advantage=1, old_logprobs=[0, -1, -2], ref_logprobs=[0, -1.5, -2.5]),
                         ok(0, [1, 2, 4], advantage=-1, old_logprobs=[0, -1, -3], ref_logprobs=[0, -1.5, -0.5])])
    (t,) = read_trajectories(f)
    batch = t.to_batch(normalize="token_mean", pad_to_multiple=8)
    assert batch.seq_len == 8 and batch.normalize == "token_mean"
    assert batch.extras["advantages"].tolist() == [1.0, -1.0]
    dfs_ids = batch.input_ids[: batch.num_tokens].tolist()
    old = dict(zip(dfs_ids, batch.extras["old_logprobs"].tolist()))
    assert old == {1: 0.0, 2: -1.0, 3: -2.0, 4: -3.0}  # token 1 (depth 0) is untrained -> 0
    assert batch.extras["old_logprobs"][batch.num_tokens:].tolist() == [0.0] * (8 - batch.num_tokens)
    assert batch.extras["ref_logprobs"].numel() == 8


# ---------------------------------------------------------------------- shared-token agreement
def test_shared_token_logprobs_must_agree(tmp_path):
    f = write(tmp_path, [ok(0, [1, 2, 3], old_logprobs=[0, -1.0, -2]), ok(0, [1, 2, 4], old_logprobs=[0, -1.1, -3])])
    (t,) = read_trajectories(f)
    msg = (f"old_logprobs: the token at depth 1 (id 2) is shared by {f}:2 and {f}:1, which give -1.1 and -1.0 "
           f"(differ by 0.1 > atol 1e-06)")
    with pytest.raises(ValueError, match=re.escape(msg)):
        t.to_batch()
    # an explicit larger tolerance takes the first path's value (file order)
    batch = t.to_batch(logprob_atol=0.2)
    assert batch.extras["old_logprobs"][1].item() == -1.0


def test_untrained_occurrences_are_not_read(tmp_path):
    """Line 2 has token 3 as untrained prompt with another value: only line 1 (trained) counts."""
    f = write(tmp_path, [ok(0, [1, 2, 3], old_logprobs=[0, -1, -2]),
                         ok(0, [1, 2, 3, 4], loss_mask=[0, 0, 0, 1], old_logprobs=[None, 5.0, 7.0, -0.5])])
    (t,) = read_trajectories(f)
    old = t.dfs("old_logprobs")
    assert old.tolist() == [0.0, -1.0, -2.0, -0.5]


def test_scatter_to_dfs_direct():
    from treecompile import Tree
    tree = Tree.from_paths([[1, 2, 3], [1, 2, 4]])
    out = scatter_to_dfs(tree, torch.tensor([0.0, -1, -2, 0, -1, -3], dtype=torch.float64))
    assert dict(zip(tree.input_ids.tolist(), out.tolist())) == {1: 0.0, 2: -1.0, 3: -2.0, 4: -3.0}
    with pytest.raises(ValueError, match=r"x: path 1: entry 2 is not finite \(nan\)"):
        scatter_to_dfs(tree, torch.tensor([0.0, -1, -2, 0, -1, math.nan]), name="x")
    with pytest.raises(ValueError, match="shared by path 0 and path 1"):
        scatter_to_dfs(tree, torch.tensor([0.0, -1, -2, 0, -0.5, -3]))
    with pytest.raises(ValueError, match=r"expected 6 values"):
        scatter_to_dfs(tree, torch.zeros(5))


# ---------------------------------------------------------------------- one test per malformed input
GOOD = json.dumps(ok(0, [1, 2, 3]))
MALFORMED = {
    # name: (lines, line number in the message, what the message says)
    "bad_json": ([GOOD, '{"tree_id": 0, "input_ids": [1, 2'], 2, "bad JSON (Expecting ',' delimiter at column 34)"),
    "bad_json_giant_int": (['{"tree_id": 0, "input_ids": [1, 2' + "0" * 5000 + "]}"], 1, "bad JSON (Exceeds the limit"),
    "not_an_object": ([GOOD, "[1, 2, 3]"], 2, "expected a JSON object, got list"),
    # JSON keeps the last of two equal keys: the path trained would have been [1, 2], not the one written first
    "duplicate_key": ([GOOD, '{"tree_id": 0, "input_ids": [1, 2, 3, 4], "input_ids": [1, 2]}'], 2,
                      "key 'input_ids' appears twice in one object"),
    "duplicate_key_in_meta": (['{"tree_id": 0, "input_ids": [1, 2], "meta": {"a": 1, "a": 2}}'], 1,
                              "key 'a' appears twice"),
    "loss_mask_null": ([{"tree_id": 0, "input_ids": [1, 2], "loss_mask": None}], 1, "'loss_mask' is null; omit "
                       "the key"),
    "missing_tree_id": ([GOOD, {"input_ids": [1, 2]}], 2, "missing 'tree_id'"),
    "tree_id_float": ([{"tree_id": 1.5, "input_ids": [1, 2]}], 1, "'tree_id' must be a string or an integer"),
    "tree_id_null": ([{"tree_id": None, "input_ids": [1, 2]}], 1, "'tree_id' must be a string or an integer"),
    "missing_input_ids": ([GOOD, {"tree_id": 0}], 2, "missing 'input_ids'"),
    "empty_input_ids": ([ok(0, [])], 1, "'input_ids' is empty"),
    "input_ids_not_list": ([ok(0, "1 2 3")], 1, "'input_ids' must be a list"),
    "non_integer_id": ([GOOD, ok(0, [1, 2.5])], 2, "input_ids[1] = 2.5 is not an integer token id"),
    "bool_id": ([ok(0, [1, True])], 1, "input_ids[1] = true is not an integer token id"),
    "negative_id": ([ok(0, [1, -4])], 1, "input_ids[1] = -4 is out of range"),
    "id_overflows_int64": ([ok(0, [1, 2**63])], 1, "is out of range"),
    "unknown_key": ([ok(0, [1, 2], loss_masks=[0, 1])], 1, "unknown key(s) ['loss_masks']"),
    "mask_length_mismatch": ([GOOD, ok(0, [1, 2, 3], loss_mask=[0, 1])], 2, "'loss_mask' has 2 entries, 'input_ids' has 3"),
    "mask_not_binary": ([ok(0, [1, 2, 3], loss_mask=[0, 2, 1])], 1, "loss_mask[1] = 2 is not 0 or 1"),
    "mask_float": ([ok(0, [1, 2, 3], loss_mask=[0, 1.0, 1])], 1, "loss_mask[1] = 1.0 is not 0 or 1"),
    "mask_trains_token_0": ([ok(0, [1, 2], loss_mask=[1, 1])], 1, "loss_mask[0] is 1"),
    "advantage_nan_literal": ([GOOD, '{"tree_id": 0, "input_ids": [1, 2], "advantage": NaN}'], 2, "non-finite number NaN"),
    "advantage_overflow": ([GOOD, '{"tree_id": 0, "input_ids": [1, 2], "advantage": 1e999}'], 2, "'advantage' is not finite"),
    "advantage_string": ([ok(0, [1, 2], advantage="1.0")], 1, "'advantage' must be a number"),
    "advantage_null": ([ok(0, [1, 2], advantage=None)], 1, "'advantage' is null"),
    "reward_infinity": (['{"tree_id": 0, "input_ids": [1, 2], "reward": -Infinity}'], 1, "non-finite number -Infinity"),
    "weight_infinity": (['{"tree_id": 0, "input_ids": [1, 2], "weight": Infinity}'], 1, "non-finite number Infinity"),
    "weight_bool": ([ok(0, [1, 2], weight=True)], 1, "'weight' must be a number"),
    "old_logprobs_length": ([ok(0, [1, 2, 3], old_logprobs=[0, -1])], 1, "'old_logprobs' has 2 entries, 'input_ids' has 3"),
    "old_logprobs_nonfinite": (['{"tree_id": 0, "input_ids": [1, 2], "old_logprobs": [0, -1e999]}'], 1,
                               "old_logprobs[1] is not finite"),
    "old_logprobs_huge_int": (['{"tree_id": 0, "input_ids": [1, 2], "old_logprobs": [0, -1' + "0" * 320 + ']}'], 1,
                              "old_logprobs[1] is not finite (an integer of 321 digits)"),
    "weight_huge_int": (['{"tree_id": 0, "input_ids": [1, 2], "weight": 1' + "0" * 400 + "}"], 1,
                        "'weight' is not finite (an integer of 401 digits)"),
    "old_logprobs_null_trained": ([ok(0, [1, 2, 3], old_logprobs=[None, None, -1])], 1,
                                  "old_logprobs[1] is null, but token 1 is trained"),
    "ref_logprobs_not_list": ([ok(0, [1, 2], ref_logprobs=-1.0)], 1, "'ref_logprobs' must be a list"),
    "ref_logprobs_string": ([ok(0, [1, 2], ref_logprobs=[0, "x"])], 1, "ref_logprobs[1] = \"x\" is not a number"),
    "advantage_on_some_lines": ([ok(0, [1, 2], advantage=1), ok(0, [1, 3]), ok(1, [1, 2])], 2,
                                "tree 0 gives 'advantage' on other lines (e.g. line 1) but not on this one"),
    "old_logprobs_on_some_lines": ([ok(0, [1, 2]), ok(0, [1, 3], old_logprobs=[0, -1])], 1,
                                   "gives 'old_logprobs' on other lines (e.g. line 2)"),
    "ids_not_contiguous": ([ok("a", [1, 2]), ok("b", [1, 2]), ok("a", [1, 3])], 3,
                           "tree_id 'a' reappears; its lines 1-1 were followed by another tree"),
    "group_id_is_not_an_alias": ([ok(0, [1, 2]), {"group_id": 0, "input_ids": [1, 3]}], 2,
                                 "'group_id' is not a key of this format: rename it to 'tree_id'"),
    "id_2_to_the_70": (['{"tree_id": 0, "input_ids": [1, %d]}' % 2**70], 1,
                       f"input_ids[1] = {2**70} is out of range"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed(tmp_path, case):
    lines, line, what = MALFORMED[case]
    f = write(tmp_path, lines)
    with pytest.raises(ValueError, match=re.escape(f"{f}:{line}: ") + ".*" + re.escape(what)):
        list(read_trajectories(f))


def test_not_utf8(tmp_path):
    f = tmp_path / "bin.jsonl"
    f.write_bytes(GOOD.encode() + b"\n" + b'{"tree_id": "\xff", "input_ids": [1]}\n')
    with pytest.raises(ValueError, match=re.escape(f"{f}:2: not UTF-8")):
        list(read_trajectories(f))


def test_vocab_size_checked(tmp_path):
    f = write(tmp_path, [ok(0, [1, 2]), ok(0, [1, 97])])
    with pytest.raises(ValueError, match=re.escape(f"{f}:2: input_ids[1] = 97 is not below vocab_size 97")):
        list(read_trajectories(f, vocab_size=97))


@pytest.mark.parametrize("vocab_size", [0, -3, 2.5, True])
def test_vocab_size_must_be_a_positive_int(tmp_path, vocab_size):
    f = write(tmp_path, [ok(0, [1, 2])])
    with pytest.raises(ValueError, match=re.escape(f"vocab_size: expected a positive integer, got {vocab_size!r}")):
        list(read_trajectories(f, vocab_size=vocab_size))


def test_progress_is_silent_off_a_terminal(tmp_path, capsys):
    f = write(tmp_path, [ok(0, [1, 2]), ok(1, [3, 4])])
    assert [t.tree_id for t in read_trajectories(f, progress=True)] == [0, 1]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank_lines_only"])
def test_empty_file(tmp_path, content):
    f = tmp_path / "empty.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"{f}: empty file: no trajectory lines")):
        list(read_trajectories(f))


# ---------------------------------------------------------------------- file -> objective, end to end
def test_file_to_ppo_and_kl_equal_per_path(tmp_path):
    """JSONL -> batch.extras -> PPOClip + KL on the tree == the per-path formulas on the raw lines."""
    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny()).double()
    g = torch.Generator().manual_seed(3)
    raw = [([5, 6, 7, 8, 9], [0, 0, 0, 1, 1], 1.25), ([5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 0, 1, 1], -0.5),
           ([5, 6, 7, 12], [0, 0, 1, 1], -1.0), ([5, 6, 7, 8, 9, 10, 13], [0, 0, 0, 0, 0, 0, 1], 2.0)]
    shift_old, shift_ref = {}, {}
    lines = []
    for ids, mask, adv in raw:
        lp = reference.path_logprobs(model, ids).detach()
        old, ref = [], []
        for i in range(len(ids)):
            k = tuple(ids[: i + 1])
            so = shift_old.setdefault(k, float(torch.randn((), generator=g, dtype=torch.float64)) * 0.3)
            sr = shift_ref.setdefault(k, float(torch.randn((), generator=g, dtype=torch.float64)) * 0.3)
            old.append(float(lp[i]) + so if mask[i] else None)
            ref.append(float(lp[i]) + sr if mask[i] else None)
        lines.append(ok("g", ids, loss_mask=mask, advantage=adv, old_logprobs=old, ref_logprobs=ref))
    f = write(tmp_path, lines)
    (t,) = read_trajectories(f)
    for normalize in ("sum", "path_mean", "token_mean"):
        batch = t.to_batch(normalize=normalize)
        flat = torch.cat([reference.path_logprobs(model, ids) for ids, _, _ in raw])
        first = torch.full((t.tree.num_tokens,), flat.numel()).scatter_reduce(
            0, t.tree.path_index, torch.arange(flat.numel()), "amin")
        lp_dfs = flat[first]
        got = PPOClip().loss(lp_dfs, batch) + KLPenalty(beta=0.1).loss(lp_dfs, batch)
        counts = [sum(m) for _, m, _ in raw]
        N = len(raw)
        coef = {"sum": [1 / N] * N, "path_mean": [1 / (N * c) for c in counts],
                "token_mean": [1 / sum(counts)] * N}[normalize]
        want = torch.zeros((), dtype=torch.float64)
        for (ids, mask, adv), line, c in zip(raw, lines, coef):
            lp = reference.path_logprobs(model, ids)
            for i in range(len(ids)):
                if mask[i]:
                    r = torch.exp(lp[i] - line["old_logprobs"][i])
                    want = want - c * torch.min(r * adv, r.clamp(0.8, 1.2) * adv)
                    d = line["ref_logprobs"][i] - lp[i]
                    want = want + 0.1 * c * (torch.exp(d) - d - 1)
        assert abs(got.item() - want.item()) <= 1e-9 * abs(want.item())
        params = list(model.parameters())
        g_tree = torch.autograd.grad(got, params)
        g_path = torch.autograd.grad(want, params)
        for a, b in zip(g_tree, g_path):
            assert float((a - b).norm()) <= 1e-9 * float(b.norm()) + 1e-15
