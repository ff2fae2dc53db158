/*
 * Sealed files (encryption at rest): the layout is CK_GCM_* in
 * image_format.h.  Raw system calls only: used by the shim's writer, its
 * pause and staged paths, its saved files, the restorer and the pager.
 */
#ifndef CKPTD_SEALED_H
#define CKPTD_SEALED_H

#include "../include/ckptd/image_format.h"
#include "aesgcm.h"

#define CK_GCM_SUFFIX ".gcm"
#define CK_SEAL_TAGBUF 256  /* tags written to the sidecar at a time */

void ck_seal_iv(const uint8_t prefix[8], uint64_t chunk, uint8_t iv[CK_GCM_IV_BYTES]);
/* random nonce prefix for a new file (getrandom); 0 or -errno */
int ck_seal_new_prefix(uint8_t prefix[8]);
/* encrypt (or decrypt: the same) n bytes at file offset off, without tags */
void ck_seal_crypt(const struct ck_gcm_key *k, const uint8_t prefix[8], uint64_t off, uint8_t *dst, const uint8_t *src,
                   uint64_t n);

/* Tags of a file's ciphertext as it is written, in file order; out of
 * order it stops (ok = 0) and the file must be tagged by reading it back. */
struct ck_sealer {
    const struct ck_gcm_key *key;
    uint8_t prefix[8];
    int tag_fd;            /* the sidecar */
    int ok;
    int err;               /* -errno of a failed sidecar write */
    uint64_t at;           /* ciphertext tagged up to here */
    struct ck_gcm_hash h;  /* of the chunk `at` is in */
    uint32_t ntags;        /* buffered */
    uint64_t first_tag;    /* the chunk index of tags[0] */
    uint8_t tags[CK_SEAL_TAGBUF][CK_GCM_TAG_BYTES];
};
void ck_sealer_start(struct ck_sealer *s, const struct ck_gcm_key *k, const uint8_t prefix[8], int tag_fd);
void ck_sealer_add(struct ck_sealer *s, uint64_t off, const uint8_t *ct, uint64_t n);
/* the last chunk's tag and the header; 0, -EILSEQ (out of order), -errno */
int ck_sealer_finish(struct ck_sealer *s, uint64_t file_size);
/* tag a file whose ciphertext is all written, reading it back through buf
 * (CK_GCM_CHUNK bytes); 0 or -errno */
int ck_seal_tag_file(const struct ck_gcm_key *k, const uint8_t prefix[8], int fd, int tag_fd, uint8_t *buf);
/* read plaintext fd in order, write it sealed to out_fd and its sidecar
 * to tag_fd, through buf (CK_GCM_CHUNK bytes); 0 or -errno */
int ck_seal_copy(const struct ck_gcm_key *k, int fd, int out_fd, int tag_fd, uint8_t *buf);

/* A sealed file open for reading: the sidecar in memory (header, tags). */
struct ck_opened {
    int fd;
    uint64_t size;
    const struct ck_gcm_header *hdr;
    const uint8_t *tags;
};
/* check the sidecar (side, n bytes) against the file; 0 or -EBADMSG */
int ck_open_check(struct ck_opened *o, int fd, uint64_t file_size, const void *side, uint64_t n);
/* plaintext [off, off+n) into dst: whole chunks are read and checked,
 * the edges through scratch (CK_GCM_CHUNK bytes); 0, -EBADMSG (a tag does
 * not match: wrong key or damaged), or -errno */
int ck_open_read(const struct ck_gcm_key *k, const struct ck_opened *o, uint8_t *dst, uint64_t n, uint64_t off,
                 uint8_t *scratch);

#endif
