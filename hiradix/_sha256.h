/*
 * _sha256.h -- header-only SHA-256 for hiradix page hashing.
 *
 * API (all functions are static; include this header in one or more C/Cython
 * translation units, each gets its own private copy):
 *
 *   hr_sha256(data, len, out)        one-shot SHA-256 of a byte buffer.
 *   hr_hash_pages(tokens, n_pages, page_size, prev, out)
 *                                    chained page digests (see below).
 *   hr_digest_hex(d, out)            32-byte digest -> 64 lowercase hex chars
 *                                    (no NUL terminator written).
 *   hr_sha256_accelerated()          1 if the x86 SHA-NI code path is used.
 *   hr_sha256_set_portable(on)       force (on!=0) / unforce the portable path
 *                                    (tests only; per translation unit, do not
 *                                    toggle while other threads hash). Compile-
 *                                    time: #define HR_SHA256_FORCE_PORTABLE.
 *
 * Chain format (bit-compatible with SGLang's get_hash_str):
 *   digest_0 = SHA256(le32(tok[0..P-1]))
 *   digest_i = SHA256(digest_{i-1} (32 raw bytes) || le32(page i tokens))
 * where le32() serialises each int32 token as the little-endian bytes of its
 * uint32 bit pattern. `prev` (may be NULL) is digest_{-1} for the first page,
 * so a chain can be continued across calls. `prev` may alias `out - 32`.
 *
 * Everything is pure C without allocation or global state other than the
 * cached CPU-feature flag, so it is safe to call without the Python GIL.
 */
#ifndef HIRADIX_SHA256_H
#define HIRADIX_SHA256_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && \
    (defined(__GNUC__) || defined(__clang__)) && !defined(HR_SHA256_FORCE_PORTABLE)
#define HR_SHA256_HAVE_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

/* Round constants (first 32 bits of the fractional parts of the cube roots of
 * the first 64 primes), FIPS 180-4. Aligned so the SIMD path can load them. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((aligned(16)))
#endif
static const uint32_t HR_SHA256_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static const uint32_t HR_SHA256_IV[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

/* Both compression functions take the 16 message words as host-order integer
 * VALUES (word = big-endian reading of 4 message bytes). Working on values
 * rather than bytes makes every conversion below endian-independent, and lets
 * the chained path feed the previous state words straight back in. */
typedef void (*hr_sha256_compress_fn)(uint32_t st[8], const uint32_t w[16]);

/* Shift-based on purpose: endian-independent, and compilers emit bswap/movbe. */
static inline uint32_t hr_sha256_bswap(uint32_t x) {
    return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
}
static inline uint32_t hr_sha256_load_be(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline void hr_sha256_store_be(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}

/* ---------------------------------------------------------------- portable */
#define HR_ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define HR_S0(x) (HR_ROR(x, 2) ^ HR_ROR(x, 13) ^ HR_ROR(x, 22))
#define HR_S1(x) (HR_ROR(x, 6) ^ HR_ROR(x, 11) ^ HR_ROR(x, 25))
#define HR_s0(x) (HR_ROR(x, 7) ^ HR_ROR(x, 18) ^ ((x) >> 3))
#define HR_s1(x) (HR_ROR(x, 17) ^ HR_ROR(x, 19) ^ ((x) >> 10))
/* One round; instead of rotating eight variables we rotate the macro
 * arguments (8x unrolled), which keeps everything in registers. */
#define HR_ROUND(a, b, c, d, e, f, g, h, i)                                         \
    do {                                                                            \
        uint32_t t1_ = (h) + HR_S1(e) + ((g) ^ ((e) & ((f) ^ (g)))) + HR_SHA256_K[i] + w[(i) & 15]; \
        (d) += t1_;                                                                 \
        (h) = t1_ + HR_S0(a) + (((a) & (b)) | ((c) & ((a) | (b))));                 \
    } while (0)

static inline void hr_sha256_compress_portable(uint32_t st[8], const uint32_t in[16]) {
    uint32_t w[16], a = st[0], b = st[1], c = st[2], d = st[3];
    uint32_t e = st[4], f = st[5], g = st[6], h = st[7];
    int i, j;
    memcpy(w, in, sizeof w);
    for (i = 0; i < 64; i += 8) {
        if (i >= 16) /* expand the next 8 schedule words in the 16-word ring */
            for (j = i; j < i + 8; j++)
                w[j & 15] += HR_s1(w[(j + 14) & 15]) + w[(j + 9) & 15] + HR_s0(w[(j + 1) & 15]);
        HR_ROUND(a, b, c, d, e, f, g, h, i + 0);
        HR_ROUND(h, a, b, c, d, e, f, g, i + 1);
        HR_ROUND(g, h, a, b, c, d, e, f, i + 2);
        HR_ROUND(f, g, h, a, b, c, d, e, i + 3);
        HR_ROUND(e, f, g, h, a, b, c, d, i + 4);
        HR_ROUND(d, e, f, g, h, a, b, c, i + 5);
        HR_ROUND(c, d, e, f, g, h, a, b, i + 6);
        HR_ROUND(b, c, d, e, f, g, h, a, i + 7);
    }
    st[0] += a; st[1] += b; st[2] += c; st[3] += d;
    st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

/* ------------------------------------------------------------------ SHA-NI */
#ifdef HR_SHA256_HAVE_SHANI
#define HR_SHANI_TARGET __attribute__((target("sha,sse4.1,ssse3")))

/* Four rounds: sha256rnds2 does two rounds using the low two lanes of wk and
 * returns the new {A,B,E,F}; the old {A,B,E,F} becomes the new {C,D,G,H},
 * hence the alternating argument order. */
#define HR_NI_R4(m, grp)                                                          \
    do {                                                                          \
        __m128i wk_ = _mm_add_epi32((m), _mm_load_si128((const __m128i *)&HR_SHA256_K[4 * (grp)])); \
        cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk_);                            \
        abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk_, 0x0E));   \
    } while (0)
/* Next 4 schedule words from W[t-16..] (a), W[t-12..] (b), W[t-8..] (c),
 * W[t-4..] (d): msg1 adds sigma0, alignr supplies W[t-7..t-4], msg2 adds
 * sigma1 (including the in-vector dependency). Result replaces a. */
#define HR_NI_SCHED(a, b, c, d) \
    (a) = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32((a), (b)), _mm_alignr_epi8((d), (c), 4)), (d))

/* One block: 64 rounds on state {abef, cdgh} with message vectors m0..m3
 * (m0 = W0..W3 in lanes 0..3, etc.), plus the final feed-forward addition. */
__attribute__((always_inline)) HR_SHANI_TARGET
static inline void hr_sha256_ni_block(__m128i *pabef, __m128i *pcdgh,
                                      __m128i m0, __m128i m1, __m128i m2, __m128i m3) {
    __m128i abef = *pabef, cdgh = *pcdgh;
    int g;
    HR_NI_R4(m0, 0); HR_NI_R4(m1, 1); HR_NI_R4(m2, 2); HR_NI_R4(m3, 3);
    for (g = 4; g < 16; g += 4) {
        HR_NI_SCHED(m0, m1, m2, m3); HR_NI_R4(m0, g);
        HR_NI_SCHED(m1, m2, m3, m0); HR_NI_R4(m1, g + 1);
        HR_NI_SCHED(m2, m3, m0, m1); HR_NI_R4(m2, g + 2);
        HR_NI_SCHED(m3, m0, m1, m2); HR_NI_R4(m3, g + 3);
    }
    *pabef = _mm_add_epi32(abef, *pabef);
    *pcdgh = _mm_add_epi32(cdgh, *pcdgh);
}

/* SHA-NI keeps the state as {F,E,B,A} and {H,G,D,C} (lane 0 first); these
 * convert from/to the natural {A,B,C,D} {E,F,G,H} word order. */
#define HR_NI_TO_ABEF(abcd, efgh, abef, cdgh)                           \
    ((abef) = _mm_shuffle_epi32(_mm_unpacklo_epi64((efgh), (abcd)), 0xB1), \
     (cdgh) = _mm_shuffle_epi32(_mm_unpackhi_epi64((efgh), (abcd)), 0xB1))
#define HR_NI_FROM_ABEF(abef, cdgh, abcd, efgh)                        \
    ((abef) = _mm_shuffle_epi32((abef), 0xB1), (cdgh) = _mm_shuffle_epi32((cdgh), 0xB1), \
     (abcd) = _mm_unpackhi_epi64((abef), (cdgh)), (efgh) = _mm_unpacklo_epi64((abef), (cdgh)))

HR_SHANI_TARGET
static inline void hr_sha256_compress_shani(uint32_t st[8], const uint32_t in[16]) {
    __m128i abcd = _mm_loadu_si128((const __m128i *)st), efgh = _mm_loadu_si128((const __m128i *)(st + 4));
    __m128i abef, cdgh;
    HR_NI_TO_ABEF(abcd, efgh, abef, cdgh);
    /* Message words are already values, so a plain load gives lanes W0..W3. */
    hr_sha256_ni_block(&abef, &cdgh, _mm_loadu_si128((const __m128i *)in),
                       _mm_loadu_si128((const __m128i *)(in + 4)),
                       _mm_loadu_si128((const __m128i *)(in + 8)),
                       _mm_loadu_si128((const __m128i *)(in + 12)));
    HR_NI_FROM_ABEF(abef, cdgh, abcd, efgh);
    _mm_storeu_si128((__m128i *)st, abcd);
    _mm_storeu_si128((__m128i *)(st + 4), efgh);
}

/* Message vector for token index q of an n-token page (LE tokens byte-swapped
 * into word values). The padding 0x80 byte follows the last token; since
 * tokens are 4 bytes it is always word-aligned, i.e. lane (n - q). */
__attribute__((always_inline)) HR_SHANI_TARGET
static inline __m128i hr_sha256_ni_tokvec(const int32_t *t, size_t n, size_t q, __m128i bswap) {
    __m128i v;
    if (q + 4 <= n) return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(t + q)), bswap);
    if (q > n) return _mm_setzero_si128();
    switch (n - q) { /* never read past the end of the token array */
    case 0: v = _mm_setr_epi32(0x80, 0, 0, 0); break;
    case 1: v = _mm_setr_epi32(t[q], 0x80, 0, 0); break;
    case 2: v = _mm_setr_epi32(t[q], t[q + 1], 0x80, 0); break;
    default: v = _mm_setr_epi32(t[q], t[q + 1], t[q + 2], 0x80); break;
    }
    return _mm_shuffle_epi8(v, bswap);
}

/* Whole chain on SHA-NI with the state and message kept in registers: the
 * digest is only turned into bytes for `out`. The prev digest always fills
 * exactly two vectors, so tokens start on a vector boundary in every page. */
HR_SHANI_TARGET
static void hr_hash_pages_shani(const int32_t *tok, size_t n_pages, size_t n, const uint8_t *prev,
                                uint8_t *out) {
    const __m128i bswap = _mm_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12);
    __m128i abcd = _mm_setzero_si128(), efgh = abcd, iv_abef, iv_cdgh, abef, cdgh, m0, m1, m2, m3;
    size_t p, b, q, nblk, pw = 0;
    uint64_t bits;
    HR_NI_TO_ABEF(_mm_loadu_si128((const __m128i *)HR_SHA256_IV),
                  _mm_loadu_si128((const __m128i *)(HR_SHA256_IV + 4)), iv_abef, iv_cdgh);
    if (prev) {
        abcd = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)prev), bswap);
        efgh = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(prev + 16)), bswap);
        pw = 8;
    }
    for (p = 0; p < n_pages; p++, tok += n, out += 32, pw = 8) {
        bits = ((uint64_t)pw + n) * 32;
        nblk = (pw + n + 3 + 15) / 16; /* words + pad word + 2 length words */
        abef = iv_abef; cdgh = iv_cdgh;
        for (b = 0, q = 0; b < nblk; b++) {
            if (b == 0 && pw) { m0 = abcd; m1 = efgh; }
            else { m0 = hr_sha256_ni_tokvec(tok, n, q, bswap); m1 = hr_sha256_ni_tokvec(tok, n, q + 4, bswap); q += 8; }
            m2 = hr_sha256_ni_tokvec(tok, n, q, bswap); m3 = hr_sha256_ni_tokvec(tok, n, q + 4, bswap); q += 8;
            if (b == nblk - 1) /* length always fits in lanes 2,3 of the last vector */
                m3 = _mm_or_si128(m3, _mm_setr_epi32(0, 0, (int)(uint32_t)(bits >> 32), (int)(uint32_t)bits));
            hr_sha256_ni_block(&abef, &cdgh, m0, m1, m2, m3);
        }
        HR_NI_FROM_ABEF(abef, cdgh, abcd, efgh);
        _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(abcd, bswap));
        _mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(efgh, bswap));
    }
}
#endif /* HR_SHA256_HAVE_SHANI */

/* ---------------------------------------------------------------- dispatch */
static int hr_sha256_cpu_flag = -1; /* -1 unknown, 0 no SHA-NI, 1 SHA-NI */
static int hr_sha256_forced_portable = 0;

static inline int hr_sha256_detect(void) {
#ifdef HR_SHA256_HAVE_SHANI
    unsigned a, b, c, d;
    /* SHA = CPUID.(7,0):EBX[29]; SSSE3 = CPUID.1:ECX[9]; SSE4.1 = CPUID.1:ECX[19]. */
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 9)) && (c & (1u << 19)) &&
           __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29));
#else
    return 0;
#endif
}

/* Benign race: concurrent first callers all compute and store the same value. */
static inline int hr_sha256_accelerated(void) {
    int f = hr_sha256_cpu_flag;
    if (f < 0) hr_sha256_cpu_flag = f = hr_sha256_detect();
    return f && !hr_sha256_forced_portable;
}

static inline void hr_sha256_set_portable(int on) { hr_sha256_forced_portable = on ? 1 : 0; }

static inline hr_sha256_compress_fn hr_sha256_pick(void) {
#ifdef HR_SHA256_HAVE_SHANI
    if (hr_sha256_accelerated()) return hr_sha256_compress_shani;
#endif
    return hr_sha256_compress_portable;
}

static inline void hr_sha256_state_out(const uint32_t st[8], uint8_t out[32]) {
    int i;
    for (i = 0; i < 8; i++) hr_sha256_store_be(out + 4 * i, st[i]);
}

/* ------------------------------------------------------------------ API */
static inline void hr_sha256(const void *data, size_t len, uint8_t out[32]) {
    hr_sha256_compress_fn compress = hr_sha256_pick();
    const uint8_t *p = (const uint8_t *)data;
    uint64_t bits = (uint64_t)len * 8;
    uint32_t st[8], w[16];
    uint8_t tail[128];
    size_t i, rem, ntail;
    memcpy(st, HR_SHA256_IV, sizeof st);
    for (; len >= 64; p += 64, len -= 64) {
        for (i = 0; i < 16; i++) w[i] = hr_sha256_load_be(p + 4 * i);
        compress(st, w);
    }
    /* Remaining bytes + 0x80 + zero fill + 64-bit big-endian bit count: one
     * block if the count still fits after the 0x80 byte, otherwise two. */
    rem = len;
    ntail = rem + 9 <= 64 ? 64 : 128;
    memset(tail, 0, ntail);
    if (rem) memcpy(tail, p, rem);
    tail[rem] = 0x80;
    hr_sha256_store_be(tail + ntail - 8, (uint32_t)(bits >> 32));
    hr_sha256_store_be(tail + ntail - 4, (uint32_t)bits);
    for (p = tail; ntail; p += 64, ntail -= 64) {
        for (i = 0; i < 16; i++) w[i] = hr_sha256_load_be(p + 4 * i);
        compress(st, w);
    }
    hr_sha256_state_out(st, out);
}

/* Portable path: hash one page, building its padded blocks directly as words.
 * Why not a generic update()/final() context: every input here is a whole
 * number of 32-bit words (digest = 8 words, token = 1 word), so the 0x80 pad
 * always lands at a word boundary and the total length is known up front;
 * filling a 16-word block in place avoids byte buffering and a second copy.
 * prevw (8 state words of the previous digest, or NULL) may alias st. */
static inline void hr_sha256_page(uint32_t st[8], const uint32_t *prevw, const int32_t *tok, size_t n) {
    uint32_t w[16];
    size_t fill = 0, k, i;
    uint64_t bits = ((prevw ? 32u : 0u) + 4 * (uint64_t)n) * 8;
    if (prevw) /* digest bytes read big-endian are exactly its state words */
        memcpy(w, prevw, 8 * sizeof(uint32_t)), fill = 8;
    memcpy(st, HR_SHA256_IV, 8 * sizeof(uint32_t));
    while (n) {
        k = 16 - fill < n ? 16 - fill : n;
        /* LE bytes of a token read as a big-endian word = byte-swapped value. */
        for (i = 0; i < k; i++) w[fill + i] = hr_sha256_bswap((uint32_t)tok[i]);
        fill += k; tok += k; n -= k;
        if (fill == 16) { hr_sha256_compress_portable(st, w); fill = 0; }
    }
    w[fill++] = 0x80000000u;
    if (fill > 14) { /* no room for the length: pad out and start a new block */
        while (fill < 16) w[fill++] = 0;
        hr_sha256_compress_portable(st, w), fill = 0;
    }
    while (fill < 14) w[fill++] = 0;
    w[14] = (uint32_t)(bits >> 32);
    w[15] = (uint32_t)bits;
    hr_sha256_compress_portable(st, w);
}

static inline void hr_hash_pages(const int32_t *tokens, size_t n_pages, size_t page_size,
                          const uint8_t *prev, uint8_t *out) {
    uint32_t st[8];
    size_t i;
    int have_prev = prev != NULL;
#ifdef HR_SHA256_HAVE_SHANI
    if (hr_sha256_accelerated()) {
        hr_hash_pages_shani(tokens, n_pages, page_size, prev, out);
        return;
    }
#endif
    if (have_prev)
        for (i = 0; i < 8; i++) st[i] = hr_sha256_load_be(prev + 4 * i);
    /* The chain is inherently serial: page i needs digest i-1. The previous
     * state words are fed back directly, without a bytes round trip. */
    for (i = 0; i < n_pages; i++) {
        hr_sha256_page(st, have_prev ? st : NULL, tokens + i * page_size, page_size);
        hr_sha256_state_out(st, out + 32 * i);
        have_prev = 1;
    }
}

static inline void hr_digest_hex(const uint8_t d[32], char out[64]) {
    static const char hex[] = "0123456789abcdef";
    int i;
    for (i = 0; i < 32; i++) {
        out[2 * i] = hex[d[i] >> 4];
        out[2 * i + 1] = hex[d[i] & 15];
    }
}

#endif /* HIRADIX_SHA256_H */
