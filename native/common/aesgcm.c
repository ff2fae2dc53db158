/*
 * AES-256-GCM with AES-NI and PCLMULQDQ (see aesgcm.h).
 *
 * CTR runs 8 blocks at a time (AESENC's latency hidden behind 7 others);
 * GHASH folds 8 blocks per reduction: the carry-less products of the
 * blocks with H^8..H^1 are summed unreduced, then shifted and reduced once
 * (the method of Intel's "Carry-Less Multiplication Instruction and its
 * Usage for Computing the GCM Mode", byte-reversed blocks).
 *
 * Compiled into the restorer, whose flags forbid vector registers
 * (-mgeneral-regs-only): every function here asks for them back with a
 * target attribute, and the entry points realign the stack, which the
 * restorer's own entry does not promise.
 */
#include "aesgcm.h"

#include <immintrin.h>

#define FN __attribute__((target("aes,pclmul,ssse3,sse4.1"))) static inline
#define API __attribute__((target("aes,pclmul,ssse3,sse4.1"), force_align_arg_pointer))

FN __m128i rev16(__m128i x)
{
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* the counter block's last 4 bytes are a big-endian number: swap them to add */
FN __m128i swap_ctr(__m128i x)
{
    return _mm_shuffle_epi8(x, _mm_set_epi8(12, 13, 14, 15, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
}

FN __m128i load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
FN void store(uint8_t *p, __m128i x) { _mm_storeu_si128((__m128i *)p, x); }

/* ---- AES-256 ---- */

FN __m128i shift_xor(__m128i k)
{
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    return _mm_xor_si128(k, _mm_slli_si128(k, 4));
}

#define EXPAND_EVEN(i, rcon)                                                                               \
    rk[i] = _mm_xor_si128(shift_xor(rk[(i) - 2]),                                                           \
                          _mm_shuffle_epi32(_mm_aeskeygenassist_si128(rk[(i) - 1], rcon), 0xff))
#define EXPAND_ODD(i)                                                                                      \
    rk[i] = _mm_xor_si128(shift_xor(rk[(i) - 2]), _mm_shuffle_epi32(_mm_aeskeygenassist_si128(rk[(i) - 1], 0), 0xaa))

FN __m128i aes(const struct ck_gcm_key *k, __m128i x)
{
    x = _mm_xor_si128(x, load(k->rk[0]));
    for (int r = 1; r < 14; r++)
        x = _mm_aesenc_si128(x, load(k->rk[r]));
    return _mm_aesenclast_si128(x, load(k->rk[14]));
}

/* ---- GHASH ---- */

struct prod {
    __m128i lo, mid, hi;
};

FN void mul_add(struct prod *p, __m128i a, __m128i b)
{
    p->lo = _mm_xor_si128(p->lo, _mm_clmulepi64_si128(a, b, 0x00));
    p->hi = _mm_xor_si128(p->hi, _mm_clmulepi64_si128(a, b, 0x11));
    p->mid = _mm_xor_si128(p->mid, _mm_clmulepi64_si128(a, b, 0x10));
    p->mid = _mm_xor_si128(p->mid, _mm_clmulepi64_si128(a, b, 0x01));
}

FN __m128i reduce(struct prod p)
{
    __m128i lo = _mm_xor_si128(p.lo, _mm_slli_si128(p.mid, 8));
    __m128i hi = _mm_xor_si128(p.hi, _mm_srli_si128(p.mid, 8));
    /* the 256-bit product, shifted left by one (bit-reflected operands) */
    __m128i c0 = _mm_srli_epi32(lo, 31), c1 = _mm_srli_epi32(hi, 31);
    lo = _mm_slli_epi32(lo, 1);
    hi = _mm_slli_epi32(hi, 1);
    __m128i top = _mm_srli_si128(c0, 12);
    c1 = _mm_slli_si128(c1, 4);
    c0 = _mm_slli_si128(c0, 4);
    lo = _mm_or_si128(lo, c0);
    hi = _mm_or_si128(_mm_or_si128(hi, c1), top);
    /* modulo x^128 + x^7 + x^2 + x + 1 */
    __m128i a = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(lo, 31), _mm_slli_epi32(lo, 30)), _mm_slli_epi32(lo, 25));
    __m128i b = _mm_srli_si128(a, 4);
    lo = _mm_xor_si128(lo, _mm_slli_si128(a, 12));
    __m128i d = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(lo, 1), _mm_srli_epi32(lo, 2)), _mm_srli_epi32(lo, 7));
    d = _mm_xor_si128(d, b);
    lo = _mm_xor_si128(lo, d);
    return _mm_xor_si128(hi, lo);
}

FN __m128i gfmul(__m128i a, __m128i b)
{
    struct prod p = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
    mul_add(&p, a, b);
    return reduce(p);
}

API int ck_gcm_supported(void)
{
    uint32_t a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    /* PCLMULQDQ (1), SSSE3 (9), SSE4.1 (19), AES (25) */
    uint32_t need = (1u << 1) | (1u << 9) | (1u << 19) | (1u << 25);
    return (c & need) == need;
}

void ck_gcm_wipe(void *p, size_t n)
{
    volatile uint8_t *v = p;
    while (n--)
        *v++ = 0;
}

API void ck_gcm_init(struct ck_gcm_key *k, const uint8_t key[CK_GCM_KEY_BYTES])
{
    __m128i rk[15];
    rk[0] = load(key);
    rk[1] = load(key + 16);
    EXPAND_EVEN(2, 0x01);
    EXPAND_ODD(3);
    EXPAND_EVEN(4, 0x02);
    EXPAND_ODD(5);
    EXPAND_EVEN(6, 0x04);
    EXPAND_ODD(7);
    EXPAND_EVEN(8, 0x08);
    EXPAND_ODD(9);
    EXPAND_EVEN(10, 0x10);
    EXPAND_ODD(11);
    EXPAND_EVEN(12, 0x20);
    EXPAND_ODD(13);
    EXPAND_EVEN(14, 0x40);
    for (int i = 0; i < 15; i++)
        store(k->rk[i], rk[i]);
    __m128i h = rev16(aes(k, _mm_setzero_si128())), p = h;
    for (int i = 0; i < 16; i++) {  /* p = H^(i+1) */
        if (i < 8)
            store(k->hpow[i], p);
        store(k->hdesc[15 - i], p);
        p = gfmul(p, h);
    }
    ck_gcm_wipe(rk, sizeof(rk));
}


/* ---- CTR with VAES on 512-bit registers: 4 blocks per instruction ---- */

#define FN512 __attribute__((target("aes,pclmul,ssse3,sse4.1,avx2,avx512f,avx512bw,vaes"))) static

static int vaes512 = -1;  /* -1: not asked yet */

static int have_vaes512(void)
{
    if (vaes512 >= 0)
        return vaes512;
    uint32_t a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    int ok = a >= 7;
    if (ok) {
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
        ok = (c >> 27) & 1;  /* OSXSAVE */
    }
    if (ok) {
        uint32_t lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        ok = (lo & 0xe6) == 0xe6;  /* the OS saves SSE, AVX and AVX-512 state */
    }
    if (ok) {
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        ok = (b >> 16 & 1) && (b >> 30 & 1) && (c >> 9 & 1);  /* AVX512F, AVX512BW, VAES */
    }
    vaes512 = ok;
    return ok;
}

/* whole 256-byte groups; returns the bytes done, *ctr moved on */
FN512 size_t ctr512(const struct ck_gcm_key *k, __m128i *ctr, uint8_t *dst, const uint8_t *src, size_t n)
{
    __m512i rk[15];
    for (int r = 0; r < 15; r++)
        rk[r] = _mm512_broadcast_i32x4(load(k->rk[r]));
    const __m512i swap = _mm512_broadcast_i32x4(_mm_set_epi8(12, 13, 14, 15, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512i step = _mm512_set_epi32(4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0);
    __m512i c0 = _mm512_add_epi32(_mm512_broadcast_i32x4(*ctr), _mm512_set_epi32(3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0));
    size_t done = 0;
    for (; n - done >= 256; done += 256) {
        __m512i c1 = _mm512_add_epi32(c0, step), c2 = _mm512_add_epi32(c1, step), c3 = _mm512_add_epi32(c2, step);
        __m512i b0 = _mm512_xor_si512(_mm512_shuffle_epi8(c0, swap), rk[0]);
        __m512i b1 = _mm512_xor_si512(_mm512_shuffle_epi8(c1, swap), rk[0]);
        __m512i b2 = _mm512_xor_si512(_mm512_shuffle_epi8(c2, swap), rk[0]);
        __m512i b3 = _mm512_xor_si512(_mm512_shuffle_epi8(c3, swap), rk[0]);
        c0 = _mm512_add_epi32(c3, step);
        for (int r = 1; r < 14; r++) {
            b0 = _mm512_aesenc_epi128(b0, rk[r]);
            b1 = _mm512_aesenc_epi128(b1, rk[r]);
            b2 = _mm512_aesenc_epi128(b2, rk[r]);
            b3 = _mm512_aesenc_epi128(b3, rk[r]);
        }
        const uint8_t *s = src + done;
        uint8_t *o = dst + done;
        _mm512_storeu_si512(o, _mm512_xor_si512(_mm512_aesenclast_epi128(b0, rk[14]), _mm512_loadu_si512(s)));
        _mm512_storeu_si512(o + 64, _mm512_xor_si512(_mm512_aesenclast_epi128(b1, rk[14]), _mm512_loadu_si512(s + 64)));
        _mm512_storeu_si512(o + 128, _mm512_xor_si512(_mm512_aesenclast_epi128(b2, rk[14]), _mm512_loadu_si512(s + 128)));
        _mm512_storeu_si512(o + 192, _mm512_xor_si512(_mm512_aesenclast_epi128(b3, rk[14]), _mm512_loadu_si512(s + 192)));
    }
    *ctr = _mm512_castsi512_si128(c0);
    return done;
}

/* GHASH of whole 16-block groups with VPCLMULQDQ on 512-bit registers:
 * block j of a group times H^(16-j), summed unreduced, one reduction */
static int vpclmul512 = -1;

static int have_vpclmul512(void)
{
    if (vpclmul512 < 0) {
        uint32_t a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        vpclmul512 = have_vaes512() && (c >> 10 & 1);
    }
    return vpclmul512;
}

#define FN512C __attribute__((target("aes,pclmul,ssse3,sse4.1,avx2,avx512f,avx512bw,vpclmulqdq"))) static

FN512C __m128i fold4(__m512i x)
{
    __m256i y = _mm256_xor_si256(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
    return _mm_xor_si128(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
}

FN512C size_t ghash512(const struct ck_gcm_key *k, __m128i *acc, const uint8_t *p, size_t nblocks)
{
    const __m512i rev = _mm512_broadcast_i32x4(_mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i h0 = _mm512_load_si512(k->hdesc[0]), h1 = _mm512_load_si512(k->hdesc[4]);
    const __m512i h2 = _mm512_load_si512(k->hdesc[8]), h3 = _mm512_load_si512(k->hdesc[12]);
    __m512i a = _mm512_zextsi128_si512(*acc);
    size_t done = 0;
    for (; nblocks - done >= 16; done += 16, p += 256) {
        __m512i d0 = _mm512_xor_si512(_mm512_shuffle_epi8(_mm512_loadu_si512(p), rev), a);
        __m512i d1 = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 64), rev);
        __m512i d2 = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 128), rev);
        __m512i d3 = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 192), rev);
        __m512i lo = _mm512_xor_si512(
            _mm512_xor_si512(_mm512_clmulepi64_epi128(d0, h0, 0x00), _mm512_clmulepi64_epi128(d1, h1, 0x00)),
            _mm512_xor_si512(_mm512_clmulepi64_epi128(d2, h2, 0x00), _mm512_clmulepi64_epi128(d3, h3, 0x00)));
        __m512i hi = _mm512_xor_si512(
            _mm512_xor_si512(_mm512_clmulepi64_epi128(d0, h0, 0x11), _mm512_clmulepi64_epi128(d1, h1, 0x11)),
            _mm512_xor_si512(_mm512_clmulepi64_epi128(d2, h2, 0x11), _mm512_clmulepi64_epi128(d3, h3, 0x11)));
        __m512i mid = _mm512_xor_si512(
            _mm512_xor_si512(_mm512_clmulepi64_epi128(d0, h0, 0x10), _mm512_clmulepi64_epi128(d1, h1, 0x10)),
            _mm512_xor_si512(_mm512_clmulepi64_epi128(d2, h2, 0x10), _mm512_clmulepi64_epi128(d3, h3, 0x10)));
        mid = _mm512_xor_si512(
            mid, _mm512_xor_si512(
                     _mm512_xor_si512(_mm512_clmulepi64_epi128(d0, h0, 0x01), _mm512_clmulepi64_epi128(d1, h1, 0x01)),
                     _mm512_xor_si512(_mm512_clmulepi64_epi128(d2, h2, 0x01), _mm512_clmulepi64_epi128(d3, h3, 0x01))));
        struct prod s = {fold4(lo), fold4(mid), fold4(hi)};
        a = _mm512_zextsi128_si512(reduce(s));
    }
    *acc = _mm512_castsi512_si128(a);
    return done;
}

/* ---- CTR ---- */

API void ck_gcm_ctr(const struct ck_gcm_key *k, const uint8_t iv[CK_GCM_IV_BYTES], uint64_t pos, uint8_t *dst,
                    const uint8_t *src, size_t n)
{
    uint8_t j[16];
    for (int i = 0; i < 12; i++)
        j[i] = iv[i];
    uint32_t first = (uint32_t)(2 + pos / 16);  /* block 0 of the data is J0 + 1 */
    j[12] = (uint8_t)(first >> 24);
    j[13] = (uint8_t)(first >> 16);
    j[14] = (uint8_t)(first >> 8);
    j[15] = (uint8_t)first;
    __m128i ctr = swap_ctr(load(j)), one = _mm_set_epi32(1, 0, 0, 0);
    size_t skip = pos % 16;
    if (skip) {  /* into the middle of a block */
        uint8_t ks[16];
        store(ks, aes(k, swap_ctr(ctr)));
        ctr = _mm_add_epi32(ctr, one);
        for (; skip < 16 && n; skip++, n--)
            *dst++ = *src++ ^ ks[skip];
    }
    if (n >= 256 && have_vaes512()) {
        size_t done = ctr512(k, &ctr, dst, src, n);
        dst += done;
        src += done;
        n -= done;
    }
    __m128i r0 = load(k->rk[0]), r14 = load(k->rk[14]);
    while (n >= 128) {
        __m128i b[8];
        for (int i = 0; i < 8; i++) {
            b[i] = _mm_xor_si128(swap_ctr(ctr), r0);
            ctr = _mm_add_epi32(ctr, one);
        }
        for (int r = 1; r < 14; r++) {
            __m128i rk = load(k->rk[r]);
            for (int i = 0; i < 8; i++)
                b[i] = _mm_aesenc_si128(b[i], rk);
        }
        for (int i = 0; i < 8; i++)
            store(dst + 16 * i, _mm_xor_si128(_mm_aesenclast_si128(b[i], r14), load(src + 16 * i)));
        dst += 128;
        src += 128;
        n -= 128;
    }
    while (n) {
        uint8_t ks[16];
        store(ks, aes(k, swap_ctr(ctr)));
        ctr = _mm_add_epi32(ctr, one);
        size_t m = n < 16 ? n : 16;
        for (size_t i = 0; i < m; i++)
            dst[i] = src[i] ^ ks[i];
        dst += m;
        src += m;
        n -= m;
    }
}

/* ---- GHASH over a message ---- */

/* whole blocks: acc = (acc ^ x0)*H^n ^ x1*H^(n-1) ^ ... , 8 per reduction */
FN __m128i ghash_blocks(const struct ck_gcm_key *k, __m128i acc, const uint8_t *p, size_t nblocks)
{
    if (nblocks >= 16 && have_vpclmul512()) {
        size_t done = ghash512(k, &acc, p, nblocks);
        p += done * 16;
        nblocks -= done;
    }
    while (nblocks >= 8) {
        struct prod s = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
        mul_add(&s, _mm_xor_si128(acc, rev16(load(p))), load(k->hpow[7]));
        for (int i = 1; i < 8; i++)
            mul_add(&s, rev16(load(p + 16 * i)), load(k->hpow[7 - i]));
        acc = reduce(s);
        p += 128;
        nblocks -= 8;
    }
    __m128i h = load(k->hpow[0]);
    for (; nblocks; nblocks--, p += 16)
        acc = gfmul(_mm_xor_si128(acc, rev16(load(p))), h);
    return acc;
}

FN __m128i ghash_padded(const struct ck_gcm_key *k, __m128i acc, const uint8_t *p, size_t n)
{
    acc = ghash_blocks(k, acc, p, n / 16);
    if (n % 16) {
        uint8_t last[16] = {0};
        for (size_t i = 0; i < n % 16; i++)
            last[i] = p[n - n % 16 + i];
        acc = ghash_blocks(k, acc, last, 1);
    }
    return acc;
}

API void ck_gcm_hash_start(struct ck_gcm_hash *h, const struct ck_gcm_key *k, const uint8_t *aad, size_t aad_len)
{
    store(h->acc, ghash_padded(k, _mm_setzero_si128(), aad, aad_len));
    h->npart = 0;
    h->aad_len = aad_len;
    h->ct_len = 0;
}

API void ck_gcm_hash_add(struct ck_gcm_hash *h, const struct ck_gcm_key *k, const uint8_t *ct, size_t n)
{
    __m128i acc = load(h->acc);
    h->ct_len += n;
    if (h->npart) {
        while (h->npart < 16 && n) {
            h->part[h->npart++] = *ct++;
            n--;
        }
        if (h->npart < 16) {
            store(h->acc, acc);
            return;
        }
        acc = ghash_blocks(k, acc, h->part, 1);
        h->npart = 0;
    }
    acc = ghash_blocks(k, acc, ct, n / 16);
    for (size_t i = n - n % 16; i < n; i++)
        h->part[h->npart++] = ct[i];
    store(h->acc, acc);
}

API void ck_gcm_hash_tag(struct ck_gcm_hash *h, const struct ck_gcm_key *k, const uint8_t iv[CK_GCM_IV_BYTES],
                         uint8_t tag[CK_GCM_TAG_BYTES])
{
    __m128i acc = load(h->acc);
    if (h->npart) {
        for (uint32_t i = h->npart; i < 16; i++)
            h->part[i] = 0;
        acc = ghash_blocks(k, acc, h->part, 1);
        h->npart = 0;
    }
    __m128i lens = _mm_set_epi64x((long long)(h->aad_len * 8), (long long)(h->ct_len * 8));
    acc = gfmul(_mm_xor_si128(acc, lens), load(k->hpow[0]));
    uint8_t j[16];
    for (int i = 0; i < 12; i++)
        j[i] = iv[i];
    j[12] = j[13] = j[14] = 0;
    j[15] = 1;
    store(tag, _mm_xor_si128(rev16(acc), aes(k, load(j))));
}

void ck_gcm_seal(const struct ck_gcm_key *k, const uint8_t iv[CK_GCM_IV_BYTES], const uint8_t *aad, size_t aad_len,
                 uint8_t *buf, size_t n, uint8_t tag[CK_GCM_TAG_BYTES])
{
    struct ck_gcm_hash h;
    ck_gcm_ctr(k, iv, 0, buf, buf, n);
    ck_gcm_hash_start(&h, k, aad, aad_len);
    ck_gcm_hash_add(&h, k, buf, n);
    ck_gcm_hash_tag(&h, k, iv, tag);
}

int ck_gcm_open(const struct ck_gcm_key *k, const uint8_t iv[CK_GCM_IV_BYTES], const uint8_t *aad, size_t aad_len,
                uint8_t *buf, size_t n, const uint8_t tag[CK_GCM_TAG_BYTES])
{
    struct ck_gcm_hash h;
    uint8_t want[CK_GCM_TAG_BYTES];
    ck_gcm_hash_start(&h, k, aad, aad_len);
    ck_gcm_hash_add(&h, k, buf, n);
    ck_gcm_hash_tag(&h, k, iv, want);
    uint8_t diff = 0;  /* in constant time */
    for (int i = 0; i < CK_GCM_TAG_BYTES; i++)
        diff |= (uint8_t)(want[i] ^ tag[i]);
    if (diff)
        return -1;
    ck_gcm_ctr(k, iv, 0, buf, buf, n);
    return 0;
}
