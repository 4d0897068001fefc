# AOT ID: ['0_forward']
from ctypes import c_void_p, c_long, c_int
import torch
import math
import random
import os
import tempfile
from math import inf, nan
from cmath import nanj
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels
import triton
import triton.language as tl
from torch._inductor.runtime.triton_heuristics import start_graph, end_graph
from torch._C import _cuda_getCurrentRawStream as get_raw_stream

aten = torch.ops.aten
inductor_ops = torch.ops.inductor
_quantized = torch.ops._quantized
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
empty_strided_cpu_pinned = torch._C._dynamo.guards._empty_strided_cpu_pinned
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
empty_strided_xpu = torch._C._dynamo.guards._empty_strided_xpu
empty_strided_mtia = torch._C._dynamo.guards._empty_strided_mtia
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
alloc_from_pool = torch.ops.inductor._alloc_from_pool
async_compile = AsyncCompile()
empty_strided_p2p = torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p
from torch._C import _cuda_getCurrentRawStream as get_raw_stream



# kernel path: /tmp/kc/inductor/3x/c3xeqq3pcdlzx4vxeicvupeyinap6trunnmq6g5xfsavl64ugw5k.py
# Topologically Sorted Source Nodes: [embedding, pow_2, mean, add, rsqrt, mul_2, mul_3], Original ATen: [aten.embedding, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul]
# Source node to ATen node mapping:
#   add => add_1
#   embedding => embedding
#   mean => mean
#   mul_2 => mul_3
#   mul_3 => mul_4
#   pow_2 => pow_2
#   rsqrt => rsqrt
# Graph fragment:
#   %primals_1 : Tensor "i64[1, 256][256, 1]cuda:0" = PlaceHolder[target=primals_1]
#   %primals_2 : Tensor "bf16[512, 256][256, 1]cuda:0" = PlaceHolder[target=primals_2]
#   %embedding : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=embedding]
#   %buf7 : Tensor "f32[1, 256, 1][256, 1, 256]cuda:0" = PlaceHolder[target=buf7]
#   %rsqrt : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0" = PlaceHolder[target=rsqrt]
#   %primals_4 : Tensor "bf16[256][1]cuda:0" = PlaceHolder[target=primals_4]
#   %embedding : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=4] = call_function[target=torch.ops.aten.embedding.default](args = (%primals_2, %primals_1), kwargs = {})
#   %pow_2 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%embedding, 2), kwargs = {})
#   %mean : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_2, [-1], True), kwargs = {})
#   %add_1 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean, 1e-06), kwargs = {})
#   %rsqrt : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_1,), kwargs = {})
#   %mul_3 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%embedding, %rsqrt), kwargs = {})
#   %mul_4 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_3, %primals_4), kwargs = {})
#   return %embedding,%buf7,%rsqrt,%mul_4
triton_per_fused_add_embedding_mean_mul_pow_rsqrt_0 = async_compile.triton('triton_per_fused_add_embedding_mean_mul_pow_rsqrt_0', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 256, 'r0_': 256},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*i64', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'out_ptr0': '*bf16', 'out_ptr2': '*bf16', 'out_ptr3': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]], (7,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused_add_embedding_mean_mul_pow_rsqrt_0', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 2, 'num_store': 3, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 3072, 'r0_': 524800}}
)
@triton.jit
def triton_per_fused_add_embedding_mean_mul_pow_rsqrt_0(in_ptr0, in_ptr1, in_ptr2, out_ptr0, out_ptr2, out_ptr3, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 256
    r0_numel = 256
    R0_BLOCK: tl.constexpr = 256
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    x0 = xindex
    r0_1 = r0_index
    tmp0 = tl.load(in_ptr0 + (x0), xmask, eviction_policy='evict_last')
    tmp20 = tl.load(in_ptr2 + (r0_1), None, eviction_policy='evict_last').to(tl.float32)
    tmp1 = tl.full([1, 1], 512, tl.int32)
    tmp2 = tmp0 + tmp1
    tmp3 = tmp0 < 0
    tmp4 = tl.where(tmp3, tmp2, tmp0)
    tl.device_assert(((0 <= tmp4) & (tmp4 < 512)) | ~(xmask), "index out of bounds: 0 <= tmp4 < 512")
    tmp6 = tl.load(in_ptr1 + (r0_1 + 256*tmp4), xmask, other=0.0).to(tl.float32)
    tmp7 = tmp6 * tmp6
    tmp8 = tmp7.to(tl.float32)
    tmp9 = tl.broadcast_to(tmp8, [XBLOCK, R0_BLOCK])
    tmp11 = tl.where(xmask, tmp9, 0)
    tmp12 = tl.sum(tmp11, 1)[:, None].to(tl.float32)
    tmp13 = tl.full([1, 1], 256.0, tl.float32)
    tmp14 = (tmp12 / tmp13)
    tmp15 = tmp14.to(tl.float32)
    tmp16 = tl.full([1, 1], 1e-06, tl.float32)
    tmp17 = tmp15 + tmp16
    tmp18 = libdevice.rsqrt(tmp17)
    tmp19 = tmp6 * tmp18
    tmp21 = tmp19 * tmp20
    tl.store(out_ptr0 + (r0_1 + 256*x0), tmp6, xmask)
    tl.store(out_ptr2 + (x0), tmp18, xmask)
    tl.store(out_ptr3 + (r0_1 + 256*x0), tmp21, xmask)
''', device_str='cuda')


# kernel path: /tmp/kc/inductor/cn/ccnrkcdrjmjgkjso56xe5bfbxfrlaprkpgh3njecqvj75tc6jdu5.py
# Topologically Sorted Source Nodes: [arange, div, pow_1, reciprocal, mul, unsqueeze, to, unsqueeze_1, mul_1, cat, cos, to_1, materialize_default, sin, to_2, materialize_default_1], Original ATen: [aten.arange, aten.div, aten.pow, aten.reciprocal, aten.mul, aten.unsqueeze, aten._to_copy, aten.cat, aten.cos, treecompile.materialize, aten.sin]
# Source node to ATen node mapping:
#   arange => add, convert_element_type, iota, mul
#   cat => clone, expand, unsqueeze_2, view
#   cos => cos
#   div => div
#   materialize_default => materialize
#   materialize_default_1 => materialize_1
#   mul => mul_1
#   mul_1 => mul_2
#   pow_1 => pow_1
#   reciprocal => reciprocal
#   sin => sin
#   to => convert_element_type_1
#   to_1 => convert_element_type_2
#   to_2 => convert_element_type_3
#   unsqueeze => unsqueeze
#   unsqueeze_1 => unsqueeze_1
# Graph fragment:
#   %primals_3 : Tensor "i64[256][1]cuda:0" = PlaceHolder[target=primals_3]
#   %iota : Tensor "i64[64][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.iota.default](args = (64,), kwargs = {start: 0, step: 1, dtype: torch.int64, device: cuda:0, requires_grad: False})
#   %mul : Tensor "i64[64][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%iota, 2), kwargs = {})
#   %add : Tensor "i64[64][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul, 0), kwargs = {})
#   %convert_element_type : Tensor "f64[64][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%add, torch.float64), kwargs = {})
#   %div : Tensor "f64[64][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.div.Tensor](args = (%convert_element_type, 128), kwargs = {})
#   %pow_1 : Tensor "f64[64][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Scalar](args = (1000000.0, %div), kwargs = {})
#   %reciprocal : Tensor "f64[64][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reciprocal.default](args = (%pow_1,), kwargs = {})
#   %mul_1 : Tensor "f64[64][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%reciprocal, 1.0), kwargs = {})
#   %unsqueeze : Tensor "i64[256, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%primals_3, 1), kwargs = {})
#   %convert_element_type_1 : Tensor "f64[256, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%unsqueeze, torch.float64), kwargs = {})
#   %unsqueeze_1 : Tensor "f64[1, 64][64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%mul_1, 0), kwargs = {})
#   %mul_2 : Tensor "f64[256, 64][64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_1, %unsqueeze_1), kwargs = {})
#   %unsqueeze_2 : Tensor "f64[256, 1, 64][64, 64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%mul_2, 1), kwargs = {})
#   %expand : Tensor "f64[256, 2, 64][64, 0, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.expand.default](args = (%unsqueeze_2, [256, 2, 64]), kwargs = {})
#   %clone : Tensor "f64[256, 2, 64][128, 64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.clone.default](args = (%expand,), kwargs = {memory_format: torch.contiguous_format})
#   %view : Tensor "f64[256, 128][128, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.reshape.default](args = (%clone, [256, 128]), kwargs = {})
#   %cos : Tensor "f64[256, 128][128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.cos.default](args = (%view,), kwargs = {})
#   %convert_element_type_2 : Tensor "bf16[256, 128][128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%cos, torch.bfloat16), kwargs = {})
#   %materialize : Tensor "bf16[256, 128][128, 1]cuda:0"[num_users=5] = call_function[target=torch.ops.treecompile.materialize.default](args = (%convert_element_type_2,), kwargs = {})
#   %sin : Tensor "f64[256, 128][128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sin.default](args = (%view,), kwargs = {})
#   %convert_element_type_3 : Tensor "bf16[256, 128][128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%sin, torch.bfloat16), kwargs = {})
#   %materialize_1 : Tensor "bf16[256, 128][128, 1]cuda:0"[num_users=5] = call_function[target=torch.ops.treecompile.materialize.default](args = (%convert_element_type_3,), kwargs = {})
#   return %buf1,%buf4
triton_poi_fused__to_copy_arange_cat_cos_div_materialize_mul_pow_reciprocal_sin_unsqueeze_1 = async_compile.triton('triton_poi_fused__to_copy_arange_cat_cos_div_materialize_mul_pow_reciprocal_sin_unsqueeze_1', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'y': 256, 'x': 128}, tile_hint=TileHint.DEFAULT,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*i64', 'out_ptr0': '*bf16', 'out_ptr1': '*bf16', 'ynumel': 'i32', 'xnumel': 'i32', 'YBLOCK': 'constexpr', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid2D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused__to_copy_arange_cat_cos_div_materialize_mul_pow_reciprocal_sin_unsqueeze_1', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 1, 'num_store': 2, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'y': 2048, 'x': 262144}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused__to_copy_arange_cat_cos_div_materialize_mul_pow_reciprocal_sin_unsqueeze_1(in_ptr0, out_ptr0, out_ptr1, ynumel, xnumel, YBLOCK : tl.constexpr, XBLOCK : tl.constexpr):
    ynumel = 256
    xnumel = 128
    yoffset = tl.program_id(1) * YBLOCK
    yindex = yoffset + tl.arange(0, YBLOCK)[:, None]
    ymask = yindex < ynumel
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[None, :]
    xmask = xindex < xnumel
    y0 = yindex
    x1 = xindex
    tmp0 = tl.load(in_ptr0 + (y0), ymask, eviction_policy='evict_last')
    tmp1 = tmp0.to(tl.float64)
    tmp2 = 2*((x1 % 64))
    tmp3 = tmp2.to(tl.float64)
    tmp4 = tl.full([1, 1], 0.0078125, tl.float64)
    tmp5 = tmp3 * tmp4
    tmp6 = tl.full([1, 1], 1000000.0, tl.float64)
    tmp7 = libdevice.pow(tmp6, tmp5)
    tmp8 = tl.full([1, 1], 1, tl.int32)
    tmp9 = (tmp8 / tmp7)
    tmp10 = tl.full([1, 1], 1.0, tl.float64)
    tmp11 = tmp9 * tmp10
    tmp12 = tmp1 * tmp11
    tmp13 = libdevice.cos(tmp12)
    tmp14 = tmp13.to(tl.float32)
    tmp15 = libdevice.sin(tmp12)
    tmp16 = tmp15.to(tl.float32)
    tl.store(out_ptr0 + (x1 + 128*y0), tmp14, xmask & ymask)
    tl.store(out_ptr1 + (x1 + 128*y0), tmp16, xmask & ymask)
''', device_str='cuda')


# kernel path: /tmp/kc/inductor/w2/cw2tp5t2fspopxbbyl6vkxzxscaplfspb4qhyyz6nnc2jyms35qw.py
# Topologically Sorted Source Nodes: [clamp_min_default, ge_scalar], Original ATen: [aten.clamp_min, aten.ge]
# Source node to ATen node mapping:
#   clamp_min_default => clamp_min
#   ge_scalar => ge_3
# Graph fragment:
#   %primals_28 : Tensor "i64[256][1]cuda:0" = PlaceHolder[target=primals_28]
#   %clamp_min : Tensor "i64[256][1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.clamp_min.default](args = (%primals_28, 0), kwargs = {})
#   %ge_3 : Tensor "b8[256][1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.ge.Scalar](args = (%primals_28, 0), kwargs = {})
#   return %clamp_min,%ge_3
triton_poi_fused_clamp_min_ge_2 = async_compile.triton('triton_poi_fused_clamp_min_ge_2', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 256}, 
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*i64', 'out_ptr0': '*i64', 'out_ptr1': '*i1', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused_clamp_min_ge_2', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 1, 'num_store': 2, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 6656}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_clamp_min_ge_2(in_ptr0, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):
    xnumel = 256
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tmp1 = tl.full([1], 0, tl.int64)
    tmp2 = triton_helpers.maximum(tmp0, tmp1)
    tmp3 = tmp0 >= tmp1
    tl.store(out_ptr0 + (x0), tmp2, xmask)
    tl.store(out_ptr1 + (x0), tmp3, xmask)
''', device_str='cuda')

def partition_0(args):
    primals_1, primals_2, primals_4, primals_3, primals_5, primals_6, primals_7, primals_28 = args
    args.clear()
    assert_size_stride(primals_1, (1, 256), (256, 1))
    assert_size_stride(primals_2, (512, 256), (256, 1))
    assert_size_stride(primals_4, (256, ), (1, ))
    assert_size_stride(primals_3, (256, ), (1, ))
    assert_size_stride(primals_5, (512, 256), (256, 1))
    assert_size_stride(primals_6, (256, 256), (256, 1))
    assert_size_stride(primals_7, (256, 256), (256, 1))
    assert_size_stride(primals_28, (256, ), (1, ))
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf0 = empty_strided_cuda((1, 256, 256), (65536, 256, 1), torch.bfloat16)
        buf8 = empty_strided_cuda((1, 256, 1), (256, 1, 1), torch.bfloat16)
        buf9 = empty_strided_cuda((1, 256, 256), (65536, 256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [embedding, pow_2, mean, add, rsqrt, mul_2, mul_3], Original ATen: [aten.embedding, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul]
        stream0 = get_raw_stream(0)
        triton_per_fused_add_embedding_mean_mul_pow_rsqrt_0.run(primals_1, primals_2, primals_4, buf0, buf8, buf9, 256, 256, stream=stream0)
        buf1 = empty_strided_cuda((256, 128), (128, 1), torch.bfloat16)
        buf4 = empty_strided_cuda((256, 128), (128, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [arange, div, pow_1, reciprocal, mul, unsqueeze, to, unsqueeze_1, mul_1, cat, cos, to_1, materialize_default, sin, to_2, materialize_default_1], Original ATen: [aten.arange, aten.div, aten.pow, aten.reciprocal, aten.mul, aten.unsqueeze, aten._to_copy, aten.cat, aten.cos, treecompile.materialize, aten.sin]
        stream0 = get_raw_stream(0)
        triton_poi_fused__to_copy_arange_cat_cos_div_materialize_mul_pow_reciprocal_sin_unsqueeze_1.run(primals_3, buf1, buf4, 256, 128, stream=stream0)
        del primals_3
        buf10 = empty_strided_cuda((256, 512), (512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_2, mul_3, linear], Original ATen: [aten.mul, aten.t, aten.view, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf9, (256, 256), (256, 1), 0), reinterpret_tensor(primals_5, (256, 512), (1, 256), 0), out=buf10)
        buf11 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_2, mul_3, linear, linear_1], Original ATen: [aten.mul, aten.view, aten.t, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf9, (256, 256), (256, 1), 0), reinterpret_tensor(primals_6, (256, 256), (1, 256), 0), out=buf11)
        buf12 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_2, mul_3, linear, linear_2], Original ATen: [aten.mul, aten.view, aten.t, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf9, (256, 256), (256, 1), 0), reinterpret_tensor(primals_7, (256, 256), (1, 256), 0), out=buf12)
        buf64 = empty_strided_cuda((256, ), (1, ), torch.int64)
        buf72 = empty_strided_cuda((256, ), (1, ), torch.bool)
        # Topologically Sorted Source Nodes: [clamp_min_default, ge_scalar], Original ATen: [aten.clamp_min, aten.ge]
        stream0 = get_raw_stream(0)
        triton_poi_fused_clamp_min_ge_2.run(primals_28, buf64, buf72, 256, stream=stream0)
        del primals_28
    return (buf0, buf8, buf9, buf1, buf4, buf10, buf11, buf12, buf64, buf72, primals_1, primals_2, primals_4, primals_5, primals_6, primals_7, )
from torch._C import _cuda_getCurrentRawStream as get_raw_stream



# kernel path: /tmp/kc/inductor/rt/crtp4ozsno5hi6vvlkwyqahtb7lvkxbekszdruzqa3un62xqkkmy.py
# Topologically Sorted Source Nodes: [linear, view, pow_3, mean_1, add_1, rsqrt_1, mul_4, mul_5, transpose, chunk_default, mul_8, neg, cat_1, mul_9, add_3], Original ATen: [aten._unsafe_view, aten.view, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.transpose, aten.split, aten.neg, aten.cat]
# Source node to ATen node mapping:
#   add_1 => add_2
#   add_3 => add_4
#   cat_1 => cat
#   chunk_default => split
#   linear => view_2
#   mean_1 => mean_1
#   mul_4 => mul_5
#   mul_5 => mul_6
#   mul_8 => mul_9
#   mul_9 => mul_10
#   neg => neg
#   pow_3 => pow_3
#   rsqrt_1 => rsqrt_1
#   transpose => permute_3
#   view => view_3
# Graph fragment:
#   %mm : Tensor "bf16[256, 512][512, 1]cuda:0" = PlaceHolder[target=mm]
#   %buf13 : Tensor "f32[1, 256, 4, 1][1024, 4, 1, 1024]cuda:0" = PlaceHolder[target=buf13]
#   %rsqrt_1 : Tensor "bf16[1, 256, 4, 1][1024, 4, 1, 1]cuda:0" = PlaceHolder[target=rsqrt_1]
#   %primals_8 : Tensor "bf16[128][1]cuda:0" = PlaceHolder[target=primals_8]
#   %materialize : Tensor "bf16[256, 128][128, 1]cuda:0" = PlaceHolder[target=materialize]
#   %materialize_1 : Tensor "bf16[256, 128][128, 1]cuda:0" = PlaceHolder[target=materialize_1]
#   %view_2 : Tensor "bf16[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm, [1, 256, 512]), kwargs = {})
#   %view_3 : Tensor "bf16[1, 256, 4, 128][131072, 512, 128, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.reshape.default](args = (%view_2, [1, 256, 4, 128]), kwargs = {})
#   %pow_3 : Tensor "bf16[1, 256, 4, 128][131072, 512, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%view_3, 2), kwargs = {})
#   %mean_1 : Tensor "bf16[1, 256, 4, 1][1024, 4, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_3, [-1], True), kwargs = {})
#   %add_2 : Tensor "bf16[1, 256, 4, 1][1024, 4, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean_1, 1e-06), kwargs = {})
#   %rsqrt_1 : Tensor "bf16[1, 256, 4, 1][1024, 4, 1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_2,), kwargs = {})
#   %mul_5 : Tensor "bf16[1, 256, 4, 128][131072, 512, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%view_3, %rsqrt_1), kwargs = {})
#   %mul_6 : Tensor "bf16[1, 256, 4, 128][131072, 512, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_5, %primals_8), kwargs = {})
#   %permute_3 : Tensor "bf16[1, 4, 256, 128][131072, 128, 512, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.permute.default](args = (%mul_6, [0, 2, 1, 3]), kwargs = {})
#   %split : [num_users=2] = call_function[target=torch.ops.aten.split.Tensor](args = (%permute_3, 64, -1), kwargs = {})
#   %mul_9 : Tensor "bf16[1, 4, 256, 128][131072, 128, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%permute_3, %materialize), kwargs = {})
#   %neg : Tensor "bf16[1, 4, 256, 64][65536, 64, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.neg.default](args = (%getitem_1,), kwargs = {})
#   %cat : Tensor "bf16[1, 4, 256, 128][131072, 32768, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.cat.default](args = ([%neg, %getitem], -1), kwargs = {})
#   %mul_10 : Tensor "bf16[1, 4, 256, 128][131072, 32768, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%cat, %materialize_1), kwargs = {})
#   %add_4 : Tensor "bf16[1, 4, 256, 128][131072, 128, 512, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul_9, %mul_10), kwargs = {})
#   return %buf13,%rsqrt_1,%add_4
triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_3 = async_compile.triton('triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_3', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 1024, 'r0_': 128},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'in_ptr3': '*bf16', 'out_ptr1': '*bf16', 'out_ptr2': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]], (7,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_3', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 8, 'num_store': 2, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 4096, 'r0_': 1442560}}
)
@triton.jit
def triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_3(in_ptr0, in_ptr1, in_ptr2, in_ptr3, out_ptr1, out_ptr2, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 1024
    r0_numel = 128
    R0_BLOCK: tl.constexpr = 128
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    x3 = xindex // 4
    tmp0 = tl.load(in_ptr0 + (r0_1 + 128*x0), xmask, other=0.0).to(tl.float32)
    tmp14 = tl.load(in_ptr1 + (r0_1), None, eviction_policy='evict_last').to(tl.float32)
    tmp16 = tl.load(in_ptr2 + (r0_1 + 128*x3), xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp40 = tl.load(in_ptr3 + (r0_1 + 128*x3), xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp1 = tmp0 * tmp0
    tmp2 = tmp1.to(tl.float32)
    tmp3 = tl.broadcast_to(tmp2, [XBLOCK, R0_BLOCK])
    tmp5 = tl.where(xmask, tmp3, 0)
    tmp6 = tl.sum(tmp5, 1)[:, None].to(tl.float32)
    tmp7 = tl.full([1, 1], 128.0, tl.float32)
    tmp8 = (tmp6 / tmp7)
    tmp9 = tmp8.to(tl.float32)
    tmp10 = tl.full([1, 1], 1e-06, tl.float32)
    tmp11 = tmp9 + tmp10
    tmp12 = libdevice.rsqrt(tmp11)
    tmp13 = tmp0 * tmp12
    tmp15 = tmp13 * tmp14
    tmp17 = tmp15 * tmp16
    tmp18 = r0_1
    tmp19 = tl.full([1, 1], 0, tl.int64)
    tmp20 = tmp18 >= tmp19
    tmp21 = tl.full([1, 1], 64, tl.int64)
    tmp22 = tmp18 < tmp21
    tmp23 = tl.load(in_ptr0 + (64 + 128*x0 + (r0_1)), tmp22 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp24 = tmp23 * tmp12
    tmp25 = tl.load(in_ptr1 + (tl.broadcast_to(64 + (r0_1), [XBLOCK, R0_BLOCK])), tmp22 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp26 = tmp24 * tmp25
    tmp27 = -tmp26
    tmp28 = tl.full(tmp27.shape, 0.0, tmp27.dtype)
    tmp29 = tl.where(tmp22, tmp27, tmp28)
    tmp30 = tmp18 >= tmp21
    tmp31 = tl.full([1, 1], 128, tl.int64)
    tmp32 = tmp18 < tmp31
    tmp33 = tl.load(in_ptr0 + (128*x0 + ((-64) + r0_1)), tmp30 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp34 = tmp33 * tmp12
    tmp35 = tl.load(in_ptr1 + (tl.broadcast_to((-64) + r0_1, [XBLOCK, R0_BLOCK])), tmp30 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp36 = tmp34 * tmp35
    tmp37 = tl.full(tmp36.shape, 0.0, tmp36.dtype)
    tmp38 = tl.where(tmp30, tmp36, tmp37)
    tmp39 = tl.where(tmp22, tmp29, tmp38)
    tmp41 = tmp39 * tmp40
    tmp42 = tmp17 + tmp41
    tl.store(out_ptr1 + (x0), tmp12, xmask)
    tl.store(out_ptr2 + (r0_1 + 128*x0), tmp42, xmask)
''', device_str='cuda')


# kernel path: /tmp/kc/inductor/t5/ct5dvdpap4fzxe3x3e2v3na5udctialvb5bd6x4igv42wpxngqpf.py
# Topologically Sorted Source Nodes: [linear_1, view_1, pow_4, mean_2, add_2, rsqrt_2, mul_6, mul_7, transpose_1, chunk_default_1, mul_10, neg_1, cat_2, mul_11, add_4], Original ATen: [aten._unsafe_view, aten.view, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.transpose, aten.split, aten.neg, aten.cat]
# Source node to ATen node mapping:
#   add_2 => add_3
#   add_4 => add_5
#   cat_2 => cat_1
#   chunk_default_1 => split_1
#   linear_1 => view_5
#   mean_2 => mean_2
#   mul_10 => mul_11
#   mul_11 => mul_12
#   mul_6 => mul_7
#   mul_7 => mul_8
#   neg_1 => neg_1
#   pow_4 => pow_4
#   rsqrt_2 => rsqrt_2
#   transpose_1 => permute_4
#   view_1 => view_6
# Graph fragment:
#   %mm_1 : Tensor "bf16[256, 256][256, 1]cuda:0" = PlaceHolder[target=mm_1]
#   %buf15 : Tensor "f32[1, 256, 2, 1][512, 2, 1, 512]cuda:0" = PlaceHolder[target=buf15]
#   %rsqrt_2 : Tensor "bf16[1, 256, 2, 1][512, 2, 1, 1]cuda:0" = PlaceHolder[target=rsqrt_2]
#   %primals_9 : Tensor "bf16[128][1]cuda:0" = PlaceHolder[target=primals_9]
#   %materialize : Tensor "bf16[256, 128][128, 1]cuda:0" = PlaceHolder[target=materialize]
#   %materialize_1 : Tensor "bf16[256, 128][128, 1]cuda:0" = PlaceHolder[target=materialize_1]
#   %view_5 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_1, [1, 256, 256]), kwargs = {})
#   %view_6 : Tensor "bf16[1, 256, 2, 128][65536, 256, 128, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.reshape.default](args = (%view_5, [1, 256, 2, 128]), kwargs = {})
#   %pow_4 : Tensor "bf16[1, 256, 2, 128][65536, 256, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%view_6, 2), kwargs = {})
#   %mean_2 : Tensor "bf16[1, 256, 2, 1][512, 2, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_4, [-1], True), kwargs = {})
#   %add_3 : Tensor "bf16[1, 256, 2, 1][512, 2, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean_2, 1e-06), kwargs = {})
#   %rsqrt_2 : Tensor "bf16[1, 256, 2, 1][512, 2, 1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_3,), kwargs = {})
#   %mul_7 : Tensor "bf16[1, 256, 2, 128][65536, 256, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%view_6, %rsqrt_2), kwargs = {})
#   %mul_8 : Tensor "bf16[1, 256, 2, 128][65536, 256, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_7, %primals_9), kwargs = {})
#   %permute_4 : Tensor "bf16[1, 2, 256, 128][65536, 128, 256, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.permute.default](args = (%mul_8, [0, 2, 1, 3]), kwargs = {})
#   %split_1 : [num_users=2] = call_function[target=torch.ops.aten.split.Tensor](args = (%permute_4, 64, -1), kwargs = {})
#   %mul_11 : Tensor "bf16[1, 2, 256, 128][65536, 128, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%permute_4, %materialize), kwargs = {})
#   %neg_1 : Tensor "bf16[1, 2, 256, 64][32768, 64, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.neg.default](args = (%getitem_3,), kwargs = {})
#   %cat_1 : Tensor "bf16[1, 2, 256, 128][65536, 32768, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.cat.default](args = ([%neg_1, %getitem_2], -1), kwargs = {})
#   %mul_12 : Tensor "bf16[1, 2, 256, 128][65536, 32768, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%cat_1, %materialize_1), kwargs = {})
#   %add_5 : Tensor "bf16[1, 2, 256, 128][65536, 128, 256, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul_11, %mul_12), kwargs = {})
#   return %buf15,%rsqrt_2,%add_5
triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_4 = async_compile.triton('triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_4', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 512, 'r0_': 128},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'in_ptr3': '*bf16', 'out_ptr1': '*bf16', 'out_ptr2': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]], (7,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_4', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 8, 'num_store': 2, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 2048, 'r0_': 787200}}
)
@triton.jit
def triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_4(in_ptr0, in_ptr1, in_ptr2, in_ptr3, out_ptr1, out_ptr2, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 512
    r0_numel = 128
    R0_BLOCK: tl.constexpr = 128
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    x3 = xindex // 2
    tmp0 = tl.load(in_ptr0 + (r0_1 + 128*x0), xmask, other=0.0).to(tl.float32)
    tmp14 = tl.load(in_ptr1 + (r0_1), None, eviction_policy='evict_last').to(tl.float32)
    tmp16 = tl.load(in_ptr2 + (r0_1 + 128*x3), xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp40 = tl.load(in_ptr3 + (r0_1 + 128*x3), xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp1 = tmp0 * tmp0
    tmp2 = tmp1.to(tl.float32)
    tmp3 = tl.broadcast_to(tmp2, [XBLOCK, R0_BLOCK])
    tmp5 = tl.where(xmask, tmp3, 0)
    tmp6 = tl.sum(tmp5, 1)[:, None].to(tl.float32)
    tmp7 = tl.full([1, 1], 128.0, tl.float32)
    tmp8 = (tmp6 / tmp7)
    tmp9 = tmp8.to(tl.float32)
    tmp10 = tl.full([1, 1], 1e-06, tl.float32)
    tmp11 = tmp9 + tmp10
    tmp12 = libdevice.rsqrt(tmp11)
    tmp13 = tmp0 * tmp12
    tmp15 = tmp13 * tmp14
    tmp17 = tmp15 * tmp16
    tmp18 = r0_1
    tmp19 = tl.full([1, 1], 0, tl.int64)
    tmp20 = tmp18 >= tmp19
    tmp21 = tl.full([1, 1], 64, tl.int64)
    tmp22 = tmp18 < tmp21
    tmp23 = tl.load(in_ptr0 + (64 + 128*x0 + (r0_1)), tmp22 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp24 = tmp23 * tmp12
    tmp25 = tl.load(in_ptr1 + (tl.broadcast_to(64 + (r0_1), [XBLOCK, R0_BLOCK])), tmp22 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp26 = tmp24 * tmp25
    tmp27 = -tmp26
    tmp28 = tl.full(tmp27.shape, 0.0, tmp27.dtype)
    tmp29 = tl.where(tmp22, tmp27, tmp28)
    tmp30 = tmp18 >= tmp21
    tmp31 = tl.full([1, 1], 128, tl.int64)
    tmp32 = tmp18 < tmp31
    tmp33 = tl.load(in_ptr0 + (128*x0 + ((-64) + r0_1)), tmp30 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp34 = tmp33 * tmp12
    tmp35 = tl.load(in_ptr1 + (tl.broadcast_to((-64) + r0_1, [XBLOCK, R0_BLOCK])), tmp30 & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp36 = tmp34 * tmp35
    tmp37 = tl.full(tmp36.shape, 0.0, tmp36.dtype)
    tmp38 = tl.where(tmp30, tmp36, tmp37)
    tmp39 = tl.where(tmp22, tmp29, tmp38)
    tmp41 = tmp39 * tmp40
    tmp42 = tmp17 + tmp41
    tl.store(out_ptr1 + (x0), tmp12, xmask)
    tl.store(out_ptr2 + (r0_1 + 128*x0), tmp42, xmask)
''', device_str='cuda')

def partition_1(args):
    buf2, buf5, buf10, primals_8, buf11, primals_9 = args
    args.clear()
    assert_size_stride(primals_8, (128, ), (1, ))
    assert_size_stride(primals_9, (128, ), (1, ))
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf3 = buf2
        assert_size_stride(buf3, (256, 128), (128, 1), 'torch.ops.treecompile.materialize.default')
        assert_alignment(buf3, 16, 'torch.ops.treecompile.materialize.default')
        del buf2
        buf6 = buf5
        assert_size_stride(buf6, (256, 128), (128, 1), 'torch.ops.treecompile.materialize.default')
        assert_alignment(buf6, 16, 'torch.ops.treecompile.materialize.default')
        del buf5
        buf14 = empty_strided_cuda((1, 256, 4, 1), (1024, 4, 1, 1), torch.bfloat16)
        buf17 = empty_strided_cuda((1, 4, 256, 128), (131072, 128, 512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear, view, pow_3, mean_1, add_1, rsqrt_1, mul_4, mul_5, transpose, chunk_default, mul_8, neg, cat_1, mul_9, add_3], Original ATen: [aten._unsafe_view, aten.view, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.transpose, aten.split, aten.neg, aten.cat]
        stream0 = get_raw_stream(0)
        triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_3.run(buf10, primals_8, buf3, buf6, buf14, buf17, 1024, 128, stream=stream0)
        buf16 = empty_strided_cuda((1, 256, 2, 1), (512, 2, 1, 1), torch.bfloat16)
        buf18 = empty_strided_cuda((1, 2, 256, 128), (65536, 128, 256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_1, view_1, pow_4, mean_2, add_2, rsqrt_2, mul_6, mul_7, transpose_1, chunk_default_1, mul_10, neg_1, cat_2, mul_11, add_4], Original ATen: [aten._unsafe_view, aten.view, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.transpose, aten.split, aten.neg, aten.cat]
        stream0 = get_raw_stream(0)
        triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_4.run(buf11, primals_9, buf3, buf6, buf16, buf18, 512, 128, stream=stream0)
    return (buf3, buf6, buf14, buf17, buf16, buf18, buf10, primals_8, buf11, primals_9, )
from torch._C import _cuda_getCurrentRawStream as get_raw_stream



# kernel path: /tmp/kc/inductor/yf/cyfl4gxuvbobwxs2emxlrnvdnysru7iqfwdxjli3vrnif75lgzs2.py
# Topologically Sorted Source Nodes: [linear_3, add_5, pow_5, mean_3, add_6, rsqrt_3, mul_12, mul_13], Original ATen: [aten._unsafe_view, aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul]
# Source node to ATen node mapping:
#   add_5 => add_14
#   add_6 => add_15
#   linear_3 => view_12
#   mean_3 => mean_3
#   mul_12 => mul_17
#   mul_13 => mul_18
#   pow_5 => pow_5
#   rsqrt_3 => rsqrt_3
# Graph fragment:
#   %embedding : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=embedding]
#   %mm_3 : Tensor "bf16[256, 256][256, 1]cuda:0" = PlaceHolder[target=mm_3]
#   %buf26 : Tensor "f32[1, 256, 1][256, 1, 256]cuda:0" = PlaceHolder[target=buf26]
#   %rsqrt_3 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0" = PlaceHolder[target=rsqrt_3]
#   %primals_12 : Tensor "bf16[256][1]cuda:0" = PlaceHolder[target=primals_12]
#   %view_12 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_3, [1, 256, 256]), kwargs = {})
#   %add_14 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=3] = call_function[target=torch.ops.aten.add.Tensor](args = (%embedding, %view_12), kwargs = {})
#   %pow_5 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%add_14, 2), kwargs = {})
#   %mean_3 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_5, [-1], True), kwargs = {})
#   %add_15 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean_3, 1e-06), kwargs = {})
#   %rsqrt_3 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_15,), kwargs = {})
#   %mul_17 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%add_14, %rsqrt_3), kwargs = {})
#   %mul_18 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_17, %primals_12), kwargs = {})
#   return %buf26,%rsqrt_3,%mul_18
triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_5 = async_compile.triton('triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_5', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 256, 'r0_': 256},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'out_ptr1': '*bf16', 'out_ptr2': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_5', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 3, 'num_store': 2, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 1024, 'r0_': 524800}}
)
@triton.jit
def triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_5(in_ptr0, in_ptr1, in_ptr2, out_ptr1, out_ptr2, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 256
    r0_numel = 256
    R0_BLOCK: tl.constexpr = 256
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp1 = tl.load(in_ptr1 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp16 = tl.load(in_ptr2 + (r0_1), None, eviction_policy='evict_last').to(tl.float32)
    tmp2 = tmp0 + tmp1
    tmp3 = tmp2 * tmp2
    tmp4 = tmp3.to(tl.float32)
    tmp5 = tl.broadcast_to(tmp4, [XBLOCK, R0_BLOCK])
    tmp7 = tl.where(xmask, tmp5, 0)
    tmp8 = tl.sum(tmp7, 1)[:, None].to(tl.float32)
    tmp9 = tl.full([1, 1], 256.0, tl.float32)
    tmp10 = (tmp8 / tmp9)
    tmp11 = tmp10.to(tl.float32)
    tmp12 = tl.full([1, 1], 1e-06, tl.float32)
    tmp13 = tmp11 + tmp12
    tmp14 = libdevice.rsqrt(tmp13)
    tmp15 = tmp2 * tmp14
    tmp17 = tmp15 * tmp16
    tl.store(out_ptr1 + (x0), tmp14, xmask)
    tl.store(out_ptr2 + (r0_1 + 256*x0), tmp17, xmask)
''', device_str='cuda')


# kernel path: /tmp/kc/inductor/mu/cmucxwbcjmmgudllcdidmhieexgbwlqjly36rao5dv3a2zkzq656.py
# Topologically Sorted Source Nodes: [linear_4, silu, linear_5, mul_14], Original ATen: [aten._unsafe_view, aten.silu, aten.mul]
# Source node to ATen node mapping:
#   linear_4 => view_14
#   linear_5 => view_16
#   mul_14 => mul_19
#   silu => add_16, convert_element_type_14, convert_element_type_15, div_1, exp, neg_2
# Graph fragment:
#   %mm_4 : Tensor "bf16[256, 512][512, 1]cuda:0" = PlaceHolder[target=mm_4]
#   %mm_5 : Tensor "bf16[256, 512][512, 1]cuda:0" = PlaceHolder[target=mm_5]
#   %view_14 : Tensor "bf16[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_4, [1, 256, 512]), kwargs = {})
#   %convert_element_type_14 : Tensor "f32[1, 256, 512][131072, 512, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%view_14, torch.float32), kwargs = {})
#   %neg_2 : Tensor "f32[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.neg.default](args = (%convert_element_type_14,), kwargs = {})
#   %exp : Tensor "f32[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.exp.default](args = (%neg_2,), kwargs = {})
#   %add_16 : Tensor "f32[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%exp, 1), kwargs = {})
#   %div_1 : Tensor "f32[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.div.Tensor](args = (%convert_element_type_14, %add_16), kwargs = {})
#   %convert_element_type_15 : Tensor "bf16[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%div_1, torch.bfloat16), kwargs = {})
#   %view_16 : Tensor "bf16[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_5, [1, 256, 512]), kwargs = {})
#   %mul_19 : Tensor "bf16[1, 256, 512][131072, 512, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_15, %view_16), kwargs = {})
#   return %mul_19
triton_poi_fused__unsafe_view_mul_silu_6 = async_compile.triton('triton_poi_fused__unsafe_view_mul_silu_6', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 131072}, 
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'out_ptr0': '*bf16', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused__unsafe_view_mul_silu_6', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 2, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 1048576}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused__unsafe_view_mul_silu_6(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 131072
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = tl.full([XBLOCK], True, tl.int1)[:]
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), None).to(tl.float32)
    tmp8 = tl.load(in_ptr1 + (x0), None).to(tl.float32)
    tmp1 = tmp0.to(tl.float32)
    tmp2 = -tmp1
    tmp3 = libdevice.exp(tmp2)
    tmp4 = tl.full([1], 1.0, tl.float32)
    tmp5 = tmp3 + tmp4
    tmp6 = (tmp1 / tmp5)
    tmp7 = tmp6.to(tl.float32)
    tmp9 = tmp7 * tmp8
    tl.store(out_ptr0 + (x0), tmp9, None)
''', device_str='cuda')


# kernel path: /tmp/kc/inductor/qd/cqddxc6nhz4wbf7v6fvklzjq5xopzr3yj72zvrnkqbq6qkkmqyw2.py
# Topologically Sorted Source Nodes: [linear_3, add_5, linear_6, add_7, pow_6, mean_4, add_8, rsqrt_4, mul_15, mul_16], Original ATen: [aten._unsafe_view, aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul]
# Source node to ATen node mapping:
#   add_5 => add_14
#   add_7 => add_17
#   add_8 => add_18
#   linear_3 => view_12
#   linear_6 => view_18
#   mean_4 => mean_4
#   mul_15 => mul_20
#   mul_16 => mul_21
#   pow_6 => pow_6
#   rsqrt_4 => rsqrt_4
# Graph fragment:
#   %embedding : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=embedding]
#   %mm_3 : Tensor "bf16[256, 256][256, 1]cuda:0" = PlaceHolder[target=mm_3]
#   %mm_6 : Tensor "bf16[256, 256][256, 1]cuda:0" = PlaceHolder[target=mm_6]
#   %add_17 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=add_17]
#   %buf34 : Tensor "f32[1, 256, 1][256, 1, 256]cuda:0" = PlaceHolder[target=buf34]
#   %rsqrt_4 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0" = PlaceHolder[target=rsqrt_4]
#   %primals_16 : Tensor "bf16[256][1]cuda:0" = PlaceHolder[target=primals_16]
#   %view_12 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_3, [1, 256, 256]), kwargs = {})
#   %add_14 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=3] = call_function[target=torch.ops.aten.add.Tensor](args = (%embedding, %view_12), kwargs = {})
#   %view_18 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_6, [1, 256, 256]), kwargs = {})
#   %add_17 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=4] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_14, %view_18), kwargs = {})
#   %pow_6 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%add_17, 2), kwargs = {})
#   %mean_4 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_6, [-1], True), kwargs = {})
#   %add_18 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean_4, 1e-06), kwargs = {})
#   %rsqrt_4 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_18,), kwargs = {})
#   %mul_20 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%add_17, %rsqrt_4), kwargs = {})
#   %mul_21 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_20, %primals_16), kwargs = {})
#   return %add_17,%buf34,%rsqrt_4,%mul_21
triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_7 = async_compile.triton('triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_7', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 256, 'r0_': 256},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*bf16', 'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'out_ptr1': '*bf16', 'out_ptr2': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]], (7,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_7', 'mutated_arg_names': ['in_out_ptr0'], 'optimize_mem': False, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 4, 'num_store': 3, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 1024, 'r0_': 918016}}
)
@triton.jit
def triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_7(in_out_ptr0, in_ptr0, in_ptr1, in_ptr2, out_ptr1, out_ptr2, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 256
    r0_numel = 256
    R0_BLOCK: tl.constexpr = 256
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp1 = tl.load(in_ptr1 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp3 = tl.load(in_out_ptr0 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp18 = tl.load(in_ptr2 + (r0_1), None, eviction_policy='evict_last').to(tl.float32)
    tmp2 = tmp0 + tmp1
    tmp4 = tmp2 + tmp3
    tmp5 = tmp4 * tmp4
    tmp6 = tmp5.to(tl.float32)
    tmp7 = tl.broadcast_to(tmp6, [XBLOCK, R0_BLOCK])
    tmp9 = tl.where(xmask, tmp7, 0)
    tmp10 = tl.sum(tmp9, 1)[:, None].to(tl.float32)
    tmp11 = tl.full([1, 1], 256.0, tl.float32)
    tmp12 = (tmp10 / tmp11)
    tmp13 = tmp12.to(tl.float32)
    tmp14 = tl.full([1, 1], 1e-06, tl.float32)
    tmp15 = tmp13 + tmp14
    tmp16 = libdevice.rsqrt(tmp15)
    tmp17 = tmp4 * tmp16
    tmp19 = tmp17 * tmp18
    tl.store(in_out_ptr0 + (r0_1 + 256*x0), tmp4, xmask)
    tl.store(out_ptr1 + (x0), tmp16, xmask)
    tl.store(out_ptr2 + (r0_1 + 256*x0), tmp19, xmask)
''', device_str='cuda')

def partition_2(args):
    buf19, primals_11, buf0, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, buf3, buf6, primals_21, u0 = args
    args.clear()
    u0 = u0
    assert_size_stride(primals_11, (256, 512), (512, 1))
    assert_size_stride(primals_12, (256, ), (1, ))
    assert_size_stride(primals_13, (512, 256), (256, 1))
    assert_size_stride(primals_14, (512, 256), (256, 1))
    assert_size_stride(primals_15, (256, 512), (512, 1))
    assert_size_stride(primals_16, (256, ), (1, ))
    assert_size_stride(primals_17, (512, 256), (256, 1))
    assert_size_stride(primals_18, (256, 256), (256, 1))
    assert_size_stride(primals_19, (256, 256), (256, 1))
    assert_size_stride(primals_20, (128, ), (1, ))
    assert_size_stride(primals_21, (128, ), (1, ))
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf20 = buf19[0]
        assert_size_stride(buf20, (1, 4, 256, 128), (131072, 128, 512, 1), 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        assert_alignment(buf20, 16, 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        buf21 = buf19[1]
        assert_size_stride(buf21, (4, 256), (256, 1), 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        assert_alignment(buf21, 16, 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        buf22 = buf19[2]
        assert_size_stride(buf22, (u0, 2, 128), (256, 128, 1), 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        assert_alignment(buf22, 16, 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        buf23 = buf19[3]
        assert_size_stride(buf23, (u0, 2, 128), (256, 128, 1), 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        assert_alignment(buf23, 16, 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        buf25 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [transpose_3, reshape, linear_3], Original ATen: [aten.transpose, aten.view, aten.t, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf20, (256, 512), (512, 1), 0), reinterpret_tensor(primals_11, (512, 256), (1, 512), 0), out=buf25)
        buf27 = empty_strided_cuda((1, 256, 1), (256, 1, 1), torch.bfloat16)
        buf28 = empty_strided_cuda((1, 256, 256), (65536, 256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_3, add_5, pow_5, mean_3, add_6, rsqrt_3, mul_12, mul_13], Original ATen: [aten._unsafe_view, aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul]
        stream0 = get_raw_stream(0)
        triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_5.run(buf0, buf25, primals_12, buf27, buf28, 256, 256, stream=stream0)
        buf29 = empty_strided_cuda((256, 512), (512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_3, add_5, mul_12, mul_13, linear_4], Original ATen: [aten._unsafe_view, aten.add, aten.mul, aten.t, aten.view, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf28, (256, 256), (256, 1), 0), reinterpret_tensor(primals_13, (256, 512), (1, 256), 0), out=buf29)
        buf30 = empty_strided_cuda((256, 512), (512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_3, add_5, mul_12, mul_13, linear_4, linear_5], Original ATen: [aten._unsafe_view, aten.add, aten.mul, aten.view, aten.t, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf28, (256, 256), (256, 1), 0), reinterpret_tensor(primals_14, (256, 512), (1, 256), 0), out=buf30)
        buf31 = empty_strided_cuda((1, 256, 512), (131072, 512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_4, silu, linear_5, mul_14], Original ATen: [aten._unsafe_view, aten.silu, aten.mul]
        stream0 = get_raw_stream(0)
        triton_poi_fused__unsafe_view_mul_silu_6.run(buf29, buf30, buf31, 131072, stream=stream0)
        buf32 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_4, silu, linear_5, mul_14, linear_6], Original ATen: [aten._unsafe_view, aten.silu, aten.mul, aten.t, aten.view, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf31, (256, 512), (512, 1), 0), reinterpret_tensor(primals_15, (512, 256), (1, 512), 0), out=buf32)
        buf33 = reinterpret_tensor(buf32, (1, 256, 256), (65536, 256, 1), 0); del buf32  # reuse
        buf35 = empty_strided_cuda((1, 256, 1), (256, 1, 1), torch.bfloat16)
        buf36 = empty_strided_cuda((1, 256, 256), (65536, 256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_3, add_5, linear_6, add_7, pow_6, mean_4, add_8, rsqrt_4, mul_15, mul_16], Original ATen: [aten._unsafe_view, aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul]
        stream0 = get_raw_stream(0)
        triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_7.run(buf33, buf0, buf25, primals_16, buf35, buf36, 256, 256, stream=stream0)
        buf37 = empty_strided_cuda((256, 512), (512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_15, mul_16, linear_7], Original ATen: [aten.mul, aten.t, aten.view, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf36, (256, 256), (256, 1), 0), reinterpret_tensor(primals_17, (256, 512), (1, 256), 0), out=buf37)
        buf38 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_15, mul_16, linear_7, linear_8], Original ATen: [aten.mul, aten.view, aten.t, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf36, (256, 256), (256, 1), 0), reinterpret_tensor(primals_18, (256, 256), (1, 256), 0), out=buf38)
        buf39 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_15, mul_16, linear_7, linear_9], Original ATen: [aten.mul, aten.view, aten.t, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf36, (256, 256), (256, 1), 0), reinterpret_tensor(primals_19, (256, 256), (1, 256), 0), out=buf39)
        buf41 = empty_strided_cuda((1, 256, 4, 1), (1024, 4, 1, 1), torch.bfloat16)
        buf44 = empty_strided_cuda((1, 4, 256, 128), (131072, 128, 512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_7, view_3, pow_7, mean_5, add_9, rsqrt_5, mul_17, mul_18, transpose_4, chunk_default_2, mul_21, neg_2, cat_3, mul_22, add_11], Original ATen: [aten._unsafe_view, aten.view, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.transpose, aten.split, aten.neg, aten.cat]
        stream0 = get_raw_stream(0)
        triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_3.run(buf37, primals_20, buf3, buf6, buf41, buf44, 1024, 128, stream=stream0)
        buf43 = empty_strided_cuda((1, 256, 2, 1), (512, 2, 1, 1), torch.bfloat16)
        buf45 = empty_strided_cuda((1, 2, 256, 128), (65536, 128, 256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_8, view_4, pow_8, mean_6, add_10, rsqrt_6, mul_19, mul_20, transpose_5, chunk_default_3, mul_23, neg_3, cat_4, mul_24, add_12], Original ATen: [aten._unsafe_view, aten.view, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.transpose, aten.split, aten.neg, aten.cat]
        stream0 = get_raw_stream(0)
        triton_per_fused__unsafe_view_add_cat_mean_mul_neg_pow_rsqrt_split_transpose_view_4.run(buf38, primals_21, buf3, buf6, buf43, buf45, 512, 128, stream=stream0)
    return (buf20, buf21, buf22, buf23, buf25, buf27, buf28, buf29, buf30, buf31, buf33, buf35, buf36, buf37, buf38, buf39, buf41, buf44, buf43, buf45, buf19, primals_11, buf0, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, buf3, buf6, primals_21, )
from torch._C import _cuda_getCurrentRawStream as get_raw_stream



# kernel path: /tmp/kc/inductor/4n/c4nqu6dgnmzucxpufim45nt66voxbb7v7cbr2ablp4r3drfxdqlw.py
# Topologically Sorted Source Nodes: [linear_10, add_13, pow_9, mean_7, add_14, rsqrt_7, mul_25, mul_26], Original ATen: [aten._unsafe_view, aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul]
# Source node to ATen node mapping:
#   add_13 => add_31
#   add_14 => add_32
#   linear_10 => view_30
#   mean_7 => mean_7
#   mul_25 => mul_34
#   mul_26 => mul_35
#   pow_9 => pow_9
#   rsqrt_7 => rsqrt_7
# Graph fragment:
#   %add_17 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=add_17]
#   %mm_10 : Tensor "bf16[256, 256][256, 1]cuda:0" = PlaceHolder[target=mm_10]
#   %add_31 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=add_31]
#   %buf54 : Tensor "f32[1, 256, 1][256, 1, 256]cuda:0" = PlaceHolder[target=buf54]
#   %rsqrt_7 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0" = PlaceHolder[target=rsqrt_7]
#   %primals_23 : Tensor "bf16[256][1]cuda:0" = PlaceHolder[target=primals_23]
#   %view_30 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_10, [1, 256, 256]), kwargs = {})
#   %add_31 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=4] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_17, %view_30), kwargs = {})
#   %pow_9 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%add_31, 2), kwargs = {})
#   %mean_7 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_9, [-1], True), kwargs = {})
#   %add_32 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean_7, 1e-06), kwargs = {})
#   %rsqrt_7 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_32,), kwargs = {})
#   %mul_34 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%add_31, %rsqrt_7), kwargs = {})
#   %mul_35 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_34, %primals_23), kwargs = {})
#   return %add_31,%buf54,%rsqrt_7,%mul_35
triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_8 = async_compile.triton('triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_8', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 256, 'r0_': 256},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*bf16', 'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'out_ptr1': '*bf16', 'out_ptr2': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_8', 'mutated_arg_names': ['in_out_ptr0'], 'optimize_mem': False, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 3, 'num_store': 3, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 1024, 'r0_': 786944}}
)
@triton.jit
def triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_8(in_out_ptr0, in_ptr0, in_ptr1, out_ptr1, out_ptr2, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 256
    r0_numel = 256
    R0_BLOCK: tl.constexpr = 256
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp1 = tl.load(in_out_ptr0 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp16 = tl.load(in_ptr1 + (r0_1), None, eviction_policy='evict_last').to(tl.float32)
    tmp2 = tmp0 + tmp1
    tmp3 = tmp2 * tmp2
    tmp4 = tmp3.to(tl.float32)
    tmp5 = tl.broadcast_to(tmp4, [XBLOCK, R0_BLOCK])
    tmp7 = tl.where(xmask, tmp5, 0)
    tmp8 = tl.sum(tmp7, 1)[:, None].to(tl.float32)
    tmp9 = tl.full([1, 1], 256.0, tl.float32)
    tmp10 = (tmp8 / tmp9)
    tmp11 = tmp10.to(tl.float32)
    tmp12 = tl.full([1, 1], 1e-06, tl.float32)
    tmp13 = tmp11 + tmp12
    tmp14 = libdevice.rsqrt(tmp13)
    tmp15 = tmp2 * tmp14
    tmp17 = tmp15 * tmp16
    tl.store(in_out_ptr0 + (r0_1 + 256*x0), tmp2, xmask)
    tl.store(out_ptr1 + (x0), tmp14, xmask)
    tl.store(out_ptr2 + (r0_1 + 256*x0), tmp17, xmask)
''', device_str='cuda')


# kernel path: /tmp/kc/inductor/7q/c7q6vofbx6mw7kpp2eopjxx7w4u4rn4sakttmtgbmpc42lqs6nei.py
# Topologically Sorted Source Nodes: [linear_13, add_15, pow_10, mean_8, add_16, rsqrt_8], Original ATen: [aten._unsafe_view, aten.add, aten.pow, aten.mean, aten.rsqrt]
# Source node to ATen node mapping:
#   add_15 => add_34
#   add_16 => add_35
#   linear_13 => view_36
#   mean_8 => mean_8
#   pow_10 => pow_10
#   rsqrt_8 => rsqrt_8
# Graph fragment:
#   %add_31 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=add_31]
#   %mm_13 : Tensor "bf16[256, 256][256, 1]cuda:0" = PlaceHolder[target=mm_13]
#   %add_34 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=add_34]
#   %buf62 : Tensor "f32[1, 256, 1][256, 1, 256]cuda:0" = PlaceHolder[target=buf62]
#   %view_36 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_13, [1, 256, 256]), kwargs = {})
#   %add_34 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=3] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_31, %view_36), kwargs = {})
#   %pow_10 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%add_34, 2), kwargs = {})
#   %mean_8 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_10, [-1], True), kwargs = {})
#   %add_35 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean_8, 1e-06), kwargs = {})
#   %rsqrt_8 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_35,), kwargs = {})
#   return %add_34,%buf62,%rsqrt_8
triton_per_fused__unsafe_view_add_mean_pow_rsqrt_9 = async_compile.triton('triton_per_fused__unsafe_view_add_mean_pow_rsqrt_9', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 256, 'r0_': 256},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*bf16', 'in_ptr0': '*bf16', 'out_ptr1': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused__unsafe_view_add_mean_pow_rsqrt_9', 'mutated_arg_names': ['in_out_ptr0'], 'optimize_mem': False, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 2, 'num_store': 2, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 1024, 'r0_': 524288}}
)
@triton.jit
def triton_per_fused__unsafe_view_add_mean_pow_rsqrt_9(in_out_ptr0, in_ptr0, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 256
    r0_numel = 256
    R0_BLOCK: tl.constexpr = 256
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp1 = tl.load(in_out_ptr0 + (r0_1 + 256*x0), xmask, other=0.0).to(tl.float32)
    tmp2 = tmp0 + tmp1
    tmp3 = tmp2 * tmp2
    tmp4 = tmp3.to(tl.float32)
    tmp5 = tl.broadcast_to(tmp4, [XBLOCK, R0_BLOCK])
    tmp7 = tl.where(xmask, tmp5, 0)
    tmp8 = tl.sum(tmp7, 1)[:, None].to(tl.float32)
    tmp9 = tl.full([1, 1], 256.0, tl.float32)
    tmp10 = (tmp8 / tmp9)
    tmp11 = tmp10.to(tl.float32)
    tmp12 = tl.full([1, 1], 1e-06, tl.float32)
    tmp13 = tmp11 + tmp12
    tmp14 = libdevice.rsqrt(tmp13)
    tl.store(in_out_ptr0 + (r0_1 + 256*x0), tmp2, xmask)
    tl.store(out_ptr1 + (x0), tmp14, xmask)
''', device_str='cuda')


# kernel path: /tmp/kc/inductor/id/cidmm7fupuhkgsinp57p63hwrtjiyptrmtsnt5d5njdl4l5dj5qb.py
# Topologically Sorted Source Nodes: [mul_28, mul_29, select_int_1, index_select_default], Original ATen: [aten.mul, aten.select, aten.index_select]
# Source node to ATen node mapping:
#   index_select_default => index
#   mul_28 => mul_37
#   mul_29 => mul_38
#   select_int_1 => select_1
# Graph fragment:
#   %clamp_min : Tensor "i64[256][1]cuda:0" = PlaceHolder[target=clamp_min]
#   %add_34 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0" = PlaceHolder[target=add_34]
#   %rsqrt_8 : Tensor "bf16[1, 256, 1][256, 1, 1]cuda:0" = PlaceHolder[target=rsqrt_8]
#   %primals_27 : Tensor "bf16[256][1]cuda:0" = PlaceHolder[target=primals_27]
#   %mul_37 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%add_34, %rsqrt_8), kwargs = {})
#   %mul_38 : Tensor "bf16[1, 256, 256][65536, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_37, %primals_27), kwargs = {})
#   %select_1 : Tensor "bf16[256, 256][256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.select.int](args = (%mul_38, 0, 0), kwargs = {})
#   %index : Tensor "bf16[256, 256][256, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.index.Tensor](args = (%select_1, [%clamp_min]), kwargs = {})
#   return %index
triton_poi_fused_index_select_mul_select_10 = async_compile.triton('triton_poi_fused_index_select_mul_select_10', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'y': 256, 'x': 256}, tile_hint=TileHint.DEFAULT,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*i64', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'in_ptr3': '*bf16', 'out_ptr0': '*bf16', 'ynumel': 'i32', 'xnumel': 'i32', 'YBLOCK': 'constexpr', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid2D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused_index_select_mul_select_10', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 2, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'y': 2048, 'x': 262656}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_index_select_mul_select_10(in_ptr0, in_ptr1, in_ptr2, in_ptr3, out_ptr0, ynumel, xnumel, YBLOCK : tl.constexpr, XBLOCK : tl.constexpr):
    ynumel = 256
    xnumel = 256
    yoffset = tl.program_id(1) * YBLOCK
    yindex = yoffset + tl.arange(0, YBLOCK)[:, None]
    ymask = yindex < ynumel
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[None, :]
    xmask = xindex < xnumel
    y0 = yindex
    x1 = xindex
    tmp0 = tl.load(in_ptr0 + (y0), ymask, eviction_policy='evict_last')
    tmp9 = tl.load(in_ptr3 + (x1), xmask, eviction_policy='evict_last').to(tl.float32)
    tmp1 = tl.full([1, 1], 256, tl.int32)
    tmp2 = tmp0 + tmp1
    tmp3 = tmp0 < 0
    tmp4 = tl.where(tmp3, tmp2, tmp0)
    tl.device_assert(((0 <= tmp4) & (tmp4 < 256)) | ~(ymask), "index out of bounds: 0 <= tmp4 < 256")
    tmp6 = tl.load(in_ptr1 + (x1 + 256*tmp4), xmask & ymask).to(tl.float32)
    tmp7 = tl.load(in_ptr2 + (tmp4), ymask, eviction_policy='evict_last').to(tl.float32)
    tmp8 = tmp6 * tmp7
    tmp10 = tmp8 * tmp9
    tl.store(out_ptr0 + (x1 + 256*y0), tmp10, xmask & ymask)
''', device_str='cuda')

def partition_3(args):
    buf46, primals_22, buf33, primals_23, primals_24, primals_25, primals_26, buf64, primals_27, u1 = args
    args.clear()
    u1 = u1
    assert_size_stride(primals_22, (256, 512), (512, 1))
    assert_size_stride(primals_23, (256, ), (1, ))
    assert_size_stride(primals_24, (512, 256), (256, 1))
    assert_size_stride(primals_25, (512, 256), (256, 1))
    assert_size_stride(primals_26, (256, 512), (512, 1))
    assert_size_stride(primals_27, (256, ), (1, ))
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf47 = buf46[0]
        assert_size_stride(buf47, (1, 4, 256, 128), (131072, 128, 512, 1), 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        assert_alignment(buf47, 16, 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        buf48 = buf46[1]
        assert_size_stride(buf48, (4, 256), (256, 1), 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        assert_alignment(buf48, 16, 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        buf49 = buf46[2]
        assert_size_stride(buf49, (u1, 2, 128), (256, 128, 1), 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        assert_alignment(buf49, 16, 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        buf50 = buf46[3]
        assert_size_stride(buf50, (u1, 2, 128), (256, 128, 1), 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        assert_alignment(buf50, 16, 'torch.ops.treecompile.tree_attention_varlen_fwd.default')
        buf52 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [transpose_7, reshape_1, linear_10], Original ATen: [aten.transpose, aten.view, aten.t, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf47, (256, 512), (512, 1), 0), reinterpret_tensor(primals_22, (512, 256), (1, 512), 0), out=buf52)
        buf53 = reinterpret_tensor(buf52, (1, 256, 256), (65536, 256, 1), 0); del buf52  # reuse
        buf55 = empty_strided_cuda((1, 256, 1), (256, 1, 1), torch.bfloat16)
        buf56 = empty_strided_cuda((1, 256, 256), (65536, 256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_10, add_13, pow_9, mean_7, add_14, rsqrt_7, mul_25, mul_26], Original ATen: [aten._unsafe_view, aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul]
        stream0 = get_raw_stream(0)
        triton_per_fused__unsafe_view_add_mean_mul_pow_rsqrt_8.run(buf53, buf33, primals_23, buf55, buf56, 256, 256, stream=stream0)
        buf57 = empty_strided_cuda((256, 512), (512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_25, mul_26, linear_11], Original ATen: [aten.mul, aten.t, aten.view, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf56, (256, 256), (256, 1), 0), reinterpret_tensor(primals_24, (256, 512), (1, 256), 0), out=buf57)
        buf58 = empty_strided_cuda((256, 512), (512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_25, mul_26, linear_11, linear_12], Original ATen: [aten.mul, aten.view, aten.t, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf56, (256, 256), (256, 1), 0), reinterpret_tensor(primals_25, (256, 512), (1, 256), 0), out=buf58)
        buf59 = empty_strided_cuda((1, 256, 512), (131072, 512, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_11, silu_1, linear_12, mul_27], Original ATen: [aten._unsafe_view, aten.silu, aten.mul]
        stream0 = get_raw_stream(0)
        triton_poi_fused__unsafe_view_mul_silu_6.run(buf57, buf58, buf59, 131072, stream=stream0)
        buf60 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_11, silu_1, linear_12, mul_27, linear_13], Original ATen: [aten._unsafe_view, aten.silu, aten.mul, aten.t, aten.view, aten.mm]
        extern_kernels.mm(reinterpret_tensor(buf59, (256, 512), (512, 1), 0), reinterpret_tensor(primals_26, (512, 256), (1, 512), 0), out=buf60)
        buf61 = reinterpret_tensor(buf60, (1, 256, 256), (65536, 256, 1), 0); del buf60  # reuse
        buf63 = empty_strided_cuda((1, 256, 1), (256, 1, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [linear_13, add_15, pow_10, mean_8, add_16, rsqrt_8], Original ATen: [aten._unsafe_view, aten.add, aten.pow, aten.mean, aten.rsqrt]
        stream0 = get_raw_stream(0)
        triton_per_fused__unsafe_view_add_mean_pow_rsqrt_9.run(buf61, buf53, buf63, 256, 256, stream=stream0)
        buf65 = empty_strided_cuda((256, 256), (256, 1), torch.bfloat16)
        # Topologically Sorted Source Nodes: [mul_28, mul_29, select_int_1, index_select_default], Original ATen: [aten.mul, aten.select, aten.index_select]
        stream0 = get_raw_stream(0)
        triton_poi_fused_index_select_mul_select_10.run(buf64, buf61, buf63, primals_27, buf65, 256, 256, stream=stream0)
    return (buf47, buf48, buf49, buf50, buf53, buf55, buf56, buf57, buf58, buf59, buf61, buf63, buf65, buf46, primals_22, buf33, primals_23, primals_24, primals_25, primals_26, buf64, primals_27, )
from torch._C import _cuda_getCurrentRawStream as get_raw_stream



# kernel path: /tmp/kc/inductor/qf/cqfkdhug6pcwoloagvc267lj2c7efctcwhi7wsv5bzozjpzn5rvs.py
# Topologically Sorted Source Nodes: [where_scalar_other, _to_copy_default, mul_tensor_31, sum_default, neg_default_5], Original ATen: [aten.scalar_tensor, aten.where, aten._to_copy, aten.mul, aten.sum, aten.neg]
# Source node to ATen node mapping:
#   _to_copy_default => convert_element_type_36
#   mul_tensor_31 => mul_41
#   neg_default_5 => neg_6
#   sum_default => sum_1
#   where_scalar_other => full_default, where
# Graph fragment:
#   %ge_3 : Tensor "b8[256][1]cuda:0" = PlaceHolder[target=ge_3]
#   %getitem_16 : Tensor "f32[256][1]cuda:0" = PlaceHolder[target=getitem_16]
#   %primals_29 : Tensor "f64[256][1]cuda:0" = PlaceHolder[target=primals_29]
#   %where : Tensor "f32[256][1]cuda:0" = PlaceHolder[target=where]
#   %convert_element_type_36 : Tensor "f32[256][1]cuda:0" = PlaceHolder[target=convert_element_type_36]
#   %sum_1 : Tensor "f32[][]cuda:0" = PlaceHolder[target=sum_1]
#   %full_default : Tensor "f32[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.full.default](args = ([], 0.0), kwargs = {dtype: torch.float32, layout: torch.strided, device: cuda:0, pin_memory: False})
#   %where : Tensor "f32[256][1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.where.self](args = (%ge_3, %getitem_16, %full_default), kwargs = {})
#   %convert_element_type_36 : Tensor "f32[256][1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%primals_29, torch.float32), kwargs = {})
#   %mul_41 : Tensor "f32[256][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%where, %convert_element_type_36), kwargs = {})
#   %sum_1 : Tensor "f32[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sum.default](args = (%mul_41,), kwargs = {})
#   %neg_6 : Tensor "f32[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.neg.default](args = (%sum_1,), kwargs = {})
#   return %where,%convert_element_type_36,%sum_1,%neg_6
triton_per_fused__to_copy_mul_neg_scalar_tensor_sum_where_11 = async_compile.triton('triton_per_fused__to_copy_mul_neg_scalar_tensor_sum_where_11', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 1, 'r0_': 256},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*fp32', 'in_out_ptr1': '*fp32', 'in_ptr0': '*i1', 'in_ptr1': '*fp64', 'out_ptr0': '*fp32', 'xnumel': 'constexpr', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {'xnumel': 1}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused__to_copy_mul_neg_scalar_tensor_sum_where_11', 'mutated_arg_names': ['in_out_ptr0', 'in_out_ptr1'], 'optimize_mem': False, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 3, 'num_store': 3, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'r0_': 7424}}
)
@triton.jit
def triton_per_fused__to_copy_mul_neg_scalar_tensor_sum_where_11(in_out_ptr0, in_out_ptr1, in_ptr0, in_ptr1, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 1
    r0_numel = 256
    R0_BLOCK: tl.constexpr = 256
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = tl.full([XBLOCK], True, tl.int1)[:, None]
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    r0_0 = r0_index
    tmp0 = tl.load(in_ptr0 + (r0_0), None).to(tl.int1)
    tmp1 = tl.load(in_out_ptr0 + (r0_0), None)
    tmp4 = tl.load(in_ptr1 + (r0_0), None)
    tmp2 = tl.full([1, 1], 0.0, tl.float32)
    tmp3 = tl.where(tmp0, tmp1, tmp2)
    tmp5 = tmp4.to(tl.float32)
    tmp6 = tmp3 * tmp5
    tmp7 = tl.broadcast_to(tmp6, [XBLOCK, R0_BLOCK])
    tmp9 = tl.sum(tmp7, 1)[:, None].to(tl.float32)
    tmp10 = -tmp9
    tl.store(in_out_ptr0 + (tl.broadcast_to(r0_0, [XBLOCK, R0_BLOCK])), tmp3, None)
    tl.store(out_ptr0 + (tl.broadcast_to(r0_0, [XBLOCK, R0_BLOCK])), tmp5, None)
    tl.debug_barrier()
    tl.store(in_out_ptr1 + (tl.full([1, 1], 0, tl.int32).broadcast_to(XBLOCK, 1)), tmp10, None)
''', device_str='cuda')

def partition_4(args):
    buf66, buf72, primals_29, u2 = args
    args.clear()
    u2 = u2
    assert_size_stride(primals_29, (256, ), (1, ))
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf67 = buf66[0]
        assert_size_stride(buf67, (256, ), (1, ), 'torch.ops.treecompile.linear_logprobs_kept.default')
        assert_alignment(buf67, 16, 'torch.ops.treecompile.linear_logprobs_kept.default')
        buf68 = buf66[1]
        assert_size_stride(buf68, (256, ), (1, ), 'torch.ops.treecompile.linear_logprobs_kept.default')
        assert_alignment(buf68, 16, 'torch.ops.treecompile.linear_logprobs_kept.default')
        buf69 = buf66[2]
        assert_alignment(buf69, 16, 'torch.ops.treecompile.linear_logprobs_kept.default')
        buf70 = buf66[3]
        assert_size_stride(buf70, (u2, 512), (512, 1), 'torch.ops.treecompile.linear_logprobs_kept.default')
        assert_alignment(buf70, 16, 'torch.ops.treecompile.linear_logprobs_kept.default')
        buf73 = buf67; del buf67  # reuse
        buf74 = empty_strided_cuda((256, ), (1, ), torch.float32)
        buf75 = empty_strided_cuda((), (), torch.float32)
        buf76 = buf75; del buf75  # reuse
        # Topologically Sorted Source Nodes: [where_scalar_other, _to_copy_default, mul_tensor_31, sum_default, neg_default_5], Original ATen: [aten.scalar_tensor, aten.where, aten._to_copy, aten.mul, aten.sum, aten.neg]
        stream0 = get_raw_stream(0)
        triton_per_fused__to_copy_mul_neg_scalar_tensor_sum_where_11.run(buf73, buf76, buf72, primals_29, buf74, 1, 256, stream=stream0)
        del primals_29
    return (buf68, buf69, buf70, buf73, buf74, buf76, buf66, buf72, )


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        primals_1, primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26, primals_27, primals_28, primals_29 = args
        args.clear()
        partition0_args = [primals_1, primals_2, primals_4, primals_3, primals_5, primals_6, primals_7, primals_28]
        del primals_3, primals_28
        (buf0, buf8, buf9, buf1, buf4, buf10, buf11, buf12, buf64, buf72, primals_1, primals_2, primals_4, primals_5, primals_6, primals_7) = self.partitions[0](partition0_args)
        del partition0_args
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            # Topologically Sorted Source Nodes: [arange, div, pow_1, reciprocal, mul, unsqueeze, to, unsqueeze_1, mul_1, cat, cos, to_1, materialize_default], Original ATen: [aten.arange, aten.div, aten.pow, aten.reciprocal, aten.mul, aten.unsqueeze, aten._to_copy, aten.cat, aten.cos, treecompile.materialize]
            buf2 = torch.ops.treecompile.materialize.default(buf1)
            del buf1
            # Topologically Sorted Source Nodes: [arange, div, pow_1, reciprocal, mul, unsqueeze, to, unsqueeze_1, mul_1, cat, sin, to_2, materialize_default_1], Original ATen: [aten.arange, aten.div, aten.pow, aten.reciprocal, aten.mul, aten.unsqueeze, aten._to_copy, aten.cat, aten.sin, treecompile.materialize]
            buf5 = torch.ops.treecompile.materialize.default(buf4)
            del buf4
        partition1_args = [buf2, buf5, buf10, primals_8, buf11, primals_9]
        del buf2, buf5
        (buf3, buf6, buf14, buf17, buf16, buf18, buf10, primals_8, buf11, primals_9) = self.partitions[1](partition1_args)
        del partition1_args
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            # Topologically Sorted Source Nodes: [linear_2, view_2, transpose_2, tree_attention_varlen_fwd], Original ATen: [aten._unsafe_view, aten.view, aten.transpose, treecompile.tree_attention_varlen_fwd]
            buf19 = torch.ops.treecompile.tree_attention_varlen_fwd.default(buf17, buf18, reinterpret_tensor(buf12, (1, 2, 256, 128), (65536, 128, 256, 1), 0), primals_10, 0.08838834764831843, 'fit', 0, 2, 1024)
            u0 = buf19[2].size(0)
        partition2_args = [buf19, primals_11, buf0, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, buf3, buf6, primals_21, u0]
        (buf20, buf21, buf22, buf23, buf25, buf27, buf28, buf29, buf30, buf31, buf33, buf35, buf36, buf37, buf38, buf39, buf41, buf44, buf43, buf45, buf19, primals_11, buf0, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, buf3, buf6, primals_21) = self.partitions[2](partition2_args)
        del partition2_args
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            # Topologically Sorted Source Nodes: [linear_9, view_5, transpose_6, tree_attention_varlen_fwd_1], Original ATen: [aten._unsafe_view, aten.view, aten.transpose, treecompile.tree_attention_varlen_fwd]
            buf46 = torch.ops.treecompile.tree_attention_varlen_fwd.default(buf44, buf45, reinterpret_tensor(buf39, (1, 2, 256, 128), (65536, 128, 256, 1), 0), primals_10, 0.08838834764831843, 'fit', 1, 2, 1024)
            u1 = buf46[2].size(0)
        partition3_args = [buf46, primals_22, buf33, primals_23, primals_24, primals_25, primals_26, buf64, primals_27, u1]
        (buf47, buf48, buf49, buf50, buf53, buf55, buf56, buf57, buf58, buf59, buf61, buf63, buf65, buf46, primals_22, buf33, primals_23, primals_24, primals_25, primals_26, buf64, primals_27) = self.partitions[3](partition3_args)
        del partition3_args
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            # Topologically Sorted Source Nodes: [select_int, linear_logprobs_kept], Original ATen: [aten.select, treecompile.linear_logprobs_kept]
            buf66 = torch.ops.treecompile.linear_logprobs_kept.default(buf65, primals_2, None, reinterpret_tensor(primals_1, (256, ), (1, ), 0), False, 'fit')
            u2 = buf66[3].size(0)
        partition4_args = [buf66, buf72, primals_29, u2]
        del primals_29
        (buf68, buf69, buf70, buf73, buf74, buf76, buf66, buf72) = self.partitions[4](partition4_args)
        del partition4_args
        if not (u0 >= 0):
            raise RuntimeError('u0 >= 0')
        buf24 = None
        if not (u1 >= 0):
            raise RuntimeError('u1 >= 0')
        buf51 = None
        if not (u2 >= 0):
            raise RuntimeError('u2 >= 0')
        buf71 = None
        return (buf76, buf73, primals_1, primals_2, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26, primals_27, buf0, buf3, buf6, buf8, reinterpret_tensor(buf9, (256, 256), (256, 1), 0), buf10, buf11, buf14, buf16, reinterpret_tensor(buf12, (1, 2, 256, 128), (65536, 128, 256, 1), 0), buf17, buf18, buf20, buf21, buf22, buf23, buf25, buf27, reinterpret_tensor(buf28, (256, 256), (256, 1), 0), buf29, buf30, reinterpret_tensor(buf31, (256, 512), (512, 1), 0), buf33, buf35, reinterpret_tensor(buf36, (256, 256), (256, 1), 0), buf37, buf38, buf41, buf43, reinterpret_tensor(buf39, (1, 2, 256, 128), (65536, 128, 256, 1), 0), buf44, buf45, buf47, buf48, buf49, buf50, buf53, buf55, reinterpret_tensor(buf56, (256, 256), (256, 1), 0), buf57, buf58, reinterpret_tensor(buf59, (256, 512), (512, 1), 0), buf61, buf63, buf64, buf65, buf68, buf69, buf70, buf72, buf74, u0, u1, u2, )

runner = Runner(partitions=[partition_0, partition_1, partition_2, partition_3, partition_4])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((1, 256), (256, 1), device='cuda:0', dtype=torch.int64)
    primals_2 = rand_strided((512, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_3 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.int64)
    primals_4 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_5 = rand_strided((512, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_6 = rand_strided((256, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_7 = rand_strided((256, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_8 = rand_strided((128, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_9 = rand_strided((128, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_10 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.int64)
    primals_11 = rand_strided((256, 512), (512, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_12 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_13 = rand_strided((512, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_14 = rand_strided((512, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_15 = rand_strided((256, 512), (512, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_16 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_17 = rand_strided((512, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_18 = rand_strided((256, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_19 = rand_strided((256, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_20 = rand_strided((128, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_21 = rand_strided((128, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_22 = rand_strided((256, 512), (512, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_23 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_24 = rand_strided((512, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_25 = rand_strided((512, 256), (256, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_26 = rand_strided((256, 512), (512, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_27 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_28 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.int64)
    primals_29 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.float64)
    return [primals_1, primals_2, primals_3, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, primals_13, primals_14, primals_15, primals_16, primals_17, primals_18, primals_19, primals_20, primals_21, primals_22, primals_23, primals_24, primals_25, primals_26, primals_27, primals_28, primals_29]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
