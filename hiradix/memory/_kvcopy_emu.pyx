# cython: language_level=3
"""CPU emulation of the CUDA KV copy kernel (``_kvcopy_cuda.cu``), for CI.

:func:`launch` takes what the kernel's launcher takes (the bound job array of one layer,
the chunk width, the mode and the grid) and runs every thread of the grid one after
another, each through the same ``kvcopy.h`` routine the GPU threads run;
:func:`launch_layers` is the library's whole-operation entry (``hr_kvcopy_launch_layers``:
templates bound to the offsets with the same ``hr_job_bind``, layer after layer). Chunks
never overlap, so sequential threads give the bytes the parallel ones do: a test that
compares this with the torch path checks the kernel's index arithmetic, the plan built for
it (:mod:`hiradix.memory.kernel`) and the width, mode and grid choices, everywhere but on
the GPU.

Addresses are raw: only the planner in :mod:`hiradix.memory.kernel`, which builds the jobs
from live tensors and checks every row against its buffer, should call it.
"""

from libc.stdint cimport int64_t, uintptr_t

cdef extern from "kvcopy.h" nogil:
    ctypedef struct hr_job:
        pass
    int HR_MODE_WIDE
    int HR_MODE_WARP
    int HR_WARP
    void hr_job_bind(hr_job* out, const hr_job* tmpl, const int64_t* offsets, int c, int64_t groups,
                     int64_t group_rows, int to_device)
    void hr_copy_16(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_copy_8(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_copy_4(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_copy_2(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_copy_1(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_rows_16(const hr_job* job, int64_t warp, int64_t nwarps, int lane)
    void hr_rows_8(const hr_job* job, int64_t warp, int64_t nwarps, int lane)
    void hr_rows_4(const hr_job* job, int64_t warp, int64_t nwarps, int lane)
    void hr_rows_2(const hr_job* job, int64_t warp, int64_t nwarps, int lane)
    void hr_rows_1(const hr_job* job, int64_t warp, int64_t nwarps, int lane)

MAX_JOBS = 4


cdef void _grid(const hr_job* job, int width, int mode, int64_t nthreads) noexcept nogil:
    """Every thread of one job's grid, in turn."""
    cdef int64_t tid, nwarps = nthreads // HR_WARP
    cdef int lane
    for tid in range(nthreads):
        if mode == HR_MODE_WARP:
            lane = <int>(tid % HR_WARP)
            if width == 16:
                hr_rows_16(job, tid // HR_WARP, nwarps, lane)
            elif width == 8:
                hr_rows_8(job, tid // HR_WARP, nwarps, lane)
            elif width == 4:
                hr_rows_4(job, tid // HR_WARP, nwarps, lane)
            elif width == 2:
                hr_rows_2(job, tid // HR_WARP, nwarps, lane)
            else:
                hr_rows_1(job, tid // HR_WARP, nwarps, lane)
        elif width == 16:
            hr_copy_16(job, tid, nthreads)
        elif width == 8:
            hr_copy_8(job, tid, nthreads)
        elif width == 4:
            hr_copy_4(job, tid, nthreads)
        elif width == 2:
            hr_copy_2(job, tid, nthreads)
        else:
            hr_copy_1(job, tid, nthreads)


cdef int _check(int njobs, int width, int mode, int blocks, int threads) except -1:
    if width not in (1, 2, 4, 8, 16):
        raise ValueError(f"width must be 1, 2, 4, 8 or 16, got {width}")
    if mode not in (HR_MODE_WIDE, HR_MODE_WARP):
        raise ValueError(f"mode must be {HR_MODE_WIDE} (wide) or {HR_MODE_WARP} (warp), got {mode}")
    if not 1 <= njobs <= MAX_JOBS or blocks < 1 or not 32 <= threads <= 1024 or threads % 32:
        raise ValueError(f"bad launch: {njobs} jobs, {blocks} blocks of {threads} threads")
    return 0


def launch(uintptr_t jobs, int njobs, int width, int mode, int blocks, int threads):
    """Run the kernel's grid on the CPU: ``blocks x threads`` threads for each of the
    ``njobs`` bound ``hr_job`` records at address ``jobs``, chunks of ``width`` bytes."""
    _check(njobs, width, mode, blocks, threads)
    cdef int64_t n = <int64_t>blocks * threads
    cdef int i
    with nogil:
        for i in range(njobs):
            _grid((<const hr_job*>jobs) + i, width, mode, n)


def launch_layers(uintptr_t templates, int njobs, int layers, uintptr_t offsets, int64_t groups,
                  int64_t group_rows, bint to_device, int width, int mode, int blocks, int threads):
    """``hr_kvcopy_launch_layers`` on the CPU (no spin, no events): ``layers`` layers of
    ``njobs`` templates each at ``templates``, bound to the ``offsets`` at that address."""
    _check(njobs, width, mode, blocks, threads)
    if layers < 1 or groups < 1 or group_rows < 1:
        raise ValueError(f"bad operation: {layers} layers, {groups} groups of {group_rows} rows")
    cdef int64_t n = <int64_t>blocks * threads
    cdef hr_job job
    cdef int layer, c
    with nogil:
        for layer in range(layers):
            for c in range(njobs):
                hr_job_bind(&job, (<const hr_job*>templates) + <int64_t>layer * njobs + c,
                            <const int64_t*>offsets, c, groups, group_rows, to_device)
                _grid(&job, width, mode, n)
