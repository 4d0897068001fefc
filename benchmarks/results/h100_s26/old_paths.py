"""Session 25's host paths, for host.py's --old A/B on one machine: the varlen tree attention op's tail by
concatenation (registered as the ops' CUDA kernels, over the current default ones) and the lifted tensors looked
up through ``get_parameter`` / ``get_buffer``.  Bodies as they were at 8076ed9."""
import torch
from torch.export.graph_signature import InputKind

import treecompile.ops.varlen_tree_attention as vta
from treecompile.ops.key_copies import sum_copies
from treecompile.program import TreeProgram


def old_fwd(q, k, v, subtree_end, scale):
    vta._check(q, k, v, subtree_end)
    plan = vta._plan(subtree_end, q)
    n = plan.tail
    q_t, k_t, v_t = vta._tokens_major(q), vta._tokens_major(k), vta._tokens_major(v)
    r = q.shape[1] // k.shape[1]
    outs, lses = [], []
    if n:
        out, lse = vta._fwd(q_t[:n], *plan.keys(k_t, v_t), plan, scale)
        if n == q_t.shape[0]:
            return vta._heads_major(out.contiguous()), lse.float().contiguous()
        outs.append(out)
        lses.append(lse.float())
    if n < q_t.shape[0]:
        outs.append(v_t[n:].repeat_interleave(r, 1))
        lses.append(((q_t[n:] * k_t[n:].repeat_interleave(r, 1)).sum(-1) * scale).T.float())
    return vta._heads_major(torch.cat(outs, 0).contiguous()), torch.cat(lses, 1).contiguous()


def old_bwd(q, k, v, out, lse, dout, subtree_end, scale):
    plan = vta._plan(subtree_end, q)
    n = plan.tail
    q_t, k_t, v_t, dout_t = (vta._tokens_major(x) for x in (q, k, v, dout))
    if isinstance(plan, vta.BlockSparsePlan):
        return tuple(vta._heads_major(g) for g in vta._bwd(q_t, k_t, v_t, vta._tokens_major(out), dout_t, lse, plan,
                                                            scale))
    T, H, Hkv = q_t.shape[0], q_t.shape[1], k_t.shape[1]
    if not n:
        dq, dk, dv = torch.zeros_like(q_t), torch.zeros_like(k_t), torch.zeros_like(v_t)
    else:
        dq, dkg, dvg = vta._bwd(q_t[:n], *plan.keys(k_t, v_t), vta._tokens_major(out)[:n],
                                dout_t[:n], lse[:, :n].contiguous(), plan, scale)
        if n < T:
            dq = torch.cat([dq, q_t.new_zeros((T - n,) + tuple(q_t.shape[1:]))], 0)
        dk = sum_copies(dkg, plan.copies, plan.key_index, T)
        dv = sum_copies(dvg, plan.copies, plan.key_index, T)
    if n < T:
        acc = torch.promote_types(torch.float32, v.dtype)
        dv[n:] = dout_t[n:].to(acc).unflatten(1, (Hkv, H // Hkv)).sum(2).to(v.dtype)
    return vta._heads_major(dq), vta._heads_major(dk), vta._heads_major(dv)


def old_lifted_value(self, x, tensors=None):
    src = self.model if tensors is None else tensors
    if x.kind == InputKind.PARAMETER:
        return src.get_parameter(x.target)
    if x.kind == InputKind.BUFFER:
        return src.get_buffer(x.target)
    return self.exported_program.constants[x.target]


def install():
    vta.tree_attention_varlen_fwd.register_kernel("cuda")(old_fwd)
    vta.tree_attention_varlen_bwd.register_kernel("cuda")(old_bwd)
    TreeProgram.lifted_value = old_lifted_value
    print("old paths: session 25's varlen tail and lifted-value lookup", flush=True)
