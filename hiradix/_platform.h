/* Buffer allocation for the tree core's large arrays.
 *
 * The span buffers grow to hundreds of MB on real traces. With 4 KiB pages the page
 * faults of first touch cost several times more than the inserts that write them
 * (measured: 0.45 s of system time against 0.05 s of user time for 10k inserts), so on
 * Linux the buffers are anonymous mappings advised for transparent huge pages and grown
 * with mremap, which moves page tables instead of copying data. Elsewhere they are plain
 * realloc/free. Sizes are whatever the caller passes; the mapping rounds them up.
 */
#ifndef HIRADIX_PLATFORM_H
#define HIRADIX_PLATFORM_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sys/mman.h>
#endif

#define HR_HUGE ((size_t)2 << 20)

static inline size_t hr_round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

#if defined(__linux__) && defined(MREMAP_MAYMOVE)
static inline void hr_advise(void *p, size_t n)
{
#ifdef MADV_HUGEPAGE
    (void)madvise(p, n, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

/* Grow (or create, when old is NULL) a buffer from old_bytes to new_bytes, keeping its
 * contents. Returns NULL on failure, leaving the old buffer intact. Buffers under 2 MiB
 * stay on the heap, so the many small trees of a test suite cost no huge pages. */
static inline void *hr_buf_grow(void *old, size_t old_bytes, size_t new_bytes)
{
    void *p;
    size_t n;
    if (new_bytes < HR_HUGE)
        return realloc(old, new_bytes ? new_bytes : 1);
    n = hr_round_up(new_bytes, HR_HUGE);
    if (old_bytes < HR_HUGE) {
        p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
        hr_advise(p, n);
        if (old != NULL) {
            memcpy(p, old, old_bytes);
            free(old);
        }
        return p;
    }
    p = mremap(old, hr_round_up(old_bytes, HR_HUGE), n, MREMAP_MAYMOVE);
    if (p == MAP_FAILED)
        return NULL;
    hr_advise(p, n);
    return p;
}

static inline void hr_buf_free(void *p, size_t bytes)
{
    if (p == NULL)
        return;
    if (bytes < HR_HUGE)
        free(p);
    else
        munmap(p, hr_round_up(bytes, HR_HUGE));
}
#else
static inline void *hr_buf_grow(void *old, size_t old_bytes, size_t new_bytes)
{
    (void)old_bytes;
    return realloc(old, new_bytes ? new_bytes : 1);
}

static inline void hr_buf_free(void *p, size_t bytes)
{
    (void)bytes;
    free(p);
}
#endif

/* Widen n int32 slots to int64 (as hr_slots_out, below) into a destination that will not
 * be read again soon, with non-temporal stores where the CPU has them (x86-64: SSE2,
 * always there). A large eviction's result is written this way: plain stores first read
 * every destination line into the cache (the write-allocate), a third of the memory
 * traffic of a copy that misses the cache anyway. `dst` must be 8-byte aligned. Call
 * hr_stream_fence() after the last copy, before anything else may read the destination.
 * Elsewhere: the plain loop. */
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
static inline void hr_slots_out_stream(int64_t *dst, const int32_t *src, size_t n)
{
    __m128i v, sign;
    if (n && ((uintptr_t)dst & 15) != 0) { /* to a 16-byte boundary */
        _mm_stream_si64((long long *)dst, (long long)*src);
        dst++;
        src++;
        n--;
    }
    for (; n >= 4; n -= 4, dst += 4, src += 4) {
        v = _mm_loadu_si128((const __m128i *)(const void *)src);
        sign = _mm_srai_epi32(v, 31); /* the high halves: sign extension */
        _mm_stream_si128((__m128i *)(void *)dst, _mm_unpacklo_epi32(v, sign));
        _mm_stream_si128((__m128i *)(void *)(dst + 2), _mm_unpackhi_epi32(v, sign));
    }
    for (; n; n--, dst++, src++)
        _mm_stream_si64((long long *)dst, (long long)*src);
}
static inline void hr_stream_fence(void) { _mm_sfence(); }
#else
static inline void hr_slots_out_stream(int64_t *dst, const int32_t *src, size_t n)
{
    size_t k;
    for (k = 0; k < n; k++)
        dst[k] = src[k];
}
static inline void hr_stream_fence(void) {}
#endif

/* Narrow n int64 token ids to int32 (dst[k] = src[k]); returns the OR of every
 * (src[k] + 2**31) >> 32, which is zero exactly when all of them fit. No branch in the
 * inner loop, so it vectorizes. A match reads its key once, cold (the scheduler built
 * it elsewhere), and the hardware prefetchers stop at 4 KiB page boundaries: each page
 * of a long key would start with a miss. Prefetching one page ahead hides that: a
 * 1,343-token match 2.50 -> 2.29 us (bench/RESULTS_sglang_api.md, run 13). */
#define HR_NARROW_AHEAD 512 /* int64 ids: one 4 KiB page */
static inline uint64_t hr_narrow(const int64_t *src, int32_t *dst, size_t n)
{
    uint64_t high = 0;
    size_t k = 0, j;
    for (; k + 8 <= n; k += 8) {
#if defined(__GNUC__)
        /* a prefetch never faults, past the end included (an address, not a pointer) */
        __builtin_prefetch((const void *)((uintptr_t)(src + k) + HR_NARROW_AHEAD * sizeof *src), 0, 3);
#endif
        for (j = 0; j < 8; j++) {
            dst[k + j] = (int32_t)src[k + j];
            high |= ((uint64_t)src[k + j] + 2147483648u) >> 32;
        }
    }
    for (; k < n; k++) {
        dst[k] = (int32_t)src[k];
        high |= ((uint64_t)src[k] + 2147483648u) >> 32;
    }
    return high;
}

/* KV slots between the API (int64) and the tree's span buffers (int32): the narrowing
 * copy of slots already checked to fit (hr_high64 at every entry), and the widening one
 * out. Plain loops, no branch: both vectorize, at memcpy's speed on the sizes here. */
static inline void hr_slots_in(int32_t *dst, const int64_t *src, size_t n)
{
    size_t k;
    for (k = 0; k < n; k++)
        dst[k] = (int32_t)src[k];
}
static inline void hr_slots_out(int64_t *dst, const int32_t *src, size_t n)
{
    size_t k;
    for (k = 0; k < n; k++)
        dst[k] = src[k];
}

/* The OR of every (src[k] + 2**31) >> 32: zero exactly when all n ids fit int32 (as
 * hr_narrow's result, without writing them anywhere). */
static inline uint64_t hr_high64(const int64_t *src, size_t n)
{
    uint64_t high = 0;
    size_t k;
    for (k = 0; k < n; k++)
        high |= ((uint64_t)src[k] + 2147483648u) >> 32;
    return high;
}

#if defined(__GNUC__)
#define HR_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#else
#define HR_PREFETCH(p) ((void)0)
#endif
/* One span of a match of int64 key ids (SGLang's array('q') keys) against the tree's
 * int32 tokens, without narrowing the key into a buffer first: the length of the common
 * prefix of tree[:n] and key[:n]. Compared 64 at a time with no branch in the inner loop
 * (it vectorizes, the ids widened); an id beyond int32 equals no token, so it ends the
 * match like any other difference. The key, the span's tokens and the span's device
 * slots `dev` (which the match copies out next, and which nothing else reads before)
 * are all cold in a scheduler's match, and the hardware prefetchers stop at each 4 KiB
 * page: the three streams are prefetched ahead (addresses past the end included: a
 * prefetch never faults), so their misses overlap instead of coming one after another.
 * A NULL `dev` (a match that counts the slots without reading them) is not prefetched:
 * two streams, and 8 bytes a token less to bring in. */
#define HR_AHEAD_KEY 512 /* int64 ids: 4 KiB */
#define HR_AHEAD_TOK 512 /* int32 tokens: 2 KiB */
#define HR_AHEAD_DEV 256 /* int64 slots: 2 KiB */
/* The first lines of a key about to be matched (up to 4 KiB), requested together before
 * the descent's first lookups (a hash slot, a node, its first tokens: each a miss that
 * waits for the one before), so that the key's misses overlap with theirs. */
static inline void hr_prefetch_key(const int64_t *key, size_t n)
{
    size_t j;
    for (j = 0; j < HR_AHEAD_KEY && j < n; j += 8)
        HR_PREFETCH((uintptr_t)(key + j));
}

static inline size_t hr_common64(const int32_t *tree, const int64_t *key, const int32_t *dev, size_t n)
{
    size_t i = 0, j;
    uint64_t diff;
    if (dev)
        for (j = 0; j < HR_AHEAD_DEV && j < n; j += 8) /* the slots the ahead-prefetch skips */
            HR_PREFETCH((uintptr_t)(dev + j));
    for (; i + 64 <= n; i += 64) {
        for (j = 0; j < 64; j += 8)
            HR_PREFETCH((uintptr_t)(key + i + j) + HR_AHEAD_KEY * sizeof *key);
        if (dev)
            for (j = 0; j < 64; j += 8)
                HR_PREFETCH((uintptr_t)(dev + i + j) + HR_AHEAD_DEV * sizeof *dev);
        for (j = 0; j < 64; j += 16)
            HR_PREFETCH((uintptr_t)(tree + i + j) + HR_AHEAD_TOK * sizeof *tree);
        diff = 0;
        for (j = 0; j < 64; j++)
            diff |= (uint64_t)(key[i + j] ^ (int64_t)tree[i + j]);
        if (diff)
            break;
    }
    while (i < n && key[i] == (int64_t)tree[i])
        i++;
    return i;
}

#endif
