// The CUDA gather/scatter kernel for KV pages between a device pool and a pinned host
// pool, built by setup.py when nvcc is found and loaded with ctypes by
// hiradix.memory.kernel (a plain C ABI: no torch headers, so one build serves every torch).
//
// The kernel reads (load) or writes (backup) the host pool in place through its mapped
// device address: no staging buffer, no host thread touching the bytes. Its body is
// kvcopy.h, shared with the CPU emulation that CI runs.
//
// hr_kvcopy_runs is the other way to move the same rows: runs of rows contiguous on both
// sides, handed to the GPU's copy engines in one batch (cudaMemcpyBatchAsync). No SM does
// the copy, so it does not compete with the forward pass for them.

#include <cuda_runtime.h>
#include <string.h>

#include "kvcopy.h"

#define HR_MAX_JOBS 4  // components of one layer: MHA K and V, MLA's latent

struct hr_jobs {
    hr_job job[HR_MAX_JOBS];
};

template <int W>
__global__ void hr_copy_kernel(hr_jobs jobs) {
    const hr_job* job = &jobs.job[blockIdx.y];
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
    if (W == 16) hr_copy_16(job, tid, nthreads);
    else if (W == 8) hr_copy_8(job, tid, nthreads);
    else if (W == 4) hr_copy_4(job, tid, nthreads);
    else if (W == 2) hr_copy_2(job, tid, nthreads);
    else hr_copy_1(job, tid, nthreads);
}

extern "C" {

// ABI version of this library; hiradix.memory.kernel refuses a library of another.
int hr_kvcopy_abi(void) { return 2; }

// Launch one copy of `njobs` jobs (one per component of a layer) on `stream`, with
// `blocks` blocks of `threads` threads per job and chunks of `width` bytes. Returns a
// cudaError_t: the launch's, or cudaErrorInvalidValue for arguments out of range.
int hr_kvcopy_launch(const hr_job* jobs, int njobs, int width, int blocks, int threads, void* stream) {
    if (njobs < 1 || njobs > HR_MAX_JOBS || blocks < 1 || threads < 32 || threads > 1024) {
        return (int)cudaErrorInvalidValue;
    }
    hr_jobs arg;
    for (int i = 0; i < njobs; ++i) arg.job[i] = jobs[i];
    const dim3 grid((unsigned)blocks, (unsigned)njobs);
    cudaStream_t s = (cudaStream_t)stream;
    switch (width) {
        case 16: hr_copy_kernel<16><<<grid, threads, 0, s>>>(arg); break;
        case 8: hr_copy_kernel<8><<<grid, threads, 0, s>>>(arg); break;
        case 4: hr_copy_kernel<4><<<grid, threads, 0, s>>>(arg); break;
        case 2: hr_copy_kernel<2><<<grid, threads, 0, s>>>(arg); break;
        case 1: hr_copy_kernel<1><<<grid, threads, 0, s>>>(arg); break;
        default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}

// Enqueue `count` copies on `stream` for the copy engines: copy i moves sizes[i] bytes
// from srcs[i] to dsts[i] (device or pinned host addresses; no two overlap). One batch
// where the runtime has cudaMemcpyBatchAsync (CUDA 12.8+), one cudaMemcpyAsync per copy
// before. Returns a cudaError_t.
int hr_kvcopy_runs(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count, void* stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (count == 0) return (int)cudaSuccess;
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr;
    memset(&attr, 0, sizeof(attr));
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // the source is written earlier on the stream
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;
#if CUDART_VERSION >= 13000
    return (int)cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &first, 1, s);
#else
    size_t failed = 0;
    return (int)cudaMemcpyBatchAsync((void**)dsts, (void**)srcs, (size_t*)sizes, count, &attr, &first, 1, &failed, s);
#endif
#else
    for (size_t i = 0; i < count; ++i) {
        cudaError_t e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, s);
        if (e != cudaSuccess) return (int)e;
    }
    return (int)cudaSuccess;
#endif
}

// The device address of pinned host memory `host` (cudaHostGetDevicePointer), for the
// kernel to read or write it in place.
int hr_kvcopy_host_pointer(void* host, void** device) {
    return (int)cudaHostGetDevicePointer(device, host, 0);
}

const char* hr_kvcopy_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
