"""verify_token_locality: ops that mix tokens along the sequence are refused by name; per-token ops pass.

Every model here is an embedding, one op, and a linear head, compiled in float64.  A refusal must
name the node, the aten op and this file's source line; an accepted model must equal the per-path
reference.  Token shift, cumsum along the sequence, depthwise causal conv and hand-written causal
attention have exact tree forms: their rewrite passes (tests/test_rewrite_mixers.py) turn them into
tree ops before the verifier.  Here those passes are disabled, so the verifier itself must refuse them.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import treecompile
from treecompile import Tree, reference
from treecompile.passes import PassError, TokenMixingSite, UnsupportedModelError, UnverifiedGraphWarning
from helpers import capture_once, flat_grads, rel

V, D = 13, 8
PATHS = [[1, 2, 3, 4], [1, 2, 5], [1, 6, 7, 8, 9], [3, 4]]  # two roots, shared prefixes


class OneOp(nn.Module):
    """ids -> embedding [1, T, D] -> ``fn(self, x, ids)`` -> linear head [1, T, V]."""

    def __init__(self, fn, conv: nn.Module | None = None):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)
        self.conv = conv
        self.fn = fn

    def forward(self, ids):
        return self.head(self.fn(self, self.emb(ids), ids))


def _mean_seq(m, x, ids):
    return x + x.mean(dim=1, keepdim=True)


def _max_seq(m, x, ids):
    return x + x.max(dim=1, keepdim=True).values


def _amax_seq(m, x, ids):
    return x * x.amax(dim=-2, keepdim=True)


def _flip_seq(m, x, ids):
    return x + torch.flip(x, dims=[1])


def _roll_seq(m, x, ids):
    return x + torch.roll(x, shifts=1, dims=1)


def _cumsum_seq(m, x, ids):
    return torch.cumsum(x, dim=1)


def _shift_seq(m, x, ids):  # RWKV-style token shift
    return x + F.pad(x, (0, 0, 1, 0))[:, :-1]


def _last_token(m, x, ids):  # reading the last DFS token is not the last token of each path
    return x + x[:, -1:]


def _last_token_broadcast(m, x, ids):  # the last DFS token broadcast to every token: the slice is the mixing
    return x * torch.broadcast_to(x[:, -1:], x.shape)


def _softmax_seq(m, x, ids):
    return x * torch.softmax(x, dim=1)


def _sort_seq(m, x, ids):
    return torch.sort(x, dim=1).values


def _causal_conv(m, x, ids):  # Mamba/Hyena-style depthwise causal conv on a left-padded input
    return m.conv(F.pad(x.transpose(1, 2), (2, 0))).transpose(1, 2)


def _nonzero_gather(m, x, ids):  # a gather through torch.nonzero of the ids: data-dependent positions
    return x + x[:, torch.nonzero(ids[0] > 2)[:, 0]].sum(1, keepdim=True)


def _manual_attention(m, x, ids):  # hand-written causal attention, no SDPA
    T = x.shape[1]
    s = x @ x.transpose(1, 2) / D ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ x


def _seq_len_value(m, x, ids):
    return x / x.shape[1]


def _mean_by_matmul(m, x, ids):  # a mean over the sequence spelled as a matmul with ones
    return x + torch.ones(1, 1, x.shape[1], dtype=x.dtype) @ x


def _einsum_seq(m, x, ids):
    return torch.einsum("btd,bsd->bsd", x, x)  # sums over t


def _mean_under_no_grad(m, x, ids):  # inside a higher-order op body (wrap_with_set_grad_enabled)
    with torch.no_grad():
        c = x.mean(dim=1, keepdim=True)
    return x - c


@torch.library.custom_op("tokenmix_test::whole_sequence", mutates_args=())
def whole_sequence(x: torch.Tensor) -> torch.Tensor:
    """An op nobody here knows: takes [1, T, D], returns [1, T, D] (a prefix mean inside)."""
    return x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]


@whole_sequence.register_fake
def _(x):
    return torch.empty_like(x)


def _custom_op(m, x, ids):
    return whole_sequence(x)


def _repeat_tokens(m, x, ids):  # every token twice along the sequence, then pairs summed: reads no neighbour,
    T = x.shape[1]               # but the repeated axis is the token axis: refused (its length is 2T)
    return x.repeat_interleave(2, dim=1).view(1, T, 2, D).sum(2)


def _repeat_flat(m, x, ids):  # no dim: the whole [1, T, D] is flattened first
    return x.repeat_interleave(2).view(1, x.shape[1], D, 2).mean(-1)


REFUSED = {  # name: (fn, the aten op the refusal names, a word of the reason)
    "mean_over_sequence": (_mean_seq, "aten.mean.dim", "reduces over the sequence"),
    "max_over_sequence": (_max_seq, "aten.max.dim", "reduces over the sequence"),
    "amax_negative_dim": (_amax_seq, "aten.amax.default", "reduces over the sequence"),
    "flip": (_flip_seq, "aten.flip.default", "reversal"),
    "roll": (_roll_seq, "aten.roll.default", "rotation"),
    "cumsum": (_cumsum_seq, "aten.cumsum.default", "prefix sum"),
    "token_shift": (_shift_seq, "aten.pad.default", "pads along the sequence"),
    "last_token": (_last_token, "aten.slice.Tensor", "slices the sequence"),
    "last_token_broadcast": (_last_token_broadcast, "aten.slice.Tensor", "slices the sequence"),
    "softmax_over_sequence": (_softmax_seq, "aten.softmax.int", "softmax"),
    "sort_over_sequence": (_sort_seq, "aten.sort.default", "sort"),
    "causal_conv": (_causal_conv, "aten.pad.default", "pads along the sequence"),
    "nonzero_gather": (_nonzero_gather, "aten.nonzero.default", "collapses the sequence"),
    "manual_attention": (_manual_attention, "aten.matmul.default", "pairs every token"),
    "sequence_length_as_value": (_seq_len_value, "aten.div.Tensor", "sequence length as a value"),
    "mean_by_matmul": (_mean_by_matmul, "aten.matmul.default", "contracts the sequence"),
    "einsum_over_sequence": (_einsum_seq, "aten.einsum.default", "contracts the sequence"),
    "mean_under_no_grad": (_mean_under_no_grad, "aten.mean.dim", "reduces over the sequence"),
    "custom_op": (_custom_op, "tokenmix_test.whole_sequence.default", "custom op outside treecompile"),
    "repeat_interleave_tokens": (_repeat_tokens, "aten.repeat_interleave.self_int", "repeats tokens"),
    "repeat_interleave_flat": (_repeat_flat, "aten.repeat_interleave.self_int", "flattens the sequence"),
}


# Causal mixers with an exact tree form: the pass that rewrites them is disabled for this test.
REWRITTEN_BY = {"cumsum": "rewrite_scans", "token_shift": "rewrite_token_shifts",
                "causal_conv": "rewrite_causal_convs", "manual_attention": "rewrite_causal_attention"}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_token_mixing_is_refused_naming_node_op_and_line(name):
    fn, op, reason = REFUSED[name]
    conv = nn.Conv1d(D, D, 3, groups=D) if fn is _causal_conv else None
    disable = (REWRITTEN_BY[name],) if name in REWRITTEN_BY else ()
    with pytest.raises(PassError) as info:
        treecompile.compile(OneOp(fn, conv).double(), disable=disable)
    msg = str(info.value)
    assert isinstance(info.value.__cause__, UnsupportedModelError)
    assert "verify_token_locality" in msg and "would read other branches" in msg
    first = next(ln for ln in msg.splitlines() if ln.startswith("  - "))
    assert op in first, msg
    assert reason in first, msg
    assert re.search(r"test_verify_token_locality\.py:\d+ in \w+", first), msg  # the user's source line
    assert re.search(r"node \w+", first), msg


@pytest.mark.parametrize("name", sorted(REWRITTEN_BY))
def test_causal_mixers_are_rewritten_not_refused(name):
    """With every pass on, the causal mixers compile (rewritten into tree ops) and equal the per-path run."""
    fn = REFUSED[name][0]
    conv = nn.Conv1d(D, D, 3, groups=D) if fn is _causal_conv else None
    torch.manual_seed(0)
    model = OneOp(fn, conv).double()
    tmodel = treecompile.compile(model)
    assert tmodel.pass_results[REWRITTEN_BY[name]].count >= 1
    out = tmodel(Tree.from_paths(PATHS).to_batch())
    ref = reference.run(model, PATHS)
    params = list(model.parameters())
    assert abs(float(out.loss - ref.loss)) <= 1e-9 * abs(float(ref.loss))
    assert rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)) < 1e-9


def test_conv_without_padding_along_sequence_is_refused_too():
    def conv_only(m, x, ids):  # a padded conv along the sequence (no pad node) still mixes neighbours
        return m.conv(x.transpose(1, 2)).transpose(1, 2)

    with pytest.raises(PassError, match=r"aten\.conv1d\.default.*convolves along the sequence"):
        treecompile.compile(OneOp(conv_only, nn.Conv1d(D, D, 3, padding=1)).double())


def test_pointwise_conv_along_sequence_is_accepted():
    def conv_k1(m, x, ids):  # kernel size 1: a linear map per token
        return m.conv(x.transpose(1, 2)).transpose(1, 2)

    torch.manual_seed(0)
    model = OneOp(conv_k1, nn.Conv1d(D, D, 1)).double()
    out = treecompile.compile(model)(Tree.from_paths(PATHS).to_batch())
    assert abs(float(out.loss - reference.run(model, PATHS).loss)) <= 1e-9 * abs(float(out.loss))


def _mean_feat(m, x, ids):
    return x - x.mean(dim=-1, keepdim=True)


def _softmax_feat(m, x, ids):
    return torch.softmax(x, dim=-1)


def _cumsum_feat(m, x, ids):
    return torch.cumsum(x, dim=2)


def _roll_feat(m, x, ids):
    return torch.roll(x, 1, dims=-1) + torch.flip(x, dims=[0])  # dim 0 is the batch of one


def _heads(m, x, ids):  # reshapes that keep the token axis, per-token attention over 2 "heads"
    h = x.view(1, x.shape[1], 2, D // 2).transpose(1, 2)  # [1, 2, T, 4]
    g = h.transpose(1, 2).reshape(1, x.shape[1], D)
    return g + torch.einsum("btd,de->bte", x, torch.ones(D, D, dtype=x.dtype)) / D


def _sort_topk_feat(m, x, ids):
    v, i = torch.topk(x, 3, dim=-1)
    return torch.zeros_like(x).scatter(-1, i, v) + torch.sort(x, dim=-1).values


def _full_slice(m, x, ids):
    return x[:, : x.shape[1]] * x[:, 0:].amax(-1, keepdim=True)


def _pad_features(m, x, ids):
    return F.pad(x, (1, 1))[..., 1:-1] + torch.cat([x[..., :2], x[..., 2:]], dim=-1)


def _inplace(m, x, ids):
    y = x.clone()
    y[..., :2] = x[..., 2:4] * 2
    y.mul_(2.0)
    return y / y.norm(dim=-1, keepdim=True)


def _merge_tokens(m, x, ids):  # [1, T, D] -> [T*D] -> [1, T, D]: the token axis is followed through
    T = x.shape[1]
    return torch.tanh(x.reshape(T * D)).view(1, T, D)


def _heads_into_tokens(m, x, ids):  # [1, T, 2, 4] -> [2T, 4], norm per head, back (as GDN output norms do)
    T = x.shape[1]
    h = F.layer_norm(x.view(1, T, 2, D // 2).reshape(-1, D // 2), (D // 2,))
    return h.reshape(1, T, D)


def _index_put_features(m, x, ids):  # y[:, :, idx] = values: per-token writes into feature columns
    y = torch.zeros_like(x)
    y[:, :, torch.tensor([1, 3])] = x[..., :2] * 3
    return y + x


def _repeat_heads(m, x, ids):  # [1, T, 2, 4] -> [1, T, 4, 4]: k heads repeated to v heads (HF Qwen3-Next GDN)
    T = x.shape[1]
    return x.view(1, T, 2, D // 2).repeat_interleave(2, dim=2)[:, :, 1:3].reshape(1, T, D)


def _new_empty_filled(m, x, ids):  # MLA's expand_kv (DeepSeek-V3): a new tensor shaped like x, filled by slices
    y = x.new_empty(*x.shape[:-1], D + 2)
    y[..., :D].copy_(x)
    y[..., D:].copy_(x[..., :2] * 3)
    return y[..., 1:D + 1] + x.new_zeros(x.shape) + x.new_full((1, 1, D), 0.5)


def _complex_rotary(m, x, ids):  # DeepSeek-V2's RoPE: polar angles per feature pair, complex product, back to real
    T = x.shape[1]
    angle = torch.arange(D // 2, dtype=x.dtype) * 0.3 + x[..., ::2]  # per token
    rot = torch.polar(torch.ones_like(angle), angle)
    z = torch.view_as_complex(x.reshape(1, T, D // 2, 2)) * rot
    return torch.view_as_real(z).reshape_as(x) + z.real.sum(-1, keepdim=True)


def _expand_as_tokens(m, x, ids):  # a learned per-feature vector broadcast to every token (HRM's initial state)
    return x * m.head.bias[:D].expand_as(x) + x.view_as(x)


def _broadcast_heads(m, x, ids):  # one kv head broadcast to the query heads' shape (HF Falcon's _split_heads)
    T = x.shape[1]
    kv = x.view(1, T, 1, D)
    return (torch.broadcast_to(kv, (1, T, 2, D)) * torch.broadcast_to(m.head.bias[:D], (1, T, 2, D))).sum(2)


def _pointwise_aliases(m, x, ids):  # torch's aliases of pointwise ops, kept under their names by torch.export
    y = torch.multiply(x, torch.special.expit(x)) + torch.subtract(x, 1.0) * torch.divide(x, 3.0)
    y = y + torch.where(torch.greater(x, 0.1), torch.absolute(x), torch.negative(x)) + torch.clip(x, -0.5, 0.5)
    return y + torch.true_divide(torch.arctan(x), 2.0) + torch.nn.functional.logsigmoid(x)


def _noise(m, x, ids):
    return x + 0 * torch.rand_like(x)


ACCEPTED = {
    "index_put_into_features": _index_put_features,
    "tokens_merged_with_features": _merge_tokens,
    "heads_merged_into_tokens": _heads_into_tokens,
    "mean_over_features": _mean_feat,
    "softmax_over_features": _softmax_feat,
    "cumsum_over_features": _cumsum_feat,
    "roll_over_features": _roll_feat,
    "reshapes_and_einsum": _heads,
    "topk_scatter_sort_over_features": _sort_topk_feat,
    "full_range_slice": _full_slice,
    "pad_and_cat_over_features": _pad_features,
    "in_place_updates_of_features": _inplace,
    "repeat_interleave_over_heads": _repeat_heads,
    "new_empty_filled_by_slices": _new_empty_filled,
    "complex_rotary_embedding": _complex_rotary,
    "expand_as_and_view_as": _expand_as_tokens,
    "broadcast_to_heads": _broadcast_heads,
    "pointwise_aliases": _pointwise_aliases,
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_per_token_ops_are_accepted_and_exact(name):
    torch.manual_seed(0)
    model = OneOp(ACCEPTED[name]).double()
    tm = treecompile.compile(model)
    res = tm.pass_results["verify_token_locality"]
    assert res.count == 0 and not [s for s in res.info["sites"] if s.action == "refused"]
    batch = Tree.from_paths(PATHS).to_batch()
    out = tm(batch)
    ref = reference.run(model, PATHS)
    params = list(model.parameters())
    assert abs(float(out.loss - ref.loss)) <= 1e-9 * abs(float(ref.loss))
    assert rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)) < 1e-9


def test_sites_record_tree_ops_and_pass_built_nodes(model):
    with capture_once(model):  # one torch.export of the module's model for the three tests on it; passes run anew
        tm = treecompile.compile(model)
    sites = tm.pass_results["verify_token_locality"].info["sites"]
    assert all(isinstance(s, TokenMixingSite) for s in sites)
    ops = [s.op for s in sites if s.action == "tree op"]
    assert ops.count("treecompile.tree_attention.default") == model.config.num_hidden_layers
    assert "treecompile.linear_logprobs.default" in ops
    aware = {s.op: s.detail for s in sites if s.action == "tree-aware"}
    assert set(aware) == {"aten.index_select.default", "aten.sum.default"}  # rewrite_loss's gather and loss sum
    assert all("rewrite_loss" in d for d in aware.values())
    attn = next(s for s in sites if s.op == "treecompile.tree_attention.default")
    assert "dense.py" in attn.source and "rewrite_attention" in attn.detail


def test_debug_logs_the_sites(model, caplog):
    with caplog.at_level("WARNING", logger="treecompile.passes"), capture_once(model):
        treecompile.compile(model, debug=True)
    lines = [r.getMessage() for r in caplog.records if "token-mixing site" in r.getMessage()]
    assert any("tree_attention" in ln for ln in lines) and any("linear_logprobs" in ln for ln in lines)


def test_random_values_per_token_are_refused_unless_allowed():
    with pytest.raises(PassError, match="random values per DFS position"):
        treecompile.compile(OneOp(_noise).double())
    tm = treecompile.compile(OneOp(_noise).double(), allow_dropout=True)
    assert not [s for s in tm.pass_results["verify_token_locality"].info["sites"] if s.action == "refused"]


def test_refusal_lists_every_independent_site():
    def two(m, x, ids):
        return x.mean(dim=1, keepdim=True) + torch.flip(x, dims=[1])

    with pytest.raises(PassError) as info:
        treecompile.compile(OneOp(two).double())
    listed = [ln for ln in str(info.value).splitlines() if ln.startswith("  - ")]
    assert len(listed) == 2 and "aten.mean.dim" in listed[0] + listed[1] and "aten.flip" in listed[0] + listed[1]


def test_disabling_the_verifier_warns_and_compiles():
    with pytest.warns(UnverifiedGraphWarning, match="UNVERIFIED"):
        tm = treecompile.compile(OneOp(_mean_seq).double(), disable=("verify_token_locality",))
    assert "verify_token_locality" not in tm.pass_results


def test_no_warning_when_the_verifier_runs(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnverifiedGraphWarning)
        with capture_once(model):  # the warning would come from the passes, which run on this copy
            treecompile.compile(model)


def test_verifier_runs_last_in_both_pipelines():
    from treecompile.passes.pipeline import BOUNDARY_PASSES, PASSES

    assert PASSES[-1][0] == BOUNDARY_PASSES[-1][0] == "verify_token_locality"


def test_saved_manifest_and_inspect_list_the_sites(tmp_path, capsys):
    from treecompile import cli, saved

    torch.manual_seed(0)
    tm = treecompile.compile(OneOp(_mean_feat).double())
    saved.save(tm, tmp_path / "prog")
    sites = saved.read_manifest(tmp_path / "prog")["passes"]["verify_token_locality"]["info"]["sites"]
    assert {s["op"] for s in sites} >= {"treecompile.linear_logprobs.default", "aten.index_select.default"}
    assert all(set(s) == {"node", "op", "source", "action", "detail"} for s in sites)
    assert cli.main(["inspect", str(tmp_path / "prog")]) == 0
    out = capsys.readouterr().out
    assert "token-mixing sites" in out and "linear_logprobs" in out and "tree-aware" in out
    loaded = saved.load(tmp_path / "prog")
    batch = Tree.from_paths(PATHS).to_batch()
    assert float(loaded(batch).loss) == float(tm(batch).loss)
