/* Small platform helpers for the tree core. */
#ifndef HIRADIX_PLATFORM_H
#define HIRADIX_PLATFORM_H

#include <stddef.h>
#include <stdint.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

/* Ask for transparent huge pages on the 2 MiB-aligned interior of a large buffer.
 * The span buffers grow to hundreds of MB on real traces; with 4 KiB pages the page
 * faults of first touch cost more than the inserts that write them. A no-op where
 * madvise or MADV_HUGEPAGE is unavailable, or when the kernel says no. */
static inline void hr_advise_huge(void *p, size_t n)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t hi = ((uintptr_t)p + n) & ~(huge - 1);
    if (p != NULL && hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

#endif
