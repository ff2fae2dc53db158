/* Sealed files: see sealed.h and CK_GCM_* in image_format.h. */
#include "sealed.h"
#include "sys.h"

#include <errno.h>

#define C CK_GCM_CHUNK

void ck_seal_iv(const uint8_t prefix[8], uint64_t chunk, uint8_t iv[CK_GCM_IV_BYTES])
{
    for (int i = 0; i < 8; i++)
        iv[i] = prefix[i];
    iv[8] = (uint8_t)(chunk >> 24);
    iv[9] = (uint8_t)(chunk >> 16);
    iv[10] = (uint8_t)(chunk >> 8);
    iv[11] = (uint8_t)chunk;
}

int ck_seal_new_prefix(uint8_t prefix[8])
{
    long r = ck_sc3(SYS_getrandom, prefix, 8, 0);
    return r == 8 ? 0 : (r < 0 ? (int)r : -EIO);
}

void ck_seal_crypt(const struct ck_gcm_key *k, const uint8_t prefix[8], uint64_t off, uint8_t *dst, const uint8_t *src,
                   uint64_t n)
{
    uint8_t iv[CK_GCM_IV_BYTES];
    while (n) {
        uint64_t in = off % C, m = C - in < n ? C - in : n;
        ck_seal_iv(prefix, off / C, iv);
        ck_gcm_ctr(k, iv, in, dst, src, m);
        off += m;
        dst += m;
        src += m;
        n -= m;
    }
}

static int pwrite_all(int fd, const void *p, uint64_t n, uint64_t off)
{
    for (uint64_t done = 0; done < n;) {
        long w = ck_pwrite(fd, (const char *)p + done, n - done, (int64_t)(off + done));
        if (w == -EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? (int)w : -EIO;
        done += (uint64_t)w;
    }
    return 0;
}

static int pread_all(int fd, void *p, uint64_t n, uint64_t off)
{
    for (uint64_t done = 0; done < n;) {
        long r = ck_pread(fd, (char *)p + done, n - done, off + done);
        if (r == -EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? (int)r : -EIO;
        done += (uint64_t)r;
    }
    return 0;
}

static void flush_tags(struct ck_sealer *s)
{
    if (!s->ntags)
        return;
    int rc = pwrite_all(s->tag_fd, s->tags, (uint64_t)s->ntags * CK_GCM_TAG_BYTES,
                        sizeof(struct ck_gcm_header) + s->first_tag * CK_GCM_TAG_BYTES);
    if (rc && !s->err)
        s->err = rc;
    s->first_tag += s->ntags;
    s->ntags = 0;
}

static void end_chunk(struct ck_sealer *s, uint64_t chunk)
{
    uint8_t iv[CK_GCM_IV_BYTES];
    ck_seal_iv(s->prefix, chunk, iv);
    ck_gcm_hash_tag(&s->h, s->key, iv, s->tags[s->ntags++]);
    if (s->ntags == CK_SEAL_TAGBUF)
        flush_tags(s);
    ck_gcm_hash_start(&s->h, s->key, 0, 0);
}

void ck_sealer_start(struct ck_sealer *s, const struct ck_gcm_key *k, const uint8_t prefix[8], int tag_fd)
{
    s->key = k;
    for (int i = 0; i < 8; i++)
        s->prefix[i] = prefix[i];
    s->tag_fd = tag_fd;
    s->ok = 1;
    s->err = 0;
    s->at = 0;
    s->ntags = 0;
    s->first_tag = 0;
    ck_gcm_hash_start(&s->h, k, 0, 0);
}

void ck_sealer_add(struct ck_sealer *s, uint64_t off, const uint8_t *ct, uint64_t n)
{
    if (!s->ok || off != s->at) {
        s->ok = 0;
        return;
    }
    while (n) {
        uint64_t in = s->at % C, m = C - in < n ? C - in : n;
        ck_gcm_hash_add(&s->h, s->key, ct, m);
        s->at += m;
        ct += m;
        n -= m;
        if (s->at % C == 0)
            end_chunk(s, s->at / C - 1);
    }
}

static int write_header(int tag_fd, const uint8_t prefix[8], uint64_t size)
{
    struct ck_gcm_header h;
    h.magic = CK_GCM_MAGIC;
    h.version = CK_GCM_VERSION;
    h.chunk_size = C;
    h.file_size = size;
    for (int i = 0; i < 8; i++)
        h.nonce_prefix[i] = prefix[i];
    int rc = pwrite_all(tag_fd, &h, sizeof(h), 0);
    if (rc == 0)  /* a sidecar written over an older, longer one */
        rc = (int)ck_ftruncate(tag_fd, (int64_t)(sizeof(h) + (size + C - 1) / C * CK_GCM_TAG_BYTES));
    return rc;
}

int ck_sealer_finish(struct ck_sealer *s, uint64_t file_size)
{
    if (!s->ok || s->at != file_size)
        return -EILSEQ;
    if (s->at % C)
        end_chunk(s, s->at / C);
    flush_tags(s);
    if (s->err)
        return s->err;
    return write_header(s->tag_fd, s->prefix, file_size);
}

int ck_seal_tag_file(const struct ck_gcm_key *k, const uint8_t prefix[8], int fd, int tag_fd, uint8_t *buf)
{
    struct stat st;
    long rc = ck_fstat(fd, &st);
    if (rc < 0)
        return (int)rc;
    /* the sealer is big (its tag buffer): kept off small stacks */
    static struct ck_sealer s;
    ck_sealer_start(&s, k, prefix, tag_fd);
    for (uint64_t off = 0; off < (uint64_t)st.st_size;) {
        uint64_t n = (uint64_t)st.st_size - off < C ? (uint64_t)st.st_size - off : C;
        int r = pread_all(fd, buf, n, off);
        if (r < 0)
            return r;
        ck_sealer_add(&s, off, buf, n);
        off += n;
    }
    return ck_sealer_finish(&s, (uint64_t)st.st_size);
}

int ck_seal_copy(const struct ck_gcm_key *k, int fd, int out_fd, int tag_fd, uint8_t *buf)
{
    static struct ck_sealer s;
    uint8_t prefix[8];
    int rc = ck_seal_new_prefix(prefix);
    if (rc < 0)
        return rc;
    ck_sealer_start(&s, k, prefix, tag_fd);
    uint64_t off = 0;
    for (;;) {
        long r = ck_pread(fd, buf, C, off);
        if (r == -EINTR)
            continue;
        if (r < 0)
            return (int)r;
        if (r == 0)
            break;
        ck_seal_crypt(k, prefix, off, buf, buf, (uint64_t)r);
        rc = pwrite_all(out_fd, buf, (uint64_t)r, off);
        if (rc < 0)
            return rc;
        ck_sealer_add(&s, off, buf, (uint64_t)r);
        off += (uint64_t)r;
    }
    return ck_sealer_finish(&s, off);
}

int ck_open_check(struct ck_opened *o, int fd, uint64_t file_size, const void *side, uint64_t n)
{
    const struct ck_gcm_header *h = side;
    if (n < sizeof(*h) || h->magic != CK_GCM_MAGIC || h->version != CK_GCM_VERSION || h->chunk_size != C ||
        h->file_size != file_size || n != sizeof(*h) + (file_size + C - 1) / C * CK_GCM_TAG_BYTES)
        return -EBADMSG;
    o->fd = fd;
    o->size = file_size;
    o->hdr = h;
    o->tags = (const uint8_t *)side + sizeof(*h);
    return 0;
}

static int open_chunk(const struct ck_gcm_key *k, const struct ck_opened *o, uint64_t chunk, uint8_t *buf, uint64_t n)
{
    uint8_t iv[CK_GCM_IV_BYTES];
    int rc = pread_all(o->fd, buf, n, chunk * C);
    if (rc < 0)
        return rc;
    ck_seal_iv(o->hdr->nonce_prefix, chunk, iv);
    return ck_gcm_open(k, iv, 0, 0, buf, n, o->tags + chunk * CK_GCM_TAG_BYTES) ? -EBADMSG : 0;
}

int ck_open_read(const struct ck_gcm_key *k, const struct ck_opened *o, uint8_t *dst, uint64_t n, uint64_t off,
                 uint8_t *scratch)
{
    if (off > o->size || n > o->size - off)
        return -EIO;  /* beyond the file: truncated */
    while (n) {
        uint64_t chunk = off / C, start = chunk * C;
        uint64_t len = o->size - start < C ? o->size - start : C;  /* the chunk's length */
        uint64_t in = off - start, m = len - in < n ? len - in : n;
        int rc;
        if (in == 0 && m == len) {  /* all of it wanted: straight into place */
            rc = open_chunk(k, o, chunk, dst, len);
        } else {
            rc = open_chunk(k, o, chunk, scratch, len);
            for (uint64_t i = 0; rc == 0 && i < m; i++)
                dst[i] = scratch[in + i];
        }
        if (rc < 0)
            return rc;
        dst += m;
        off += m;
        n -= m;
    }
    return 0;
}
