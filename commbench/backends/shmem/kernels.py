"""Triton kernels of the NVSHMEM backend, calling NVSHMEM device functions (imported on GPU machines only).

Binding: Triton ``@triton.jit`` kernels linked against NVSHMEM's device bitcode through PyTorch's
``torch.distributed._symmetric_memory._nvshmem_triton.requires_nvshmem`` (which also runs NVSHMEM's
per-module init after compilation). The extern declarations below name the NVSHMEM device API directly
(``nvshmemx_putmem_signal_nbi_block``, ``nvshmem_signal_wait_until``, ``nvshmem_quiet``), so they do not
depend on which wrappers a given torch version ships. Needs Triton >= 3.4 (``_semantic`` builtins).

Block-scoped NVSHMEM calls (``*_block``) must be reached by every thread of the program: Triton runs scalar
code on all threads, which is what they need. Thread-scoped signal ops (``nvshmemx_signal_op``) would run once
per thread, so signals only travel with block-scoped put-with-signal calls (an empty segment puts 0 bytes).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language import core

from commbench.backends.shmem.bitcode import export_device_library
from commbench.backends.shmem.protocol import CMP_GE

_CMP_GE = tl.constexpr(CMP_GE)  # jit code may only read constexpr globals
_I64 = core.dtype("int64")
_I32 = core.dtype("int32")
_U64 = core.dtype("uint64")


@core.extern
def _putmem_signal_nbi_block(dst, src, nbytes, sig_addr, sig_value, sig_op, pe, _semantic=None):
    return core.extern_elementwise(
        "",
        "",
        [dst, src, nbytes, sig_addr, sig_value, sig_op, pe],
        {(_I64, _I64, _I64, _I64, _U64, _I32, _I32): ("nvshmemx_putmem_signal_nbi_block", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def _putmem_signal_block(dst, src, nbytes, sig_addr, sig_value, sig_op, pe, _semantic=None):
    return core.extern_elementwise(
        "",
        "",
        [dst, src, nbytes, sig_addr, sig_value, sig_op, pe],
        {(_I64, _I64, _I64, _I64, _U64, _I32, _I32): ("nvshmemx_putmem_signal_block", _I32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def _signal_wait_until(sig_addr, cmp, cmp_value, _semantic=None):
    return core.extern_elementwise(
        "",
        "",
        [sig_addr, cmp, cmp_value],
        {(_I64, _I32, _U64): ("nvshmem_signal_wait_until", _U64)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def _quiet(_semantic=None):
    return core.extern_elementwise(
        "", "", [], {(): ("nvshmem_quiet", _I32)}, is_pure=False, _semantic=_semantic
    )


@core.extern
def _globaltimer(_semantic=None):
    """Nanoseconds (PTX %globaltimer), for the wait timeout."""
    return core.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=core.int64, is_pure=False, pack=1, _semantic=_semantic
    )


@triton.jit(
    do_not_specialize=["send_addr", "recv_addr", "sig_addr", "num_items", "row_bytes", "sig_value", "sig_op"]
)
def commbench_put_items(
    items_ptr,  # int64 [items, 5]: dst pe, src row, dst row, rows, signal word
    send_addr,  # address of this PE's staging buffer (symmetric)
    recv_addr,  # symmetric address of the receive buffer of this epoch's parity
    sig_addr,  # symmetric address of the phase's signal words (uint64)
    num_items,
    row_bytes,
    sig_value,
    sig_op,
    BLOCKING: tl.constexpr,
):
    """Each program takes items pid, pid + P, ...: one put-with-signal per item, then quiet. An item with
    rows < 0 (counts=device's fixed grid past a segment's chunks: protocol.INACTIVE) puts and signals
    nothing."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for item in range(pid, num_items, programs):
        row = items_ptr + item * 5
        pe = tl.load(row).to(tl.int32)
        src_row = tl.load(row + 1)
        dst_row = tl.load(row + 2)
        rows = tl.load(row + 3)
        word = tl.load(row + 4)
        nbytes = (rows * row_bytes).to(tl.int64)
        dst = (recv_addr + dst_row * row_bytes).to(tl.int64)
        src = (send_addr + src_row * row_bytes).to(tl.int64)
        sig = (sig_addr + word * 8).to(tl.int64)
        value = sig_value.to(tl.uint64)
        op = sig_op.to(tl.int32)
        if rows >= 0:  # a scalar branch: every thread of the program takes it, as block-scoped calls need
            if BLOCKING:
                _putmem_signal_block(dst, src, nbytes, sig, value, op, pe)
            else:
                _putmem_signal_nbi_block(dst, src, nbytes, sig, value, op, pe)
    _quiet()


@triton.jit(do_not_specialize=["sig_addr", "epoch_delta", "epoch", "timeout_ns", "err_addr"])
def commbench_wait_signals(
    waits_ptr,  # int64 [waits, 3]: signal word, base value, increment per iteration
    sig_addr,  # this PE's signal words (int64 address)
    epoch_delta,  # iterations since the table's base values were taken (ADD)
    epoch,  # the iteration's epoch (SET)
    timeout_ns,
    err_addr,  # int32 [waits] in pinned host memory: 1 where the wait timed out
    USE_SET: tl.constexpr,
    SPIN: tl.constexpr,
):
    """One program per wait: until signal word >= expected (CMP_GE), with a timeout when SPIN."""
    i = tl.program_id(0)
    word = tl.load(waits_ptr + i * 3)
    if USE_SET:
        expected = epoch.to(tl.int64)
    else:
        expected = tl.load(waits_ptr + i * 3 + 1) + tl.load(waits_ptr + i * 3 + 2) * epoch_delta
    sig = (sig_addr + word * 8).to(tl.pointer_type(tl.int64))
    if SPIN:
        start = _globaltimer()
        value = tl.atomic_add(sig, 0, sem="acquire", scope="sys")
        elapsed = start - start
        while (value < expected) & (elapsed < timeout_ns):
            value = tl.atomic_add(sig, 0, sem="acquire", scope="sys")
            elapsed = _globaltimer() - start
        if value < expected:
            err = (err_addr + i * 4).to(tl.pointer_type(tl.int32))
            tl.store(err, 1)
    else:
        _signal_wait_until((sig_addr + word * 8).to(tl.int64), _CMP_GE, expected.to(tl.uint64))


_LAUNCHERS: tuple | None = None


def launchers() -> tuple:
    """(put_items, wait_signals) wrapped by torch's ``requires_nvshmem`` (links the NVSHMEM device bitcode and
    initializes NVSHMEM in each compiled module); built on first use, on a GPU machine."""
    global _LAUNCHERS
    if _LAUNCHERS is None:
        # torch's finder takes NVSHMEM_LIB_DIR first: point it at the bitcode found (see bitcode.py).
        export_device_library()
        from torch.distributed._symmetric_memory._nvshmem_triton import requires_nvshmem

        _LAUNCHERS = (requires_nvshmem(commbench_put_items), requires_nvshmem(commbench_wait_signals))
    return _LAUNCHERS
