"""The ``int8_sage`` attention kernel for Hopper written in Gluon (Triton's explicit-layout language): the same
math, and on the same inputs the same output bits, as :mod:`.int8_kernels`' ``_attn_fwd_kernel`` in its prequantized
Hopper configuration (``QPRE``, ``Q_ROW``, ``TMA``, ``MAGIC``, ``PV_FP8``, ``ROWSUM_MMA``), with the wgmma issued and
waited for explicitly.

Per program: BLOCK_M query rows of one head (num_warps = BLOCK_M / 16 warps), key blocks of BLOCK_N. With the scores
S_j of key block j done (int8 wgmma, int32; the float32 score is the bit pattern of S_j + 0x4B400000, i.e.
12582912 + q8.k8, as in the Triton kernel), the int8 wgmma of S_{j+1} is issued and the online softmax of S_j runs
while it is on the tensor cores (FlashAttention-3's overlap of softmax and GEMM, Shah et al. 2024,
arXiv:2407.08608 section 3.2); then O is rescaled and P_j V_j (fp8 wgmma, P in registers) and its row sums
(``P @ ones``) are issued, and the three are waited for. K and V arrive by TMA into two slots each, a slot reloaded as
soon as the MMA that read it is done. V's keys are stored permuted within each 32 (``quantize_kv`` with ``GLUON``)
so that P passes from the score accumulator to the A operand without moving data between threads.

``_attn_fwd_gluon_ws`` (BLOCK_M 128) is FlashAttention-3's warp-specialized form of the same math (arXiv:2407.08608
sections 3.1-3.2): two consumer warpgroups of 64 rows whose wgmma issue alternates through two mbarriers (one
warpgroup's softmax under the other's GEMMs) and a 1-warp TMA producer filling ``num_stages`` K/V slots; the same
output bits.

Inputs as :func:`.int8_kernels._launch` prepares them for ``sage_attention_prequantized``: Q int8 [L, H*D]
(token-major), per-row Q scales float32 [L, H]; K8 int8 [H*N_KPAD, D]; V e4m3 transposed [H*D, N_KPAD] (keys
permuted); per key block K scales [H, N_KPAD / BLOCK_N]; V channel scales [H, D]. Output [L, H*D] in bf16 / fp16,
or e4m3 with the one scale max|v| / 448 whose row scales the head-0 programs write (as the Triton kernel). Batch 1.

Needs Triton with Gluon's Hopper module (3.6+) and a GPU of compute capability 9.x; :func:`available` says why not.
There is no interpreter path: the GPU benchmark (``benchmarks/bench_attention_gluon.py``) checks it against the
Triton kernel (bit for bit) and float32 attention on the same inputs. Measurements: docs/attention.md.
"""
from __future__ import annotations

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    _GLUON_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means "no Gluon Hopper path", reported by available()
    gluon = None
    _GLUON_ERROR = f"{type(e).__name__}: {e}"


def v_key_columns(n: int) -> torch.Tensor:
    """int64 [n] (n a multiple of 32): the column of V's e4m3 [D, L_pad] that holds key c for this kernel: within each
    32 keys, c = 16h + 8i + 2t + e goes to 16h + 4t + 2i + e (h, i, e in {0, 1}, t in {0..3}). The two kernels that
    use this order compute it as a reshape to [.., 2, 2, 4, 2] and a swap of the (i, t) dimensions:
    ``_quant_kv_kernel`` (V_PERM32) and :func:`_as_a_operand`."""
    c = torch.arange(n)
    h, i, t, e = (c >> 4) & 1, (c >> 3) & 1, (c >> 1) & 3, c & 1
    return (c & ~31) + 16 * h + 4 * t + 2 * i + e


def available(device) -> str | None:
    """None when the Gluon kernel can run on ``device``, else the reason (no Gluon in this Triton, not CUDA, not
    compute capability 9.x)."""
    if gluon is None:
        return f"Gluon's Hopper module is not importable ({_GLUON_ERROR})"
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"device {dev} is not CUDA"
    major, _ = torch.cuda.get_device_capability(dev)
    if major != 9:
        return f"compute capability {major}.x (the kernel is written for Hopper's wgmma, 9.x)"
    return None


#: the warp-specialized kernel's consumer warpgroup with no query row (the second half of a last tile of <= 64 rows)
#: skips its MMAs and softmax and only keeps the turn / slot protocol (False: it computes masked rows, as before)
WS_SKIP_EMPTY = True


if gluon is not None:

    _THREAD_BARRIER = gl.constexpr(hasattr(gl, "thread_barrier"))   # Triton 3.6 (the device's); 3.8: gl.barrier
    WS_CONSUMER_REGS = gl.constexpr(240)
    WS_MAXNREG = 168     # 12 warps (3 warpgroups) x 32 x 168 <= 65 536: consumers 240, the TMA warpgroup 24

    @gluon.jit
    def _softmax_block(s, c, m_i, start_n, N_K, BLOCK_N: gl.constexpr, col_layout: gl.constexpr,
                       MASK: gl.constexpr):
        """Online-softmax step of one key block: ``s`` int32 scores q8.k8 (+ 0x4B400000: the bits of
        12582912 + q8.k8 as float32), ``c`` the per-row score scale (exp2 domain) -> (P * 448 e4m3 inputs as float32,
        alpha = exp2(m_i - m_new), m_new); the float32 ops of ``_update`` in the Triton kernel."""
        x = (s + 0x4B400000).to(gl.float32, bitcast=True)
        off = -12582912.0 * c
        if MASK:
            valid = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=col_layout) < N_K, 0)
            x = gl.where(valid, x, 0.0)
        m_new = gl.maximum(m_i, gl.max(x, 1) * c + off)
        arg = x * gl.expand_dims(c, 1) + gl.expand_dims(off + 8.807354922057604 - m_new, 1)   # log2(448)
        if MASK:
            arg = gl.where(valid, arg, -float("inf"))
        return gl.exp2(arg), gl.exp2(m_i - m_new), m_new

    @gluon.jit
    def _as_a_operand(p, p_layout: gl.constexpr):
        """P [BLOCK_M, BLOCK_N] float32 in the scores' accumulator layout -> e4m3 in the A-operand layout of the P V
        wgmma without moving data between threads: within each 32 keys the column c = 16h + 8i + 2t + e (thread t
        of a quad holds e in {0, 1}, i in {0, 1}) becomes A position 16h + 4t + 2i + e, which the same thread holds
        (four consecutive k per register); V's keys are stored in that order (quantize_kv with GLUON), so P V is
        unchanged. FlashAttention-3 reorders its FP8 P registers the same way (arXiv:2407.08608 section 3.3)."""
        BLOCK_M: gl.constexpr = p.shape[0]
        BLOCK_N: gl.constexpr = p.shape[1]
        x = gl.reshape(p, [BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2])
        x = gl.permute(x, [0, 1, 2, 4, 3, 5])
        x = gl.convert_layout(gl.reshape(x, [BLOCK_M, BLOCK_N]), p_layout, assert_trivial=True)
        # four consecutive k into one register: two cvt.rn.satfinite.e4m3x2 (what .to(float8e4nv) emits) and one move,
        # instead of the byte extracts and re-packs Triton 3.6 generates around a tensor of 8-bit elements
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)

    @gluon.jit
    def _pipelined_block(j, s, acc, l_i, m_i, qc, ks_ptr, q_smem, k_smem, v_smem, ones_smem, k_bar, v_bar,
                         k_desc, v_desc, k_row, v_row, n, N_K, s_zero, rs0,
                         BLOCK_N: gl.constexpr, k_bytes: gl.constexpr, v_bytes: gl.constexpr,
                         col_s: gl.constexpr, row_o: gl.constexpr, p_layout: gl.constexpr, MASK: gl.constexpr):
        """Key block j with its scores ``s`` done: S_{j+1} issued (on the last block a dummy on the K slot it holds,
        no load, result unused), the softmax of S_j while it runs, O rescaled, P_j V_j and its row sums issued, all
        waited for; the freed K slot takes K_{j+3}, the V slot V_{j+2}. Returns (S_{j+1}, O, l, m)."""
        sn = (j + 1) % 2
        mbarrier.wait(k_bar.index(sn), ((j + 1) // 2) & 1, pred=j + 1 < n)
        s_tok = warpgroup_mma(q_smem, k_smem.index(sn).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        p, alpha, m_i = _softmax_block(s, qc * gl.load(ks_ptr + j), m_i, j * BLOCK_N, N_K, BLOCK_N, col_s, MASK)
        p8 = _as_a_operand(p, p_layout)
        alpha_o = gl.convert_layout(alpha, row_o)
        acc = acc * gl.expand_dims(alpha_o, 1)
        sj = j % 2
        mbarrier.wait(v_bar.index(sj), (j // 2) & 1)
        acc_tok = warpgroup_mma(p8, v_smem.index(sj).permute((1, 0)), acc, is_async=True)
        rs_tok = warpgroup_mma(p8, ones_smem.permute((1, 0)), rs0, use_acc=False, is_async=True)
        s, acc, rs = warpgroup_mma_wait(0, deps=[s_tok, acc_tok, rs_tok])
        mbarrier.expect(k_bar.index(sn), k_bytes, pred=j + 3 < n)
        tma.async_copy_global_to_shared(k_desc, [k_row + (j + 3) * BLOCK_N, 0], k_bar.index(sn), k_smem.index(sn),
                                        pred=j + 3 < n)
        mbarrier.expect(v_bar.index(sj), v_bytes, pred=j + 2 < n)
        tma.async_copy_global_to_shared(v_desc, [v_row, (j + 2) * BLOCK_N], v_bar.index(sj), v_smem.index(sj),
                                        pred=j + 2 < n)
        l_i = l_i * alpha_o + gl.convert_layout(gl.max(rs, 1), row_o)
        return s, acc, l_i, m_i

    @gluon.jit
    def _attn_fwd_gluon(q_desc, k_desc, v_desc, QS, KS, VS, OUT, HMAX, SX, ONES,
                        H, N_Q, N_K, N_KPAD, qk_scale,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        OUT_FP8: gl.constexpr, HP: gl.constexpr, ONES_SWIZZLE: gl.constexpr,
                        num_warps: gl.constexpr):
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)                                # batch 1: bh is the head
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, 16, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        ones_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=ONES_SWIZZLE, element_bitwidth=8, rank=2)
        fill_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])

        q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        # (a tile built in registers by gl.full(1.0) read back wrong through the wgmma in Triton 3.6: loaded instead)
        offs_r = gl.arange(0, 16, layout=gl.SliceLayout(1, fill_layout))
        offs_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, fill_layout))
        ones = gl.load(ONES + gl.expand_dims(offs_r, 1) * BLOCK_N + gl.expand_dims(offs_c, 0))
        ones_smem = gl.allocate_shared_memory(gl.float8e4nv, [16, BLOCK_N], ones_layout, ones)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(k_bar.index(i), count=1)
            mbarrier.init(v_bar.index(i), count=1)
        fence_async_shared()     # the ones tile and the barriers, written by every thread, before any async reader
        if _THREAD_BARRIER:
            gl.thread_barrier()
        else:
            gl.barrier()

        n = gl.cdiv(N_K, BLOCK_N)
        k_row = bh * N_KPAD
        v_row = bh * HEAD_DIM
        k_bytes: gl.constexpr = k_desc.block_type.nbytes
        v_bytes: gl.constexpr = v_desc.block_type.nbytes
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [pid_m * BLOCK_M, bh * HEAD_DIM], q_bar, q_smem)
        for i in gl.static_range(2):
            mbarrier.expect(k_bar.index(i), k_bytes, pred=i < n)
            tma.async_copy_global_to_shared(k_desc, [k_row + i * BLOCK_N, 0], k_bar.index(i), k_smem.index(i),
                                            pred=i < n)
            mbarrier.expect(v_bar.index(i), v_bytes, pred=i < n)
            tma.async_copy_global_to_shared(v_desc, [v_row, i * BLOCK_N], v_bar.index(i), v_smem.index(i),
                                            pred=i < n)

        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
        qc = gl.load(QS + bh + offs_m * H, mask=offs_m < N_Q, other=0.0) * qk_scale
        ks_ptr = KS + bh * (N_KPAD // BLOCK_N)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)   # unused values (use_acc=False)
        rs0 = gl.zeros([BLOCK_M, 16], gl.float32, r_layout)

        # ---- key block 0
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_bar.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.expect(k_bar.index(0), k_bytes, pred=2 < n)
        tma.async_copy_global_to_shared(k_desc, [k_row + 2 * BLOCK_N, 0], k_bar.index(0), k_smem.index(0),
                                        pred=2 < n)
        m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_o)

        # ---- full key blocks, then the ragged one (masked)
        n_full = N_K // BLOCK_N
        for j in range(0, n_full):
            s, acc, l_i, m_i = _pipelined_block(j, s, acc, l_i, m_i, qc, ks_ptr, q_smem, k_smem, v_smem, ones_smem,
                                                k_bar, v_bar, k_desc, v_desc, k_row, v_row, n, N_K, s_zero, rs0,
                                                BLOCK_N, k_bytes, v_bytes, col_s, row_o, p_layout, False)
        if n_full < n:
            s, acc, l_i, m_i = _pipelined_block(n_full, s, acc, l_i, m_i, qc, ks_ptr, q_smem, k_smem, v_smem,
                                                ones_smem, k_bar, v_bar, k_desc, v_desc, k_row, v_row, n, N_K, s_zero,
                                                rs0, BLOCK_N, k_bytes, v_bytes, col_s, row_o, p_layout, True)
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(2):
            mbarrier.invalidate(k_bar.index(i))
            mbarrier.invalidate(v_bar.index(i))

        # ---- epilogue (the Triton kernel's, per channel V scale, optional e4m3 output)
        _store_output(acc, l_i, pid_m * BLOCK_M, bh, VS, OUT, HMAX, SX, H, N_Q, row_o, col_o, HP, num_warps)


    @gluon.jit
    def _store_output(acc, l_i, row0, bh, VS, OUT, HMAX, SX, H, N_Q, row_o: gl.constexpr, col_o: gl.constexpr,
                      HP: gl.constexpr, NW: gl.constexpr):
        """Epilogue of both kernels (the Triton kernel's): rows [row0, row0 + BLOCK_M) of head bh, O / l times V's
        per-channel scale, stored as OUT's dtype; for an e4m3 OUT scaled by 448 / gmax, gmax = max over the H heads'
        max |v| in HMAX (``HP`` = next power of two >= H, or 0: in chunks of 128, as no head-count constexpr passes
        through ``warp_specialize``; ``NW`` warps), clamped to +-448, the head-0 programs writing the row scales
        gmax / 448 into SX."""
        BLOCK_M: gl.constexpr = acc.shape[0]
        HEAD_DIM: gl.constexpr = acc.shape[1]
        offs_mo = row0 + gl.arange(0, BLOCK_M, layout=row_o)
        offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
        vs = gl.load(VS + bh * HEAD_DIM + offs_d)
        out = acc / gl.expand_dims(l_i, 1) * gl.expand_dims(vs, 0)
        if OUT.dtype.element_ty == gl.float8e4nv:
            hm_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
            if HP > 0:
                offs_h = gl.arange(0, HP, layout=hm_layout)
                gmax = gl.max(gl.load(HMAX + offs_h, mask=offs_h < gl.num_programs(1), other=0.0), 0)
            else:
                gmax = gl.max(gl.zeros([128], gl.float32, hm_layout), 0)
                for h0 in range(0, gl.num_programs(1), 128):
                    offs_h = h0 + gl.arange(0, 128, layout=hm_layout)
                    gmax = gl.maximum(gmax, gl.max(gl.load(HMAX + offs_h, mask=offs_h < gl.num_programs(1),
                                                           other=0.0), 0))
            amax = gl.zeros([BLOCK_M], gl.float32, row_o) + gmax
            gs = gl.div_rn(amax, gl.full([BLOCK_M], 448.0, gl.float32, row_o))
            ginv = gl.div_rn(gl.full([BLOCK_M], 1.0, gl.float32, row_o), gl.where(amax > 0, amax, 1.0)) * 448.0
            ginv = gl.where(amax > 0, ginv, 0.0)
            out = gl.minimum(gl.maximum(out * gl.expand_dims(ginv, 1), -448.0), 448.0)
            if bh == 0:
                gl.store(SX + offs_mo, gl.where(gs > 0, gs, 1.0 / 448.0), mask=offs_mo < N_Q)
        optr = OUT + gl.expand_dims(offs_mo.to(gl.int64) * (H * HEAD_DIM), 1) + bh * HEAD_DIM + gl.expand_dims(offs_d, 0)
        gl.store(optr, out.to(OUT.dtype.element_ty), mask=gl.expand_dims(offs_mo < N_Q, 1))

    @gluon.jit
    def _ws_step(j, s, acc, l_i, m_i, qc, ks_ptr, q_smem, k_smem, v_smem, ones_smem, k_ready, v_ready, k_empty,
                 v_empty, my_turn, other_turn, turn_ph, N_K, s_zero, rs0,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, col_s: gl.constexpr, row_o: gl.constexpr,
                 p_layout: gl.constexpr, MASK: gl.constexpr, LAST: gl.constexpr):
        """Key block j of a consumer warpgroup with its scores ``s`` done: the softmax of S_j and O's rescale (while the
        other warpgroup's GEMMs run), then in this warpgroup's turn P_j V_j, its row sums and (unless ``LAST``)
        S_{j+1} = Q K_{j+1}^T issued, all waited for, the slots released. Returns (S_{j+1}, O, l, m)."""
        p, alpha, m_i = _softmax_block(s, qc * gl.load(ks_ptr + j), m_i, j * BLOCK_N, N_K, BLOCK_N, col_s, MASK)
        p8 = _as_a_operand(p, p_layout)
        alpha_o = gl.convert_layout(alpha, row_o)
        acc = acc * gl.expand_dims(alpha_o, 1)
        sj = j % STAGES
        sn = (j + 1) % STAGES
        mbarrier.wait(my_turn, turn_ph ^ ((j + 1) & 1))
        mbarrier.wait(v_ready.index(sj), (j // STAGES) & 1)
        acc_tok = warpgroup_mma(p8, v_smem.index(sj).permute((1, 0)), acc, is_async=True)
        rs_tok = warpgroup_mma(p8, ones_smem.permute((1, 0)), rs0, use_acc=False, is_async=True)
        if LAST:
            mbarrier.arrive(other_turn, count=1)
            acc, rs = warpgroup_mma_wait(0, deps=[acc_tok, rs_tok])
        else:
            mbarrier.wait(k_ready.index(sn), ((j + 1) // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(sn).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.arrive(other_turn, count=1)
            s, acc, rs = warpgroup_mma_wait(0, deps=[s_tok, acc_tok, rs_tok])
            mbarrier.arrive(k_empty.index(sn), count=1)
        mbarrier.arrive(v_empty.index(sj), count=1)
        l_i = l_i * alpha_o + gl.convert_layout(gl.max(rs, 1), row_o)
        return s, acc, l_i, m_i

    @gluon.jit
    def _ws_consumer(args, WG: gl.constexpr):
        """One consumer warpgroup (4 warps): query rows [pid_m * 128 + 64 WG, + 64) of head bh, all key blocks, then
        the epilogue (the 4-warp kernel's). Its wgmma issue alternates with the other consumer's through the two turn
        mbarriers (FlashAttention-3's ping-pong, arXiv:2407.08608 section 3.1: one warpgroup's softmax under the
        other's GEMMs). A warpgroup with no query row (``SKIP_EMPTY``) only keeps the protocol (:func:`_ws_idle`)."""
        (q_desc, k_desc, v_desc, QS, KS, VS, OUT, HMAX, SX, H, N_Q, N_K, N_KPAD, qk_scale,
         q_smem, k_smem, v_smem, ones_smem, q_ready, k_ready, v_ready, k_empty, v_empty, turn, SKIP_EMPTY) = args
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        turn_ph = 1 - WG             # a fresh mbarrier passes a wait on phase 1: warpgroup 0 issues first
        row0 = gl.program_id(0) * 128 + WG * 64
        if SKIP_EMPTY:       # a run-time value here: constexprs do not pass through warp_specialize's arguments
            empty = row0 >= N_Q
        else:
            empty = row0 < 0
        if empty:
            _ws_idle(gl.cdiv(N_K, BLOCK_N), k_ready, v_ready, k_empty, v_empty, turn.index(WG), turn.index(1 - WG),
                     turn_ph, STAGES)
        else:
            _ws_rows(args, WG)

    @gluon.jit
    def _ws_idle(n, k_ready, v_ready, k_empty, v_empty, my_turn, other_turn, turn_ph, STAGES: gl.constexpr):
        """A consumer warpgroup whose 64 rows are all past the last query (the second half of a last tile of at
        most 64 rows): no MMA and no softmax, only its part of the protocol, the same turns and slot releases in the
        same order as :func:`_ws_rows`, so the other warpgroup and the TMA warp run as before, without waiting for
        GEMMs of empty rows."""
        mbarrier.wait(my_turn, turn_ph)
        mbarrier.wait(k_ready.index(0), 0)
        mbarrier.arrive(other_turn, count=1)
        mbarrier.arrive(k_empty.index(0), count=1)
        for j in range(0, n):
            sj = j % STAGES
            sn = (j + 1) % STAGES
            mbarrier.wait(my_turn, turn_ph ^ ((j + 1) & 1))
            mbarrier.wait(v_ready.index(sj), (j // STAGES) & 1)
            if j + 1 < n:
                mbarrier.wait(k_ready.index(sn), ((j + 1) // STAGES) & 1)
                mbarrier.arrive(other_turn, count=1)
                mbarrier.arrive(k_empty.index(sn), count=1)
            else:
                mbarrier.arrive(other_turn, count=1)
            mbarrier.arrive(v_empty.index(sj), count=1)

    @gluon.jit
    def _ws_rows(args, WG: gl.constexpr):
        """:func:`_ws_consumer` for a warpgroup with query rows: S_0, every key block, the epilogue."""
        (q_desc, k_desc, v_desc, QS, KS, VS, OUT, HMAX, SX, H, N_Q, N_K, N_KPAD, qk_scale,
         q_smem, k_smem, v_smem, ones_smem, q_ready, k_ready, v_ready, k_empty, v_empty, turn, _skip) = args
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_M: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 16, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        qw = q_smem.index(WG)
        my_turn = turn.index(WG)
        other_turn = turn.index(1 - WG)
        turn_ph = 1 - WG
        n = gl.cdiv(N_K, BLOCK_N)
        n_full = N_K // BLOCK_N
        offs_m = pid_m * 128 + WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
        qc = gl.load(QS + bh + offs_m * H, mask=offs_m < N_Q, other=0.0) * qk_scale
        ks_ptr = KS + bh * (N_KPAD // BLOCK_N)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
        rs0 = gl.zeros([BLOCK_M, 16], gl.float32, r_layout)

        # ---- S_0 in this warpgroup's first turn
        mbarrier.wait(my_turn, turn_ph)
        mbarrier.wait(q_ready, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(qw, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.arrive(other_turn, count=1)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(0), count=1)
        m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_o)

        # ---- key blocks 0 .. n-2 (full), then the last one (masked if ragged)
        for j in range(0, n - 1):
            s, acc, l_i, m_i = _ws_step(j, s, acc, l_i, m_i, qc, ks_ptr, qw, k_smem, v_smem, ones_smem, k_ready,
                                        v_ready, k_empty, v_empty, my_turn, other_turn, turn_ph, N_K, s_zero, rs0,
                                        BLOCK_N, STAGES, col_s, row_o, p_layout, False, False)
        if n_full < n:
            s, acc, l_i, m_i = _ws_step(n - 1, s, acc, l_i, m_i, qc, ks_ptr, qw, k_smem, v_smem, ones_smem, k_ready,
                                        v_ready, k_empty, v_empty, my_turn, other_turn, turn_ph, N_K, s_zero, rs0,
                                        BLOCK_N, STAGES, col_s, row_o, p_layout, True, True)
        else:
            s, acc, l_i, m_i = _ws_step(n - 1, s, acc, l_i, m_i, qc, ks_ptr, qw, k_smem, v_smem, ones_smem, k_ready,
                                        v_ready, k_empty, v_empty, my_turn, other_turn, turn_ph, N_K, s_zero, rs0,
                                        BLOCK_N, STAGES, col_s, row_o, p_layout, False, True)

        # ---- epilogue (the 4-warp kernel's)
        _store_output(acc, l_i, pid_m * 128 + WG * BLOCK_M, bh, VS, OUT, HMAX, SX, H, N_Q, row_o, col_o, 0, 4)

    @gluon.jit
    def _ws_consumer0(args):
        _ws_consumer(args, 0)

    @gluon.jit
    def _ws_consumer1(args):
        _ws_consumer(args, 1)

    @gluon.jit
    def _ws_producer(args):
        """The TMA partition (1 warp): Q's two 64-row halves, then K_j and V_j into slot j % STAGES once both
        consumers have released it (k_empty / v_empty count 2)."""
        (q_desc, k_desc, v_desc, QS, KS, VS, OUT, HMAX, SX, H, N_Q, N_K, N_KPAD, qk_scale,
         q_smem, k_smem, v_smem, ones_smem, q_ready, k_ready, v_ready, k_empty, v_empty, turn, _skip) = args
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        STAGES: gl.constexpr = k_smem.type.shape[0]
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        n = gl.cdiv(N_K, BLOCK_N)
        k_row = bh * N_KPAD
        v_row = bh * HEAD_DIM
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [pid_m * 128 + w * 64, bh * HEAD_DIM], q_ready, q_smem.index(w))
        for j in range(0, n):
            st = j % STAGES
            ph = ((j // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(st), ph)
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, 0], k_ready.index(st), k_smem.index(st))
            mbarrier.wait(v_empty.index(st), ph)
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [v_row, j * BLOCK_N], v_ready.index(st), v_smem.index(st))

    @gluon.jit
    def _attn_fwd_gluon_ws(q_desc, k_desc, v_desc, QS, KS, VS, OUT, HMAX, SX, ONES,
                           H, N_Q, N_K, N_KPAD, qk_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           OUT_FP8: gl.constexpr, ONES_SWIZZLE: gl.constexpr, SKIP_EMPTY: gl.constexpr,
                           num_warps: gl.constexpr):
        """128 query rows per program: two consumer warpgroups of 64 rows (the default partition and a 4-warp
        worker) sharing K/V slots that a 1-warp TMA worker fills (FlashAttention-3's warp specialization and
        ping-pong schedule); the same per-row math, so the same bits, as :func:`_attn_fwd_gluon`."""
        ones_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=ONES_SWIZZLE, element_bitwidth=8, rank=2)
        fill_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        offs_r = gl.arange(0, 16, layout=gl.SliceLayout(1, fill_layout))
        offs_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, fill_layout))
        ones = gl.load(ONES + gl.expand_dims(offs_r, 1) * BLOCK_N + gl.expand_dims(offs_c, 0))
        ones_smem = gl.allocate_shared_memory(gl.float8e4nv, [16, BLOCK_N], ones_layout, ones)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()
        if _THREAD_BARRIER:
            gl.thread_barrier()
        else:
            gl.barrier()
        args = (q_desc, k_desc, v_desc, QS, KS, VS, OUT, HMAX, SX, H, N_Q, N_K, N_KPAD, qk_scale,
                q_smem, k_smem, v_smem, ones_smem, q_ready, k_ready, v_ready, k_empty, v_empty, turn, SKIP_EMPTY)
        wargs = (args,)
        gl.warp_specialize([(_ws_consumer0, wargs), (_ws_consumer1, wargs), (_ws_producer, wargs)],
                           [4, 1], [WS_CONSUMER_REGS, 24])


def launch_prequantized(q8: torch.Tensor, qs: torch.Tensor, kv: dict, out: torch.Tensor, fp8_scales, ones, H: int,
                        L: int, D: int, sm_log2: float, c: dict) -> torch.Tensor:
    """The Gluon kernel's launch for :func:`.int8_kernels.sage_attention_prequantized` (batch 1): q8 int8 [L, H, D]
    contiguous, qs float32 [L, H], ``kv`` from ``quantize_kv`` (PV_FP8), ``out`` [1, L, H*D] (bf16 / fp16, or e4m3 with
    ``fp8_scales`` = (hmax [H], sx [L, 1])); ``sm_log2`` = softmax scale * log2(e); ``c`` the launch configuration
    (validated by ``_cfg``: BLOCK_M 64 -> the 4-warp kernel, 128 -> the warp-specialized one with ``num_stages`` K/V
    slots; 4 warps, BLOCK_N 128, no register cap). ValueError for a V not quantized with config GLUON."""
    bm, bn, npad = c["BLOCK_M"], c["BLOCK_N"], kv["n_kpad"]
    if not kv.get("v_perm32"):
        raise ValueError("attention_int8 GLUON: V must be quantized with config GLUON (keys permuted per 32)")
    qm = 64 if bm == 128 else bm       # the warp-specialized kernel loads Q per 64-row consumer
    i8 = gl.NVMMASharedLayout.get_default_for([qm, D], gl.int8)
    q_desc = GluonTensorDescriptor(q8.view(L, H * D), [L, H * D], [H * D, 1], [qm, D], i8)
    k_desc = GluonTensorDescriptor(kv["k8"].view(H * npad, D), [H * npad, D], [D, 1], [bn, D],
                                   gl.NVMMASharedLayout.get_default_for([bn, D], gl.int8))
    v_desc = GluonTensorDescriptor(kv["vq"].view(H * D, npad), [H * D, npad], [npad, 1], [D, bn],
                                   gl.NVMMASharedLayout.get_default_for([D, bn], gl.float8e4nv))
    hmax, sx = fp8_scales if fp8_scales is not None else (kv["vs"], kv["vs"])
    if bm == 128:        # two consumer warpgroups of 64 rows and a TMA warp (FlashAttention-3's structure)
        _attn_fwd_gluon_ws[(triton.cdiv(L, 128), H)](
            q_desc, k_desc, v_desc, qs, kv["ks"], kv["vs"], out, hmax, sx, ones, H, L, L, npad, sm_log2,
            HEAD_DIM=D, BLOCK_N=bn, STAGES=c["num_stages"], OUT_FP8=fp8_scales is not None,
            ONES_SWIZZLE=min(128, bn), SKIP_EMPTY=WS_SKIP_EMPTY, num_warps=4,
            maxnreg=WS_MAXNREG)
        return out
    grid = (triton.cdiv(L, bm), H)
    _attn_fwd_gluon[grid](q_desc, k_desc, v_desc, qs, kv["ks"], kv["vs"], out, hmax, sx, ones, H, L, L, npad, sm_log2,
                          HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, OUT_FP8=fp8_scales is not None, ONES_SWIZZLE=min(128, bn),
                          HP=triton.next_power_of_2(H) if fp8_scales is not None else 1,
                          num_warps=bm // 16)
    return out
