/* One thread's share of a KV row copy: the body of the CUDA gather/scatter kernel
 * (_kvcopy_cuda.cu) and of its CPU emulation (_kvcopy_emu.pyx), so that CI, which has
 * no GPU, runs the exact index arithmetic the GPU runs.
 *
 * A job moves `rows` rows of `row_bytes` bytes: row i from src + src_off[i] to
 * dst + dst_off[i]. One row is one token's KV of one (layer, component); the offsets say
 * where that token sits in the device pool and in the host layout (hiradix.memory.copy
 * plans them once per operation; the layer only moves the two base pointers). A row is
 * cut into chunks of W bytes (16 where everything is 16-byte aligned: one 128-bit load
 * and store per chunk) and chunk j = row * chunks_per_row + k goes to thread
 * j mod nthreads: consecutive threads take consecutive chunks of a row, so a warp reads
 * and writes whole rows at once (coalesced), wherever the rows sit.
 *
 * Each thread first loads HR_UNROLL chunks (HR_UNROLL * nthreads apart) into registers
 * and then stores them: the loads of a zero-copy read from pinned host memory cross
 * PCIe and take microseconds, and a thread that waited for each before issuing the next
 * would leave the link idle. Chunks never overlap, so the threads may run in any order:
 * the emulation runs them one after another.
 */
#ifndef HIRADIX_KVCOPY_H
#define HIRADIX_KVCOPY_H

#include <stdint.h>

#ifdef __CUDACC__
#define HR_FN __device__ __forceinline__
#define HR_LOAD(T, dst, p) ((dst) = *(const T*)(p))
#define HR_STORE(T, p, v) (*(T*)(p) = (v))
#else
#include <string.h>
#define HR_FN static inline
/* memcpy, not a cast: the host buffers are bytes, and C's aliasing rules forbid reading
 * them through another type (the compiler turns a fixed-size memcpy into one move). */
#define HR_LOAD(T, dst, p) memcpy(&(dst), (p), sizeof(T))
#define HR_STORE(T, p, v) memcpy((p), &(v), sizeof(T))
#endif

#define HR_UNROLL 4

typedef struct {
    uint8_t* dst;           /* base of the destination region (device or mapped host address) */
    const uint8_t* src;     /* base of the source region */
    const int64_t* dst_off; /* [rows] byte offset of each row from dst */
    const int64_t* src_off; /* [rows] byte offset of each row from src */
    int64_t rows;           /* rows to copy */
    int64_t row_bytes;      /* bytes per row, a multiple of the chunk width */
} hr_job;

/* hr_copy_<W>(job, tid, nthreads): the chunks of `job` that thread `tid` of `nthreads`
 * copies, with chunk type T of W bytes. The caller guarantees W divides row_bytes,
 * both bases and every offset. */
#define HR_DEFINE_COPY(NAME, T)                                                            \
    HR_FN void NAME(const hr_job* job, int64_t tid, int64_t nthreads) {                    \
        const int64_t per_row = job->row_bytes / (int64_t)sizeof(T);                       \
        const int64_t total = job->rows * per_row;                                         \
        for (int64_t base = tid; base < total; base += nthreads * HR_UNROLL) {             \
            T v[HR_UNROLL];                                                                \
            int64_t at[HR_UNROLL];                                                         \
            for (int u = 0; u < HR_UNROLL; ++u) {                                          \
                const int64_t j = base + u * nthreads;                                     \
                if (j < total) {                                                           \
                    const int64_t row = j / per_row;                                       \
                    const int64_t k = j - row * per_row;                                   \
                    at[u] = job->dst_off[row] + k * (int64_t)sizeof(T);                    \
                    HR_LOAD(T, v[u], job->src + job->src_off[row] + k * (int64_t)sizeof(T));  \
                }                                                                          \
            }                                                                              \
            for (int u = 0; u < HR_UNROLL; ++u) {                                          \
                if (base + u * nthreads < total) HR_STORE(T, job->dst + at[u], v[u]);     \
            }                                                                              \
        }                                                                                  \
    }

#ifdef __CUDACC__
typedef uint4 hr_w16;
typedef uint2 hr_w8;
#else
typedef struct { uint64_t lo, hi; } __attribute__((aligned(16))) hr_w16;
typedef struct { uint32_t lo, hi; } __attribute__((aligned(8))) hr_w8;
#endif

HR_DEFINE_COPY(hr_copy_16, hr_w16)
HR_DEFINE_COPY(hr_copy_8, hr_w8)
HR_DEFINE_COPY(hr_copy_4, uint32_t)
HR_DEFINE_COPY(hr_copy_2, uint16_t)
HR_DEFINE_COPY(hr_copy_1, uint8_t)

#endif /* HIRADIX_KVCOPY_H */
