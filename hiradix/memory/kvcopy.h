/* One thread's share of a KV row copy: the bodies of the CUDA gather/scatter kernel
 * (_kvcopy_cuda.cu) and of its CPU emulation (_kvcopy_emu.pyx), so that CI, which has
 * no GPU, runs the exact index arithmetic the GPU runs.
 *
 * A job moves `groups * group_rows` rows of `row_bytes` bytes. Row k of group g goes from
 * src + src_off[g] + k * src_row_stride to dst + dst_off[g] + k * dst_row_stride. One row
 * is one token's KV of one (layer, component); a group is a page where whole pages move
 * (the offsets are then one per page: the plan, hiradix.memory.kernel, is O(pages)), a
 * single row otherwise. The offsets say where each group sits in the device pool and in
 * the host layout, the same for every layer: a layer only moves the two base pointers.
 *
 * Rows are cut into chunks of W bytes (16 where everything is 16-byte aligned: one 128-bit
 * load and store per chunk). Two ways to share them among threads:
 *
 * hr_copy_<W> ("wide")   chunk j goes to thread j mod nthreads: consecutive threads take
 *                        consecutive chunks of a row, so a warp reads and writes whole rows
 *                        at once (coalesced), wherever the rows sit. Many blocks.
 * hr_rows_<W> ("warp")   a warp per row: warp w takes rows w, w + nwarps, ...; its lanes
 *                        take the row's chunks. Meant for few blocks (2-4 per component)
 *                        beside a forward pass; loads and stores are streaming (evict-first)
 *                        so the copy does not push the forward's data out of L2.
 *
 * Each thread first loads HR_UNROLL chunks (HR_UNROLL * nthreads apart, or from HR_UNROLL
 * rows) into registers and then stores them: the loads of a zero-copy read from pinned host
 * memory cross PCIe and take microseconds, and a thread that waited for each before issuing
 * the next would leave the link idle. Chunks never overlap, so the threads may run in any
 * order: the emulation runs them one after another.
 */
#ifndef HIRADIX_KVCOPY_H
#define HIRADIX_KVCOPY_H

#include <stdint.h>

#ifdef __CUDACC__
#define HR_FN __device__ __forceinline__
#define HR_HOST_FN static inline __host__
#define HR_LOAD(T, dst, p) ((dst) = *(const T*)(p))
#define HR_STORE(T, p, v) (*(T*)(p) = (v))
#define HR_LOAD_CS(T, dst, p) ((dst) = __ldcs((const T*)(p)))
#define HR_STORE_CS(T, p, v) __stcs((T*)(p), (v))
#else
#include <string.h>
#define HR_FN static inline
#define HR_HOST_FN static inline
/* memcpy, not a cast: the host buffers are bytes, and C's aliasing rules forbid reading
 * them through another type (the compiler turns a fixed-size memcpy into one move). */
#define HR_LOAD(T, dst, p) memcpy(&(dst), (p), sizeof(T))
#define HR_STORE(T, p, v) memcpy((p), &(v), sizeof(T))
#define HR_LOAD_CS(T, dst, p) HR_LOAD(T, dst, p)
#define HR_STORE_CS(T, p, v) HR_STORE(T, p, v)
#endif

#define HR_UNROLL 4
#define HR_WARP 32

/* Kernel modes (hr_kvcopy_launch*'s `mode`). */
#define HR_MODE_WIDE 0
#define HR_MODE_WARP 1

typedef struct {
    uint8_t* dst;           /* base of the destination region (device or mapped host address) */
    const uint8_t* src;     /* base of the source region */
    const int64_t* dst_off; /* [groups] byte offset of each group's first row from dst */
    const int64_t* src_off; /* [groups] byte offset of each group's first row from src */
    int64_t groups;         /* groups to copy */
    int64_t group_rows;     /* rows per group, >= 1 */
    int64_t dst_row_stride; /* bytes between two rows of a group at the destination */
    int64_t src_row_stride; /* bytes between two rows of a group at the source */
    int64_t row_bytes;      /* bytes per row, a multiple of the chunk width */
} hr_job;

/* The job of component `c` of one operation: `tmpl` (bases, strides and row size of one
 * layer) bound to the operation's offsets. `offsets` holds, per component c, the device
 * offsets at [2c * groups] and the host offsets at [(2c + 1) * groups]; `to_device` says
 * which side is the destination. Shared by the CUDA launcher and the emulation. */
HR_HOST_FN void hr_job_bind(hr_job* out, const hr_job* tmpl, const int64_t* offsets, int c, int64_t groups,
                            int64_t group_rows, int to_device) {
    const int64_t* dev = offsets + (int64_t)(2 * c) * groups;
    const int64_t* host = offsets + (int64_t)(2 * c + 1) * groups;
    *out = *tmpl;
    out->dst_off = to_device ? dev : host;
    out->src_off = to_device ? host : dev;
    out->groups = groups;
    out->group_rows = group_rows;
}

/* Byte offsets of row `row` of `job` from its two bases. */
HR_FN void hr_row_at(const hr_job* job, int64_t row, int64_t* dst_at, int64_t* src_at) {
    int64_t g = row, k = 0;
    if (job->group_rows > 1) {
        g = row / job->group_rows;
        k = row - g * job->group_rows;
    }
    *dst_at = job->dst_off[g] + k * job->dst_row_stride;
    *src_at = job->src_off[g] + k * job->src_row_stride;
}

/* hr_copy_<W>(job, tid, nthreads): the chunks of `job` that thread `tid` of `nthreads`
 * copies ("wide"), with chunk type T of W bytes. The caller guarantees W divides
 * row_bytes, both bases, every offset and both row strides. */
#define HR_DEFINE_COPY(NAME, T)                                                            \
    HR_FN void NAME(const hr_job* job, int64_t tid, int64_t nthreads) {                    \
        const int64_t per_row = job->row_bytes / (int64_t)sizeof(T);                       \
        const int64_t total = job->groups * job->group_rows * per_row;                     \
        for (int64_t base = tid; base < total; base += nthreads * HR_UNROLL) {             \
            T v[HR_UNROLL];                                                                \
            int64_t at[HR_UNROLL];                                                         \
            for (int u = 0; u < HR_UNROLL; ++u) {                                          \
                const int64_t j = base + u * nthreads;                                     \
                if (j < total) {                                                           \
                    const int64_t row = j / per_row;                                       \
                    const int64_t k = (j - row * per_row) * (int64_t)sizeof(T);            \
                    int64_t src_at;                                                        \
                    hr_row_at(job, row, &at[u], &src_at);                                  \
                    at[u] += k;                                                            \
                    HR_LOAD(T, v[u], job->src + src_at + k);                               \
                }                                                                          \
            }                                                                              \
            for (int u = 0; u < HR_UNROLL; ++u) {                                          \
                if (base + u * nthreads < total) HR_STORE(T, job->dst + at[u], v[u]);     \
            }                                                                              \
        }                                                                                  \
    }

/* hr_rows_<W>(job, warp, nwarps, lane): the chunks lane `lane` of warp `warp` (of `nwarps`)
 * copies ("warp"): chunks lane, lane + 32, ... of rows warp, warp + nwarps, ..., HR_UNROLL
 * rows loaded before any is stored. Same guarantees from the caller as hr_copy_<W>. */
#define HR_DEFINE_ROWS(NAME, T)                                                            \
    HR_FN void NAME(const hr_job* job, int64_t warp, int64_t nwarps, int lane) {          \
        const int64_t per_row = job->row_bytes / (int64_t)sizeof(T);                       \
        const int64_t rows = job->groups * job->group_rows;                                \
        for (int64_t r0 = warp; r0 < rows; r0 += nwarps * HR_UNROLL) {                     \
            int64_t d[HR_UNROLL], s[HR_UNROLL];                                            \
            for (int u = 0; u < HR_UNROLL; ++u) {                                          \
                const int64_t row = r0 + u * nwarps;                                       \
                if (row < rows) hr_row_at(job, row, &d[u], &s[u]);                        \
            }                                                                              \
            for (int64_t k = lane; k < per_row; k += HR_WARP) {                            \
                const int64_t kb = k * (int64_t)sizeof(T);                                 \
                T v[HR_UNROLL];                                                            \
                for (int u = 0; u < HR_UNROLL; ++u) {                                      \
                    if (r0 + u * nwarps < rows) HR_LOAD_CS(T, v[u], job->src + s[u] + kb); \
                }                                                                          \
                for (int u = 0; u < HR_UNROLL; ++u) {                                      \
                    if (r0 + u * nwarps < rows) HR_STORE_CS(T, job->dst + d[u] + kb, v[u]); \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }

#ifdef __CUDACC__
typedef uint4 hr_w16;
typedef uint2 hr_w8;
typedef unsigned int hr_w4;
typedef unsigned short hr_w2;
typedef unsigned char hr_w1;
#else
typedef struct { uint64_t lo, hi; } __attribute__((aligned(16))) hr_w16;
typedef struct { uint32_t lo, hi; } __attribute__((aligned(8))) hr_w8;
typedef uint32_t hr_w4;
typedef uint16_t hr_w2;
typedef uint8_t hr_w1;
#endif

HR_DEFINE_COPY(hr_copy_16, hr_w16)
HR_DEFINE_COPY(hr_copy_8, hr_w8)
HR_DEFINE_COPY(hr_copy_4, hr_w4)
HR_DEFINE_COPY(hr_copy_2, hr_w2)
HR_DEFINE_COPY(hr_copy_1, hr_w1)

HR_DEFINE_ROWS(hr_rows_16, hr_w16)
HR_DEFINE_ROWS(hr_rows_8, hr_w8)
HR_DEFINE_ROWS(hr_rows_4, hr_w4)
HR_DEFINE_ROWS(hr_rows_2, hr_w2)
HR_DEFINE_ROWS(hr_rows_1, hr_w1)

#endif /* HIRADIX_KVCOPY_H */
