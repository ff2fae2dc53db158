/*
 * AES-256-GCM (NIST SP 800-38D) with AES-NI and PCLMULQDQ, no libc: the
 * one implementation the shim's writer (a raw clone that may not allocate),
 * the restorer and the lazy pager (static, libc-free) share.  96-bit IVs
 * only.  Python uses `cryptography`'s AESGCM for the same format
 * (ckptd/image/crypt.py); tests/test_encrypt.py checks the two against
 * each other and against the GCM specification's test vectors.
 *
 * Every entry point needs a CPU with AES-NI, PCLMULQDQ and SSSE3/SSE4.1:
 * ck_gcm_supported() says so (launch --encrypt refuses otherwise).
 */
#ifndef CKPTD_AESGCM_H
#define CKPTD_AESGCM_H

#include <stddef.h>
#include <stdint.h>

#define CK_GCM_KEY_BYTES 32
#define CK_GCM_IV_BYTES 12
#define CK_GCM_TAG_BYTES 16

/* the expanded key: AES-256 round keys and the powers of the hash key H */
struct ck_gcm_key {
    uint8_t rk[15][16] __attribute__((aligned(16)));
    uint8_t hpow[8][16] __attribute__((aligned(16)));  /* H^1..H^8, byte-reversed */
    uint8_t hdesc[16][16] __attribute__((aligned(64))); /* H^16..H^1: 4 per 512-bit register */
};

/* running GHASH of one message (a chunk) */
struct ck_gcm_hash {
    uint8_t acc[16] __attribute__((aligned(16)));  /* byte-reversed */
    uint8_t part[16];                              /* bytes of an unfinished block */
    uint32_t npart;
    uint64_t aad_len, ct_len;
};

int ck_gcm_supported(void);
void ck_gcm_init(struct ck_gcm_key *k, const uint8_t key[CK_GCM_KEY_BYTES]);
void ck_gcm_wipe(void *p, size_t n);  /* not optimised away */

/* CTR part: dst = src XOR keystream, for the bytes at position `pos` of the
 * message with this IV (dst may be src); any position, any length */
void ck_gcm_ctr(const struct ck_gcm_key *k, const uint8_t iv[CK_GCM_IV_BYTES], uint64_t pos, uint8_t *dst,
                const uint8_t *src, size_t n);

/* GHASH part, over ciphertext in order: AAD first (at most once), then data */
void ck_gcm_hash_start(struct ck_gcm_hash *h, const struct ck_gcm_key *k, const uint8_t *aad, size_t aad_len);
void ck_gcm_hash_add(struct ck_gcm_hash *h, const struct ck_gcm_key *k, const uint8_t *ct, size_t n);
void ck_gcm_hash_tag(struct ck_gcm_hash *h, const struct ck_gcm_key *k, const uint8_t iv[CK_GCM_IV_BYTES],
                     uint8_t tag[CK_GCM_TAG_BYTES]);

/* one whole message in place: encrypt and tag, or check and decrypt
 * (0, or -1 when the tag does not match: buf is then left as it was) */
void ck_gcm_seal(const struct ck_gcm_key *k, const uint8_t iv[CK_GCM_IV_BYTES], const uint8_t *aad, size_t aad_len,
                 uint8_t *buf, size_t n, uint8_t tag[CK_GCM_TAG_BYTES]);
int ck_gcm_open(const struct ck_gcm_key *k, const uint8_t iv[CK_GCM_IV_BYTES], const uint8_t *aad, size_t aad_len,
                uint8_t *buf, size_t n, const uint8_t tag[CK_GCM_TAG_BYTES]);

#endif
