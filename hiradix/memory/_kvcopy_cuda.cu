// The CUDA gather/scatter kernel for KV pages between a device pool and a pinned host
// pool, built by setup.py when nvcc is found and loaded with ctypes by
// hiradix.memory.kernel (a plain C ABI: no torch headers, so one build serves every torch).
//
// The kernel reads (load) or writes (backup) the host pool in place through its mapped
// device address: no staging buffer, no host thread touching the bytes. Its bodies are in
// kvcopy.h, shared with the CPU emulation that CI runs.
//
// hr_kvcopy_launch_layers queues a whole operation in one call from Python: per layer, the
// optional test spin, the kernel and the layer's event, so the host's part of an operation
// is one plan and one call, whatever the layer count.
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
__device__ __forceinline__ void hr_wide(const hr_job* job, int64_t tid, int64_t n) {
    if (W == 16) hr_copy_16(job, tid, n);
    else if (W == 8) hr_copy_8(job, tid, n);
    else if (W == 4) hr_copy_4(job, tid, n);
    else if (W == 2) hr_copy_2(job, tid, n);
    else hr_copy_1(job, tid, n);
}

template <int W>
__device__ __forceinline__ void hr_warp(const hr_job* job, int64_t warp, int64_t nwarps, int lane) {
    if (W == 16) hr_rows_16(job, warp, nwarps, lane);
    else if (W == 8) hr_rows_8(job, warp, nwarps, lane);
    else if (W == 4) hr_rows_4(job, warp, nwarps, lane);
    else if (W == 2) hr_rows_2(job, warp, nwarps, lane);
    else hr_rows_1(job, warp, nwarps, lane);
}

// blockIdx.y picks the job (the component); blockIdx.x and the thread share its rows.
template <int W, int MODE>
__global__ void __launch_bounds__(1024) hr_copy_kernel(hr_jobs jobs) {
    const hr_job* job = &jobs.job[blockIdx.y];
    if (MODE == HR_MODE_WARP) {
        const int64_t warps_per_block = blockDim.x / HR_WARP;
        const int64_t warp = (int64_t)blockIdx.x * warps_per_block + threadIdx.x / HR_WARP;
        hr_warp<W>(job, warp, (int64_t)gridDim.x * warps_per_block, threadIdx.x % HR_WARP);
    } else {
        hr_wide<W>(job, (int64_t)blockIdx.x * blockDim.x + threadIdx.x, (int64_t)gridDim.x * blockDim.x);
    }
}

// The test seam's spin (CudaCopyEngine's layer_delay_cycles): one thread holds the stream.
__global__ void hr_spin_kernel(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

template <int MODE>
static void hr_launch_mode(const hr_jobs& arg, int width, dim3 grid, int threads, cudaStream_t s) {
    switch (width) {
        case 16: hr_copy_kernel<16, MODE><<<grid, threads, 0, s>>>(arg); break;
        case 8: hr_copy_kernel<8, MODE><<<grid, threads, 0, s>>>(arg); break;
        case 4: hr_copy_kernel<4, MODE><<<grid, threads, 0, s>>>(arg); break;
        case 2: hr_copy_kernel<2, MODE><<<grid, threads, 0, s>>>(arg); break;
        default: hr_copy_kernel<1, MODE><<<grid, threads, 0, s>>>(arg); break;
    }
}

static int hr_check(int njobs, int width, int mode, int blocks, int threads) {
    if (njobs < 1 || njobs > HR_MAX_JOBS || blocks < 1 || threads < 32 || threads > 1024 || threads % 32) {
        return (int)cudaErrorInvalidValue;
    }
    if (width != 16 && width != 8 && width != 4 && width != 2 && width != 1) return (int)cudaErrorInvalidValue;
    if (mode != HR_MODE_WIDE && mode != HR_MODE_WARP) return (int)cudaErrorInvalidValue;
    return (int)cudaSuccess;
}

static int hr_launch(const hr_jobs& arg, int njobs, int width, int mode, int blocks, int threads, cudaStream_t s) {
    const dim3 grid((unsigned)blocks, (unsigned)njobs);
    if (mode == HR_MODE_WARP) hr_launch_mode<HR_MODE_WARP>(arg, width, grid, threads, s);
    else hr_launch_mode<HR_MODE_WIDE>(arg, width, grid, threads, s);
    return (int)cudaGetLastError();
}

extern "C" {

// ABI version of this library; hiradix.memory.kernel refuses a library of another.
int hr_kvcopy_abi(void) { return 3; }

// Launch one copy of `njobs` bound jobs (one per component of a layer) on `stream`, with
// `blocks` blocks of `threads` threads per job, chunks of `width` bytes, in `mode`
// (HR_MODE_WIDE or HR_MODE_WARP). Returns a cudaError_t: the launch's, or
// cudaErrorInvalidValue for arguments out of range.
int hr_kvcopy_launch(const hr_job* jobs, int njobs, int width, int mode, int blocks, int threads, void* stream) {
    int rc = hr_check(njobs, width, mode, blocks, threads);
    if (rc) return rc;
    hr_jobs arg;
    for (int i = 0; i < njobs; ++i) arg.job[i] = jobs[i];
    return hr_launch(arg, njobs, width, mode, blocks, threads, (cudaStream_t)stream);
}

// A whole operation: for each of `layers` layers, `njobs` job templates at
// tmpl[layer * njobs ...] bound to the device-resident `offsets` (hr_job_bind), the spin
// (`delay_cycles` > 0), the launch, then cudaEventRecord(events[layer]) where events is
// not NULL; `start`, if not NULL, is recorded before the first layer. Returns a
// cudaError_t (the first failure; the layers before it are queued).
int hr_kvcopy_launch_layers(const hr_job* tmpl, int njobs, int layers, const int64_t* offsets, int64_t groups,
                            int64_t group_rows, int to_device, int width, int mode, int blocks, int threads,
                            long long delay_cycles, void* stream, void* start, void* const* events) {
    int rc = hr_check(njobs, width, mode, blocks, threads);
    if (rc) return rc;
    if (layers < 1 || groups < 1 || group_rows < 1) return (int)cudaErrorInvalidValue;
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e;
    if (start != NULL && (e = cudaEventRecord((cudaEvent_t)start, s)) != cudaSuccess) return (int)e;
    hr_jobs arg;
    for (int layer = 0; layer < layers; ++layer) {
        for (int c = 0; c < njobs; ++c) {
            hr_job_bind(&arg.job[c], &tmpl[(int64_t)layer * njobs + c], offsets, c, groups, group_rows, to_device);
        }
        if (delay_cycles > 0) {
            hr_spin_kernel<<<1, 1, 0, s>>>(delay_cycles);
            if ((e = cudaGetLastError()) != cudaSuccess) return (int)e;
        }
        if ((rc = hr_launch(arg, njobs, width, mode, blocks, threads, s)) != 0) return rc;
        if (events != NULL && events[layer] != NULL) {
            if ((e = cudaEventRecord((cudaEvent_t)events[layer], s)) != cudaSuccess) return (int)e;
        }
    }
    return (int)cudaSuccess;
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

// Whether this library's kernels can run on the current device: 0 where they can, else a
// cudaError_t (cudaErrorInsufficientDriver: a driver of an older CUDA major version than
// the runtime built in; cudaErrorNoKernelImageForDevice or cudaErrorInvalidDeviceFunction:
// no code for this GPU). `driver` and `runtime` receive the two CUDA versions.
int hr_kvcopy_probe(int* driver, int* runtime) {
    cudaError_t e;
    if ((e = cudaDriverGetVersion(driver)) != cudaSuccess) return (int)e;
    if ((e = cudaRuntimeGetVersion(runtime)) != cudaSuccess) return (int)e;
    if (*driver / 1000 < *runtime / 1000) return (int)cudaErrorInsufficientDriver;
    cudaFuncAttributes attr;
    return (int)cudaFuncGetAttributes(&attr, (const void*)hr_copy_kernel<16, HR_MODE_WARP>);
}

// The device address of pinned host memory `host` (cudaHostGetDevicePointer), for the
// kernel to read or write it in place.
int hr_kvcopy_host_pointer(void* host, void** device) {
    return (int)cudaHostGetDevicePointer(device, host, 0);
}

const char* hr_kvcopy_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
