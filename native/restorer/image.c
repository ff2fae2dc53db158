/* Reading core.img (and the restore plan) and parsing core.img: checks
 * every section lies inside the file. */
#include "restorer.h"

#include <errno.h>

void rst_pread_all(int fd, void *buf, uint64_t n, uint64_t off, const char *what)
{
    for (uint64_t done = 0; done < n;) {
        uint64_t chunk = n - done > (1ull << 30) ? (1ull << 30) : n - done;  /* pread's limit is below 2 GiB */
        long r = ck_pread(fd, (char *)buf + done, chunk, (int64_t)(off + done));
        if (r == -EINTR)
            continue;
        if (r <= 0)
            rst_fail(what, 0, r < 0 ? r : -EIO);
        done += (uint64_t)r;
    }
}

uint8_t *rst_read_file(const char *path, uint64_t *size)
{
    long fd = ck_open(path, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        rst_fail("cannot open a file the restore needs", path, fd);
    struct stat st;
    long rc = ck_fstat((int)fd, &st);
    if (rc < 0)
        rst_fail("cannot stat a file the restore needs", path, rc);
    uint64_t len = (uint64_t)st.st_size;
    /* one more byte, zero: text files end in a NUL */
    uint8_t *buf = ck_mmap(0, (len + 4096) & ~4095ull, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ck_mmap_failed(buf))
        rst_fail("out of memory reading a file the restore needs", path, (long)buf);
    rst_pread_all((int)fd, buf, len, 0, "cannot read a file the restore needs (truncated?)");
    ck_close((int)fd);
    *size = len;
    return buf;
}

const char *rst_str(const struct rst_image *im, uint32_t off)
{
    if (off == 0 || off >= im->strings_size)
        return "";
    return im->strings + off;
}

static const void *section(const uint8_t *core, uint64_t size, const struct ck_header *h, uint32_t type,
                           uint64_t elem, uint64_t *count)
{
    for (uint32_t i = 0; i < h->nsections && i < CK_MAX_SECTIONS; i++) {
        const struct ck_section *s = &h->sections[i];
        if (s->type != type)
            continue;
        if (s->offset > size || s->size > size - s->offset)
            rst_fail("corrupt image: a section lies outside core.img", 0, 0);
        if (elem > 1 && s->size != s->count * elem)
            rst_fail("corrupt image: a section has the wrong record size", 0, 0);
        *count = elem > 1 ? s->count : s->size;
        return core + s->offset;
    }
    *count = 0;
    return 0;
}

void rst_parse_image(struct rst_image *im, const uint8_t *core, uint64_t size)
{
    uint64_t n;
    if (size < sizeof(struct ck_header))
        rst_fail("corrupt image: core.img is truncated", 0, 0);
    const struct ck_header *h = (const void *)core;
    if (h->magic != CK_CORE_MAGIC)
        rst_fail("not a ckptd image (bad magic in core.img)", 0, 0);
    if (h->version != CK_CORE_VERSION)
        rst_fail("unsupported image version", 0, 0);
    if (h->file_size != size)
        rst_fail("corrupt image: core.img has the wrong size", 0, 0);
    ck_memset(im, 0, sizeof(*im));
    im->hdr = h;
    im->proc = section(core, size, h, CK_SEC_PROC, sizeof(struct ck_proc), &n);
    if (!im->proc || n != 1)
        rst_fail("corrupt image: no process record", 0, 0);
    im->threads = section(core, size, h, CK_SEC_THREADS, sizeof(struct ck_thread), &n);
    im->nthreads = (uint32_t)n;
    im->vmas = section(core, size, h, CK_SEC_VMAS, sizeof(struct ck_vma), &n);
    im->nvmas = (uint32_t)n;
    im->runs = section(core, size, h, CK_SEC_RUNS, sizeof(struct ck_page_run), &im->nruns);
    im->fds = section(core, size, h, CK_SEC_FDS, sizeof(struct ck_fd), &n);
    im->nfds = (uint32_t)n;
    im->epoll = section(core, size, h, CK_SEC_EPOLL, sizeof(struct ck_epoll_target), &n);
    im->nepoll = (uint32_t)n;
    im->sigacts = section(core, size, h, CK_SEC_SIGACTS, sizeof(struct ck_sigaction), &n);
    if (n != 64)
        rst_fail("corrupt image: signal actions missing", 0, 0);
    im->rlimits = section(core, size, h, CK_SEC_RLIMITS, sizeof(struct ck_rlimit), &n);
    if (n != 16)
        rst_fail("corrupt image: resource limits missing", 0, 0);
    im->pending = section(core, size, h, CK_SEC_PENDING, sizeof(struct ck_pending), &n);
    im->npending = (uint32_t)n;
    im->strings = section(core, size, h, CK_SEC_STRINGS, 1, &im->strings_size);
    im->blob = section(core, size, h, CK_SEC_BLOB, 1, &im->blob_size);
    im->auxv = section(core, size, h, CK_SEC_AUXV, 1, &im->auxv_size);
    im->sources = section(core, size, h, CK_SEC_SOURCES, sizeof(struct ck_page_source), &im->nsources);
    if (im->nsources > CK_MAX_SOURCES)
        rst_fail("corrupt image: too many page sources", 0, 0);
    if (im->nthreads == 0 || im->nvmas == 0)
        rst_fail("corrupt image: no threads or no memory", 0, 0);
    if (im->strings_size == 0 || im->strings[im->strings_size - 1] != 0)
        rst_fail("corrupt image: string table", 0, 0);
    for (uint32_t i = 0; i < im->nvmas; i++) {
        const struct ck_vma *v = &im->vmas[i];
        if (v->first_run > im->nruns || v->nruns > im->nruns - v->first_run || v->end <= v->start)
            rst_fail("corrupt image: memory map", 0, 0);
    }
    for (uint64_t i = 0; i < im->nruns; i++) {
        const struct ck_page_run *r = &im->runs[i];
        if (r->src > im->nsources)
            rst_fail("corrupt image: page run from an unknown source", 0, 0);
        uint64_t limit = r->src ? im->sources[r->src - 1].size : h->pages_size;
        if (r->offset + r->npages * CK_PAGE_SIZE > limit)
            rst_fail("corrupt image: page run beyond its pages file", 0, 0);
    }
    for (uint32_t i = 0; i < im->nfds; i++) {
        const struct ck_fd *f = &im->fds[i];
        if (f->data_off + f->data_len > im->blob_size ||
            f->first_epoll + f->nepoll > im->nepoll)
            rst_fail("corrupt image: descriptor table", 0, 0);
    }
}

/* ---- encryption at rest: sealed pages files (image_format.h, CK_GCM_*) ---- */

void rst_seal_key(void)
{
    uint8_t raw[CK_GCM_KEY_BYTES];
    if (rst.key_fd < 0)
        return;
    long n = ck_pread(rst.key_fd, raw, sizeof(raw), 0);
    ck_close(rst.key_fd);
    rst.key_fd = -1;
    if (n != (long)sizeof(raw))
        rst_fail("cannot read the encryption key from --key-fd", 0, n < 0 ? n : -EIO);
    if (!ck_gcm_supported())
        rst_fail("this CPU lacks AES-NI or PCLMULQDQ: it cannot decrypt an encrypted checkpoint", 0, 0);
    ck_gcm_init(&rst.key, raw);
    ck_gcm_wipe(raw, sizeof(raw));
    rst.sealed = 1;
}

static void side_path(char *out, size_t cap, const struct rst_image *im, uint64_t i)
{
    struct ck_buf b;
    ck_buf_init(&b, out, cap);
    ck_buf_str(&b, rst.image_dir);
    if (i == 0) {
        ck_buf_str(&b, "/pages.img");
    } else {
        for (uint32_t d = 0; d < im->proc->job_depth; d++)
            ck_buf_str(&b, "/..");
        ck_buf_str(&b, "/");
        ck_buf_str(&b, rst_str(im, im->sources[i - 1].path));
    }
    ck_buf_str(&b, CK_GCM_SUFFIX);
}

void rst_seal_open(const struct rst_image *im)
{
    char path[2100];
    rst.nside = (uint32_t)im->nsources + 1;
    for (uint64_t i = 0; i <= im->nsources; i++) {
        side_path(path, sizeof(path), im, i);
        long fd = ck_open(path, O_RDONLY | O_CLOEXEC, 0);
        if (fd < 0 && rst.sealed)
            rst_fail("the job is encrypted but this memory image is not (its .gcm file is missing)", path, fd);
        if (fd >= 0 && !rst.sealed)
            rst_fail("this memory image is encrypted: the restart needs the job's key", path, 0);
        if (fd < 0) {
            rst.side_fd[i] = -1;
            continue;
        }
        struct stat st;
        long rc = ck_fstat((int)fd, &st);
        if (rc < 0)
            rst_fail("cannot stat a memory image's .gcm file", path, rc);
        long high = ck_fcntl((int)fd, F_DUPFD_CLOEXEC, rst.maxfd + 512);
        ck_close((int)fd);
        if (high < 0)
            rst_fail("cannot move a descriptor", path, high);
        rst.side_fd[i] = (int)high;
        rst.side_len[i] = (uint64_t)st.st_size;
    }
}

uint64_t rst_seal_space(void)
{
    if (!rst.sealed)
        return 0;
    uint64_t n = CK_GCM_CHUNK;
    for (uint32_t i = 0; i < rst.nside; i++)
        if (rst.side_fd[i] >= 0)
            n += (rst.side_len[i] + 15) & ~15ull;
    return n;
}

void rst_seal_load(uint8_t *area)
{
    if (!rst.sealed)
        return;
    uint64_t at = CK_GCM_CHUNK;  /* the scratch chunk first */
    rst.seal_scratch = (uint64_t)area;
    for (uint32_t i = 0; i < rst.nside; i++) {
        if (rst.side_fd[i] < 0)
            continue;
        rst_pread_all(rst.side_fd[i], area + at, rst.side_len[i], 0, "cannot read a memory image's .gcm file");
        ck_close(rst.side_fd[i]);
        rst.side_fd[i] = -1;
        int fd = i ? rst.source_fd[i - 1] : rst.pages_fd;
        struct stat st;
        if (ck_fstat(fd, &st) < 0 ||
            ck_open_check(&rst.opened[i], fd, (uint64_t)st.st_size, area + at, rst.side_len[i]) < 0)
            rst_fail("a memory image's .gcm file does not match it (damaged?)", i ? "an earlier checkpoint's pages.img" : "pages.img", 0);
        at += (rst.side_len[i] + 15) & ~15ull;
    }
}

void rst_seal_read(uint32_t i, void *dst, uint64_t len, uint64_t off)
{
    const struct ck_opened *o = &rst.opened[i];
    long rc = ck_open_read(&rst.key, o, dst, len, off, (uint8_t *)rst.seal_scratch);
    if (rc == -EBADMSG)
        rst_fail("a memory image does not decrypt with this key, or is damaged",
                 i ? "an earlier checkpoint's pages.img" : "pages.img", 0);
    if (rc < 0)
        rst_fail("cannot read pages.img (truncated?)", 0, rc);
}
