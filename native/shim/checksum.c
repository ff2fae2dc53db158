/*
 * pages.img's checksum, computed by the writer as it writes.
 *
 * The manifest lists every file with its xxh3-128.  Computed by the agent
 * after the writer, it costs a second read of the whole image on the way
 * to the commit (1.3 s of a 5.7 s 4 GiB checkpoint).  The writer hashes
 * each piece of memory just before it writes it, while the disk is busy
 * with the pieces before, and leaves the digest on the file as an extended
 * attribute (CK_CHECKSUM_XATTR: "HEX SIZE") that the agent takes instead.
 *
 * The hash comes from the system's libxxhash (Debian's libxxhash0, which
 * apt itself needs), found with dlopen in the shim's constructor, when the
 * process is still one thread: the writer is a raw clone that must neither
 * load a library nor allocate.  Without the library, with
 * CKPTD_WRITER_CHECKSUM=0, or on a filesystem without user xattrs, the
 * agent hashes the file itself as before.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>

typedef struct {
    uint64_t low64, high64;
} ck_xxh128;
typedef void *(*create_fn)(void);
typedef int (*reset_fn)(void *state);
typedef int (*update_fn)(void *state, const void *p, size_t n);
typedef ck_xxh128 (*digest_fn)(const void *state);

static struct {
    ck_page_hash_fn page;  /* XXH3_64bits */
    void *state;  /* XXH3_state_t, allocated in the constructor */
    reset_fn reset;
    update_fn update;
    digest_fn digest;
} xxh;

void ck_checksum_load(void)
{
    const char *off = getenv("CKPTD_WRITER_CHECKSUM");
    if (off && off[0] == '0')
        return;
    void *lib = dlopen("libxxhash.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return;
    create_fn create = (create_fn)dlsym(lib, "XXH3_createState");
    xxh.reset = (reset_fn)dlsym(lib, "XXH3_128bits_reset");
    xxh.update = (update_fn)dlsym(lib, "XXH3_128bits_update");
    xxh.digest = (digest_fn)dlsym(lib, "XXH3_128bits_digest");
    xxh.page = (ck_page_hash_fn)dlsym(lib, "XXH3_64bits");
    if (create && xxh.reset && xxh.update && xxh.digest)
        xxh.state = create();
}

ck_page_hash_fn ck_checksum_page_hash(void) { return xxh.state ? xxh.page : 0; }

int ck_checksum_start(struct ck_checksum *s)
{
    s->on = xxh.state && xxh.reset(xxh.state) == 0;
    s->at = 0;
    return s->on;
}

void ck_checksum_add(struct ck_checksum *s, uint64_t off, const void *p, uint64_t len)
{
    if (!s->on)
        return;
    if (off != s->at) {  /* not in file order after all: the agent hashes the file */
        s->on = 0;
        return;
    }
    if (xxh.update(xxh.state, p, len) != 0)
        s->on = 0;
    s->at += len;
}

int ck_checksum_add_file(struct ck_checksum *s, int fd, char *buf, size_t cap, uint64_t off, uint64_t len)
{
    for (uint64_t done = 0; done < len && s->on;) {
        size_t n = len - done > cap ? cap : len - done;
        long r = ck_pread(fd, buf, n, off + done);
        if (r == -EINTR)
            continue;
        if (r <= 0) {
            s->on = 0;
            return r < 0 ? (int)r : -EIO;
        }
        ck_checksum_add(s, off + done, buf, (uint64_t)r);
        done += (uint64_t)r;
    }
    return 0;
}

static void put_hex64(char *out, uint64_t v)
{
    for (int i = 15; i >= 0; i--, v >>= 4)
        out[i] = "0123456789abcdef"[v & 15];
}

void ck_checksum_finish(struct ck_checksum *s, int fd)
{
    struct stat st;
    if (!s->on)
        return;
    if (ck_fstat(fd, &st) < 0 || (uint64_t)st.st_size != s->at)
        return;  /* something else is in the file: the agent hashes it */
    ck_xxh128 h = xxh.digest(xxh.state);
    char value[64];
    put_hex64(value, h.high64);  /* canonical order, as xxhash's hexdigest() */
    put_hex64(value + 16, h.low64);
    struct ck_buf b;
    ck_buf_init(&b, value + 32, sizeof(value) - 32);
    ck_buf_str(&b, " ");
    ck_buf_u64(&b, s->at);
    /* refused (no user xattrs here, say): the agent hashes the file instead */
    (void)ck_sc5(SYS_fsetxattr, fd, CK_CHECKSUM_XATTR, value, 32 + b.len, 0);
}
