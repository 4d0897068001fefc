"""Triton kernels of :mod:`treecompile.ops.fla_tree_recurrence` (defined where triton imports: ``triton_support``).

fla's two recurrence kernels (``fla/ops/common/chunk_delta_h.py``, flash-linear-attention 0.6, MIT licence,
Copyright (c) 2023-2026 Songlin Yang, Yu Zhang, Zhiyuan Li and contributors) for ``STATE_V_FIRST=False``, a gate per
head and no per-key gate, with the per-chunk arithmetic as fla writes it; what changed is where a segment's state
comes from and goes to (see the module docstring of ``fla_tree_recurrence``).
"""

from treecompile.ops.triton_support import tl, triton

__all__ = ["tree_bwd_dhu_kernel", "tree_fwd_h_kernel"]

if triton is not None:

    @triton.jit
    def exp2(x):  # fla.ops.utils.op.exp2 (without FLA_USE_FAST_OPS)
        return tl.math.exp2(x.to(tl.float32))

    @triton.jit
    def wait(flag):
        ready = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        while ready == 0:
            ready = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def publish(flag):
        tl.debug_barrier()  # every thread's stores of the block come before the flag
        tl.atomic_xchg(flag, 1, sem="release", scope="gpu")

    @triton.jit(do_not_specialize=["T"])
    def tree_fwd_h_kernel(k, v, w, v_new, g, h, h0, states, flags, cu_seqlens, chunk_offsets, order, parent_slot,
                          state_slot, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        NV = tl.cdiv(V, BV)
        i_v, i_gh = pid % NV, pid // NV
        i_h = i_gh % HV
        i_n = tl.load(order + i_gh // HV).to(tl.int64)
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = eos - bos
        NT = tl.cdiv(T, BT)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
        src = tl.load(parent_slot + i_n).to(tl.int64)
        dst = tl.load(state_slot + i_n).to(tl.int64)

        b_h1 = tl.zeros([64, BV], dtype=tl.float32)
        if K > 64:
            b_h2 = tl.zeros([64, BV], dtype=tl.float32)
        if K > 128:
            b_h3 = tl.zeros([64, BV], dtype=tl.float32)
        if K > 192:
            b_h4 = tl.zeros([64, BV], dtype=tl.float32)

        h += (boh * HV + i_h).to(tl.int64) * K * V
        v += (bos * HV + i_h).to(tl.int64) * V
        k += (bos * H + i_h // (HV // H)).to(tl.int64) * K
        w += (bos * HV + i_h).to(tl.int64) * K
        v_new += (bos * HV + i_h).to(tl.int64) * V

        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        o_k1 = tl.arange(0, 64)
        m_k1 = o_k1 < K
        o_k2 = 64 + o_k1
        m_k2 = o_k2 < K
        o_k3 = 128 + o_k1
        m_k3 = o_k3 < K
        o_k4 = 192 + o_k1
        m_k4 = o_k4 < K

        # the state this segment starts from: its parent's final state, or the root state
        if src >= 0:
            wait(flags + (src * HV + i_h) * NV + i_v)
            p0 = states + (src * HV + i_h) * K * V
            b_h1 += tl.load(p0 + o_k1[:, None] * V + o_v[None, :], mask=m_k1[:, None] & m_v[None, :], other=0.0,
                            cache_modifier=".cg")
            if K > 64:
                b_h2 += tl.load(p0 + o_k2[:, None] * V + o_v[None, :], mask=m_k2[:, None] & m_v[None, :],
                                other=0.0, cache_modifier=".cg")
            if K > 128:
                b_h3 += tl.load(p0 + o_k3[:, None] * V + o_v[None, :], mask=m_k3[:, None] & m_v[None, :],
                                other=0.0, cache_modifier=".cg")
            if K > 192:
                b_h4 += tl.load(p0 + o_k4[:, None] * V + o_v[None, :], mask=m_k4[:, None] & m_v[None, :],
                                other=0.0, cache_modifier=".cg")
        else:
            if USE_INITIAL_STATE:
                p0 = h0 + i_h * K * V
                b_h1 += tl.load(p0 + o_k1[:, None] * V + o_v[None, :], mask=m_k1[:, None] & m_v[None, :],
                                other=0.0).to(tl.float32)
                if K > 64:
                    b_h2 += tl.load(p0 + o_k2[:, None] * V + o_v[None, :], mask=m_k2[:, None] & m_v[None, :],
                                    other=0.0).to(tl.float32)
                if K > 128:
                    b_h3 += tl.load(p0 + o_k3[:, None] * V + o_v[None, :], mask=m_k3[:, None] & m_v[None, :],
                                    other=0.0).to(tl.float32)
                if K > 192:
                    b_h4 += tl.load(p0 + o_k4[:, None] * V + o_v[None, :], mask=m_k4[:, None] & m_v[None, :],
                                    other=0.0).to(tl.float32)

        # fla's main recurrence, unchanged (STATE_V_FIRST=False, USE_G, no gk)
        for i_t in range(NT):
            i_t_int64 = tl.cast(i_t, tl.int64)
            o_t = i_t_int64 * BT + tl.arange(0, BT)
            m_t = o_t < T
            p_h1 = h + i_t_int64 * HV * K * V + o_k1[:, None] * V + o_v[None, :]
            tl.store(p_h1, b_h1.to(p_h1.dtype.element_ty), mask=m_k1[:, None] & m_v[None, :])
            if K > 64:
                p_h2 = h + i_t_int64 * HV * K * V + o_k2[:, None] * V + o_v[None, :]
                tl.store(p_h2, b_h2.to(p_h2.dtype.element_ty), mask=m_k2[:, None] & m_v[None, :])
            if K > 128:
                p_h3 = h + i_t_int64 * HV * K * V + o_k3[:, None] * V + o_v[None, :]
                tl.store(p_h3, b_h3.to(p_h3.dtype.element_ty), mask=m_k3[:, None] & m_v[None, :])
            if K > 192:
                p_h4 = h + i_t_int64 * HV * K * V + o_k4[:, None] * V + o_v[None, :]
                tl.store(p_h4, b_h4.to(p_h4.dtype.element_ty), mask=m_k4[:, None] & m_v[None, :])

            p_w = w + o_t[:, None] * (HV * K) + o_k1[None, :]
            b_w = tl.load(p_w, mask=m_t[:, None] & m_k1[None, :], other=0.0)
            b_v = tl.dot(b_w, b_h1.to(b_w.dtype))
            if K > 64:
                p_w = w + o_t[:, None] * (HV * K) + o_k2[None, :]
                b_w = tl.load(p_w, mask=m_t[:, None] & m_k2[None, :], other=0.0)
                b_v = tl.dot(b_w, b_h2.to(b_w.dtype), b_v)
            if K > 128:
                p_w = w + o_t[:, None] * (HV * K) + o_k3[None, :]
                b_w = tl.load(p_w, mask=m_t[:, None] & m_k3[None, :], other=0.0)
                b_v = tl.dot(b_w, b_h3.to(b_w.dtype), b_v)
            if K > 192:
                p_w = w + o_t[:, None] * (HV * K) + o_k4[None, :]
                b_w = tl.load(p_w, mask=m_t[:, None] & m_k4[None, :], other=0.0)
                b_v = tl.dot(b_w, b_h4.to(b_w.dtype), b_v)
            p_v = v + o_t[:, None] * (HV * V) + o_v[None, :]
            b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0) - b_v

            p_vn = v_new + o_t[:, None] * (HV * V) + o_v[None, :]
            tl.store(p_vn, b_v.to(p_vn.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

            last_idx = min((i_t + 1) * BT, T) - 1
            b_g_last = tl.load(g + (bos * HV + last_idx * HV + i_h).to(tl.int64)).to(tl.float32)
            p_g = g + (bos * HV + i_h).to(tl.int64) + o_t * HV
            b_g = tl.load(p_g, mask=m_t, other=0.0).to(tl.float32)
            b_v = b_v * tl.where(m_t, exp2(b_g_last - b_g), 0)[:, None]
            b_g_last = exp2(b_g_last)
            b_h1 *= b_g_last
            if K > 64:
                b_h2 *= b_g_last
            if K > 128:
                b_h3 *= b_g_last
            if K > 192:
                b_h4 *= b_g_last
            b_v = b_v.to(k.dtype.element_ty)

            p_k = k + o_k1[:, None] + o_t[None, :] * (H * K)
            b_k = tl.load(p_k, mask=m_k1[:, None] & m_t[None, :], other=0.0)
            b_h1 = tl.dot(b_k, b_v, b_h1)
            if K > 64:
                p_k = k + o_k2[:, None] + o_t[None, :] * (H * K)
                b_k = tl.load(p_k, mask=m_k2[:, None] & m_t[None, :], other=0.0)
                b_h2 = tl.dot(b_k, b_v, b_h2)
            if K > 128:
                p_k = k + o_k3[:, None] + o_t[None, :] * (H * K)
                b_k = tl.load(p_k, mask=m_k3[:, None] & m_t[None, :], other=0.0)
                b_h3 = tl.dot(b_k, b_v, b_h3)
            if K > 192:
                p_k = k + o_k4[:, None] + o_t[None, :] * (H * K)
                b_k = tl.load(p_k, mask=m_k4[:, None] & m_t[None, :], other=0.0)
                b_h4 = tl.dot(b_k, b_v, b_h4)

        # the final state, for the children
        if dst >= 0:
            pt = states + (dst * HV + i_h) * K * V
            tl.store(pt + o_k1[:, None] * V + o_v[None, :], b_h1, mask=m_k1[:, None] & m_v[None, :])
            if K > 64:
                tl.store(pt + o_k2[:, None] * V + o_v[None, :], b_h2, mask=m_k2[:, None] & m_v[None, :])
            if K > 128:
                tl.store(pt + o_k3[:, None] * V + o_v[None, :], b_h3, mask=m_k3[:, None] & m_v[None, :])
            if K > 192:
                tl.store(pt + o_k4[:, None] * V + o_v[None, :], b_h4, mask=m_k4[:, None] & m_v[None, :])
            publish(flags + (dst * HV + i_h) * NV + i_v)

    @triton.jit(do_not_specialize=["T"])
    def tree_bwd_dhu_kernel(q, k, w, g, dh0, do, dh, dv, dv2, flags, cu_seqlens, chunk_offsets, order, child_ptr,
                            child_idx, scale, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BT: tl.constexpr, BV: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        NV = tl.cdiv(V, BV)
        i_v, i_gh = pid % NV, pid // NV
        i_h = i_gh % HV
        i_n = tl.load(order + i_gh // HV).to(tl.int64)
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = eos - bos
        NT = tl.cdiv(T, BT)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)

        b_dh1 = tl.zeros([64, BV], dtype=tl.float32)
        if K > 64:
            b_dh2 = tl.zeros([64, BV], dtype=tl.float32)
        if K > 128:
            b_dh3 = tl.zeros([64, BV], dtype=tl.float32)
        if K > 192:
            b_dh4 = tl.zeros([64, BV], dtype=tl.float32)

        q += (bos * H + i_h // (HV // H)).to(tl.int64) * K
        k += (bos * H + i_h // (HV // H)).to(tl.int64) * K
        w += (bos * HV + i_h).to(tl.int64) * K
        do += (bos * HV + i_h).to(tl.int64) * V
        dv += (bos * HV + i_h).to(tl.int64) * V
        dv2 += (bos * HV + i_h).to(tl.int64) * V
        dh += (boh * HV + i_h).to(tl.int64) * K * V

        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        o_k1 = tl.arange(0, 64)
        m_k1 = o_k1 < K
        o_k2 = 64 + o_k1
        m_k2 = o_k2 < K
        o_k3 = 128 + o_k1
        m_k3 = o_k3 < K
        o_k4 = 192 + o_k1
        m_k4 = o_k4 < K

        # the final state's gradient: the children's initial-state gradients, summed in their order
        c_lo, c_hi = tl.load(child_ptr + i_n), tl.load(child_ptr + i_n + 1)
        for j in range(c_lo, c_hi):
            c = tl.load(child_idx + j).to(tl.int64)
            wait(flags + (c * HV + i_h) * NV + i_v)
            pc = dh0 + (c * HV + i_h) * K * V
            b_dh1 += tl.load(pc + o_k1[:, None] * V + o_v[None, :], mask=m_k1[:, None] & m_v[None, :], other=0.0,
                             cache_modifier=".cg")
            if K > 64:
                b_dh2 += tl.load(pc + o_k2[:, None] * V + o_v[None, :], mask=m_k2[:, None] & m_v[None, :],
                                 other=0.0, cache_modifier=".cg")
            if K > 128:
                b_dh3 += tl.load(pc + o_k3[:, None] * V + o_v[None, :], mask=m_k3[:, None] & m_v[None, :],
                                 other=0.0, cache_modifier=".cg")
            if K > 192:
                b_dh4 += tl.load(pc + o_k4[:, None] * V + o_v[None, :], mask=m_k4[:, None] & m_v[None, :],
                                 other=0.0, cache_modifier=".cg")

        # fla's backward recurrence, unchanged (STATE_V_FIRST=False, USE_G, no gk)
        for i_t in range(NT - 1, -1, -1):
            i_t_int64 = tl.cast(i_t, tl.int64)
            o_t = i_t_int64 * BT + tl.arange(0, BT)
            m_t = o_t < T
            p_dh1 = dh + i_t_int64 * HV * K * V + o_k1[:, None] * V + o_v[None, :]
            tl.store(p_dh1, b_dh1.to(p_dh1.dtype.element_ty), mask=m_k1[:, None] & m_v[None, :])
            if K > 64:
                p_dh2 = dh + i_t_int64 * HV * K * V + o_k2[:, None] * V + o_v[None, :]
                tl.store(p_dh2, b_dh2.to(p_dh2.dtype.element_ty), mask=m_k2[:, None] & m_v[None, :])
            if K > 128:
                p_dh3 = dh + i_t_int64 * HV * K * V + o_k3[:, None] * V + o_v[None, :]
                tl.store(p_dh3, b_dh3.to(p_dh3.dtype.element_ty), mask=m_k3[:, None] & m_v[None, :])
            if K > 192:
                p_dh4 = dh + i_t_int64 * HV * K * V + o_k4[:, None] * V + o_v[None, :]
                tl.store(p_dh4, b_dh4.to(p_dh4.dtype.element_ty), mask=m_k4[:, None] & m_v[None, :])

            last_idx = min((i_t_int64 + 1) * BT, T) - 1
            bg_last = tl.load(g + (bos + last_idx) * HV + i_h).to(tl.float32)
            p_g = g + bos * HV + i_h + o_t * HV
            b_g = tl.load(p_g, mask=m_t, other=0.0).to(tl.float32)
            bg_last_exp = exp2(bg_last)
            b_g_exp = exp2(b_g)
            p_dv = dv + o_t[:, None] * (HV * V) + o_v[None, :]
            p_dv2 = dv2 + o_t[:, None] * (HV * V) + o_v[None, :]
            p_do = do + o_t[:, None] * (HV * V) + o_v[None, :]

            b_do = tl.load(p_do, mask=m_t[:, None] & m_v[None, :], other=0.0)

            p_k = k + o_t[:, None] * (H * K) + o_k1[None, :]
            b_k = tl.load(p_k, mask=m_t[:, None] & m_k1[None, :], other=0.0)
            b_dv = tl.dot(b_k, b_dh1.to(b_k.dtype))
            if K > 64:
                p_k = k + o_t[:, None] * (H * K) + o_k2[None, :]
                b_k = tl.load(p_k, mask=m_t[:, None] & m_k2[None, :], other=0.0)
                b_dv = tl.dot(b_k, b_dh2.to(b_k.dtype), b_dv)
            if K > 128:
                p_k = k + o_t[:, None] * (H * K) + o_k3[None, :]
                b_k = tl.load(p_k, mask=m_t[:, None] & m_k3[None, :], other=0.0)
                b_dv = tl.dot(b_k, b_dh3.to(b_k.dtype), b_dv)
            if K > 192:
                p_k = k + o_t[:, None] * (H * K) + o_k4[None, :]
                b_k = tl.load(p_k, mask=m_t[:, None] & m_k4[None, :], other=0.0)
                b_dv = tl.dot(b_k, b_dh4.to(b_k.dtype), b_dv)

            b_dv *= tl.where(m_t, exp2(bg_last - b_g), 0)[:, None]
            b_dv += tl.load(p_dv, mask=m_t[:, None] & m_v[None, :], other=0.0)

            tl.store(p_dv2, b_dv.to(p_dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
            p_w = w + o_k1[:, None] + o_t[None, :] * (HV * K)
            p_q = q + o_k1[:, None] + o_t[None, :] * (H * K)
            b_w = tl.load(p_w, mask=m_k1[:, None] & m_t[None, :], other=0.0)
            b_q = tl.load(p_q, mask=m_k1[:, None] & m_t[None, :], other=0.0)
            b_dh1 *= bg_last_exp
            b_q = b_q * b_g_exp[None, :]
            b_dh1 += tl.dot(b_q.to(b_q.dtype), b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))
            if K > 64:
                p_q = q + o_k2[:, None] + o_t[None, :] * (H * K)
                p_w = w + o_k2[:, None] + o_t[None, :] * (HV * K)
                b_q = tl.load(p_q, mask=m_k2[:, None] & m_t[None, :], other=0.0)
                b_w = tl.load(p_w, mask=m_k2[:, None] & m_t[None, :], other=0.0)
                b_dh2 *= bg_last_exp
                b_q = b_q * b_g_exp[None, :]
                b_dh2 += tl.dot(b_q.to(b_q.dtype), b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))
            if K > 128:
                p_q = q + o_k3[:, None] + o_t[None, :] * (H * K)
                p_w = w + o_k3[:, None] + o_t[None, :] * (HV * K)
                b_q = tl.load(p_q, mask=m_k3[:, None] & m_t[None, :], other=0.0)
                b_w = tl.load(p_w, mask=m_k3[:, None] & m_t[None, :], other=0.0)
                b_dh3 *= bg_last_exp
                b_q = b_q * b_g_exp[None, :]
                b_dh3 += tl.dot(b_q.to(b_q.dtype), b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))
            if K > 192:
                p_q = q + o_k4[:, None] + o_t[None, :] * (H * K)
                p_w = w + o_k4[:, None] + o_t[None, :] * (HV * K)
                b_q = tl.load(p_q, mask=m_k4[:, None] & m_t[None, :], other=0.0)
                b_w = tl.load(p_w, mask=m_k4[:, None] & m_t[None, :], other=0.0)
                b_dh4 *= bg_last_exp
                b_q = b_q * b_g_exp[None, :]
                b_dh4 += tl.dot(b_q.to(b_q.dtype), b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))

        # the initial state's gradient, for the parent (or the root state)
        p0 = dh0 + (i_n * HV + i_h) * K * V
        tl.store(p0 + o_k1[:, None] * V + o_v[None, :], b_dh1, mask=m_k1[:, None] & m_v[None, :])
        if K > 64:
            tl.store(p0 + o_k2[:, None] * V + o_v[None, :], b_dh2, mask=m_k2[:, None] & m_v[None, :])
        if K > 128:
            tl.store(p0 + o_k3[:, None] * V + o_v[None, :], b_dh3, mask=m_k3[:, None] & m_v[None, :])
        if K > 192:
            tl.store(p0 + o_k4[:, None] * V + o_v[None, :], b_dh4, mask=m_k4[:, None] & m_v[None, :])
        publish(flags + (i_n * HV + i_h) * NV + i_v)
