# cython: language_level=3
"""CPU emulation of the CUDA KV copy kernel (``_kvcopy_cuda.cu``), for CI.

:func:`launch` takes what the kernel's launcher takes (the job array of one layer, the
chunk width and the grid) and runs every thread of the grid one after another, each
through the same ``kvcopy.h`` routine the GPU threads run. Chunks never overlap, so
sequential threads give the bytes the parallel ones do: a test that compares this with the
torch path checks the kernel's index arithmetic, the plan built for it
(:mod:`hiradix.memory.kernel`) and the width and grid choices, everywhere but on the GPU.

Addresses are raw: only the planner in :mod:`hiradix.memory.kernel`, which builds the jobs
from live tensors and checks every row against its buffer, should call it.
"""

from libc.stdint cimport int64_t, uintptr_t

cdef extern from "kvcopy.h" nogil:
    ctypedef struct hr_job:
        pass
    void hr_copy_16(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_copy_8(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_copy_4(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_copy_2(const hr_job* job, int64_t tid, int64_t nthreads)
    void hr_copy_1(const hr_job* job, int64_t tid, int64_t nthreads)


def launch(uintptr_t jobs, int njobs, int width, int blocks, int threads):
    """Run the kernel's grid on the CPU: ``blocks x threads`` threads for each of the
    ``njobs`` ``hr_job`` records at address ``jobs``, chunks of ``width`` bytes."""
    if width not in (1, 2, 4, 8, 16):
        raise ValueError(f"width must be 1, 2, 4, 8 or 16, got {width}")
    if not 1 <= njobs <= 4 or blocks < 1 or not 32 <= threads <= 1024:
        raise ValueError(f"bad launch: {njobs} jobs, {blocks} blocks of {threads} threads")
    cdef const hr_job* job
    cdef int64_t n = <int64_t>blocks * threads
    cdef int64_t tid
    cdef int i
    with nogil:
        for i in range(njobs):
            job = (<const hr_job*>jobs) + i
            for tid in range(n):
                if width == 16:
                    hr_copy_16(job, tid, n)
                elif width == 8:
                    hr_copy_8(job, tid, n)
                elif width == 4:
                    hr_copy_4(job, tid, n)
                elif width == 2:
                    hr_copy_2(job, tid, n)
                else:
                    hr_copy_1(job, tid, n)
