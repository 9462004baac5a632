/*
 * _crc32.h -- header-only CRC-32 (zlib's polynomial and values) for hiradix's slot checks.
 *
 * API (all static; one translation unit includes it: hiradix/peer/_verify.pyx):
 *   hrx_crc_init()                   fill the slice-by-8 tables and read the CPU's features
 *                                    (cpuid); call once before hrx_crc32.
 *   hrx_crc32(crc, p, n)             zlib's crc32(crc, p, n).
 *   hrx_have_clmul, hrx_have_vclmul  which folding paths serve (128-bit PCLMULQDQ; 256-bit
 *                                    VPCLMULQDQ with AVX2); a test may clear hrx_have_vclmul.
 *
 * Long buffers fold with carry-less multiplies where the CPU has them, else slice-by-8
 * tables; the x86 paths are compiled with per-function target attributes, so the file
 * builds with the default flags and picks a path at run time.
 */
#ifndef HIRADIX_CRC32_H
#define HIRADIX_CRC32_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define HRX_X86 1
#else
#define HRX_X86 0
#endif

static uint32_t hrx_crc_table[8][256];
static int hrx_have_clmul = 0;
static int hrx_have_vclmul = 0;

#if HRX_X86
static unsigned long long hrx_xcr0(void) {  /* which register states the OS saves */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}
#endif

static void hrx_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        hrx_crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            hrx_crc_table[t][i] = (hrx_crc_table[t - 1][i] >> 8) ^
                                  hrx_crc_table[0][hrx_crc_table[t - 1][i] & 0xff];
#if HRX_X86
    unsigned a, b, c, d;
    /* CPUID.1:ECX bit 1 = PCLMULQDQ, bit 19 = SSE4.1 */
    hrx_have_clmul = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 1)) && (c & (1u << 19));
    /* CPUID.1:ECX bit 27 OSXSAVE + XCR0 ymm state, CPUID.7.0:EBX bit 5 AVX2,
       CPUID.7.0:ECX bit 10 VPCLMULQDQ */
    if (hrx_have_clmul && (c & (1u << 27)) && ((hrx_xcr0() & 6) == 6) &&
            __get_cpuid_count(7, 0, &a, &b, &c, &d))
        hrx_have_vclmul = (b & (1u << 5)) && (c & (1u << 10));
#endif
}

/* Slice-by-8 on the inverted state. */
static uint32_t hrx_crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = hrx_crc_table[7][lo & 0xff] ^ hrx_crc_table[6][(lo >> 8) & 0xff] ^
              hrx_crc_table[5][(lo >> 16) & 0xff] ^ hrx_crc_table[4][lo >> 24] ^
              hrx_crc_table[3][hi & 0xff] ^ hrx_crc_table[2][(hi >> 8) & 0xff] ^
              hrx_crc_table[1][(hi >> 16) & 0xff] ^ hrx_crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ hrx_crc_table[0][(crc ^ *p++) & 0xff];
    return crc;
}

#if HRX_X86
/* The bulk of long buffers: eight 128-bit lanes (four 256-bit registers, two lanes
   each) folded forward by 1024 bits per 128-byte step with VPCLMULQDQ, then folded
   pairwise by 512 bits into the four-lane state that hrx_crc_clmul continues from.
   The constants are x^(1024+32) and x^(1024-32) mod P, bit-reflected and shifted
   left by one, as for the 512-bit ones below. len >= 256; consumes a multiple of 128
   bytes and leaves the four lanes in out[0..3]. */
__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1")))
static size_t hrx_crc_wide(uint32_t crc, const uint8_t *buf, size_t len, __m128i out[4]) {
    const __m256i k = _mm256_set_epi64x(0x014a7fe880LL, 0x01e88ef372LL, 0x014a7fe880LL, 0x01e88ef372LL);
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    __m256i y0 = _mm256_loadu_si256((const __m256i *)(buf + 0x00));
    __m256i y1 = _mm256_loadu_si256((const __m256i *)(buf + 0x20));
    __m256i y2 = _mm256_loadu_si256((const __m256i *)(buf + 0x40));
    __m256i y3 = _mm256_loadu_si256((const __m256i *)(buf + 0x60));
    y0 = _mm256_xor_si256(y0, _mm256_castsi128_si256(_mm_cvtsi32_si128((int)crc)));
    size_t done = 128;
    while (len - done >= 128) {
        const uint8_t *p = buf + done;
        __m256i l0 = _mm256_clmulepi64_epi128(y0, k, 0x00), h0 = _mm256_clmulepi64_epi128(y0, k, 0x11);
        __m256i l1 = _mm256_clmulepi64_epi128(y1, k, 0x00), h1 = _mm256_clmulepi64_epi128(y1, k, 0x11);
        __m256i l2 = _mm256_clmulepi64_epi128(y2, k, 0x00), h2 = _mm256_clmulepi64_epi128(y2, k, 0x11);
        __m256i l3 = _mm256_clmulepi64_epi128(y3, k, 0x00), h3 = _mm256_clmulepi64_epi128(y3, k, 0x11);
        y0 = _mm256_xor_si256(_mm256_xor_si256(l0, h0), _mm256_loadu_si256((const __m256i *)(p + 0x00)));
        y1 = _mm256_xor_si256(_mm256_xor_si256(l1, h1), _mm256_loadu_si256((const __m256i *)(p + 0x20)));
        y2 = _mm256_xor_si256(_mm256_xor_si256(l2, h2), _mm256_loadu_si256((const __m256i *)(p + 0x40)));
        y3 = _mm256_xor_si256(_mm256_xor_si256(l3, h3), _mm256_loadu_si256((const __m256i *)(p + 0x60)));
        done += 128;
    }
    /* Lanes in stream order: y0 = (c0, c1), y1 = (c2, c3), y2 = (c4, c5), y3 = (c6, c7).
       Fold c0..c3 forward by 512 bits onto c4..c7. */
    __m128i c[8] = {
        _mm256_castsi256_si128(y0), _mm256_extracti128_si256(y0, 1),
        _mm256_castsi256_si128(y1), _mm256_extracti128_si256(y1, 1),
        _mm256_castsi256_si128(y2), _mm256_extracti128_si256(y2, 1),
        _mm256_castsi256_si128(y3), _mm256_extracti128_si256(y3, 1),
    };
    for (int j = 0; j < 4; j++)
        out[j] = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(c[j], k1k2, 0x00),
                                             _mm_clmulepi64_si128(c[j], k1k2, 0x11)), c[j + 4]);
    return done;
}

/* Folding by 4 x 128 bits with carry-less multiplies, then Barrett reduction (the
   published method for the reflected CRC-32 polynomial). len >= 64, len % 16 == 0;
   crc is the inverted state. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t hrx_crc_clmul(uint32_t crc, const uint8_t *buf, size_t len) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
    const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;
    if (hrx_have_vclmul && len >= 256) {
        __m128i lanes[4];
        size_t used = hrx_crc_wide(crc, buf, len, lanes);
        x1 = lanes[0]; x2 = lanes[1]; x3 = lanes[2]; x4 = lanes[3];
        buf += used;
        len -= used;
    } else {
        x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
        buf += 64;
        len -= 64;
    }
    x0 = k1k2;
    while (len >= 64) {
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }
    x0 = k3k4;
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x1 = _mm_srli_si128(x1, 8);
    x1 = _mm_xor_si128(x1, x2);
    x0 = k5k0;
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    x0 = poly;
    x2 = _mm_and_si128(x1, mask32);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, mask32);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

/* zlib's crc32(crc, p, n) semantics. */
static uint32_t hrx_crc32(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
#if HRX_X86
    if (hrx_have_clmul && n >= 64) {
        size_t m = n & ~(size_t)15;
        crc = hrx_crc_clmul(crc, p, m);
        p += m;
        n -= m;
    }
#endif
    return ~hrx_crc_sw(crc, p, n);
}

#endif /* HIRADIX_CRC32_H */
