#include "maps.h"
#include "sys.h"
#include "util.h"

#include <errno.h>

static uint32_t parse_vmflags(const char *s)
{
    static const struct {
        char name[3];
        uint32_t bit;
    } table[] = {
        {"gd", CK_VMF_GROWSDOWN}, {"nr", CK_VMF_NORESERVE}, {"hg", CK_VMF_HUGEPAGE},
        {"nh", CK_VMF_NOHUGEPAGE}, {"dc", CK_VMF_DONTCOPY}, {"wf", CK_VMF_WIPEONFORK},
        {"dd", CK_VMF_DONTDUMP}, {"mg", CK_VMF_MERGEABLE}, {"rr", CK_VMF_RANDOM},
        {"sr", CK_VMF_SEQ}, {"lo", CK_VMF_LOCKED}, {"io", CK_VMF_IO},
        {"pf", CK_VMF_PFNMAP}, {"ss", CK_VMF_SHADOWSTACK}, {"mw", CK_VMF_MAYWRITE},
        {"uw", CK_VMF_UFFD_WP}, {"lf", CK_VMF_LOCKONFAULT},
        {"de", CK_VMF_DONTEXPAND},
    };
    uint32_t flags = 0;
    while (*s && *s != '\n') {
        s = ck_skip_spaces(s);
        if (s[0] && s[1] && (s[2] == ' ' || s[2] == '\n' || s[2] == 0)) {
            for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
                if (s[0] == table[i].name[0] && s[1] == table[i].name[1])
                    flags |= table[i].bit;
        }
        while (*s && *s != ' ' && *s != '\n')
            s++;
    }
    return flags;
}

/* a maps header line starts with a hex range "start-end " */
static int is_header_line(const char *s)
{
    const char *p = s;
    while ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))
        p++;
    return p != s && *p == '-';
}

int ck_parse_maps(char *text, size_t len, ck_map_cb cb, void *ctx)
{
    struct ck_map_entry cur;
    int have = 0;
    char *p = text, *end = text + len;

    while (p < end) {
        char *line = p;
        while (p < end && *p != '\n')
            p++;
        if (p < end)
            *p++ = 0;
        if (is_header_line(line)) {
            if (have) {
                int rc = cb(&cur, ctx);
                if (rc)
                    return rc;
            }
            const char *s = line;
            ck_memset(&cur, 0, sizeof(cur));
            cur.start = ck_parse_u64(s, 16, &s);
            cur.end = ck_parse_u64(s + 1, 16, &s);
            s = ck_skip_spaces(s);
            if (s[0] == 'r')
                cur.prot |= PROT_READ;
            if (s[1] == 'w')
                cur.prot |= PROT_WRITE;
            if (s[2] == 'x')
                cur.prot |= PROT_EXEC;
            cur.shared = s[3] == 's';
            s = ck_skip_spaces(s + 4);
            cur.offset = ck_parse_u64(s, 16, &s);
            s = ck_skip_spaces(s);
            cur.dev_major = (uint32_t)ck_parse_u64(s, 16, &s);
            cur.dev_minor = (uint32_t)ck_parse_u64(s + 1, 16, &s);
            s = ck_skip_spaces(s);
            cur.ino = ck_parse_u64(s, 10, &s);
            cur.path = ck_skip_spaces(s);
            have = 1;
        } else if (have && ck_startswith(line, "VmFlags:")) {
            cur.vmflags = parse_vmflags(line + 8);
        }
    }
    if (have)
        return cb(&cur, ctx);
    return 0;
}

int ck_write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        size_t chunk = n > (1ull << 30) ? (1ull << 30) : n;
        long w = ck_write(fd, c, chunk);
        if (w == -EINTR)
            continue;
        if (w < 0)
            return (int)w;
        if (w == 0)
            return -EIO;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

long ck_read_file(const char *path, char *buf, size_t cap)
{
    long fd = ck_open(path, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        return fd;
    size_t len = 0;
    for (;;) {
        if (len == cap) {
            ck_close((int)fd);
            return -ENOSPC;
        }
        long n = ck_read((int)fd, buf + len, cap - len);
        if (n < 0) {
            if (n == -EINTR)
                continue;
            ck_close((int)fd);
            return n;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    ck_close((int)fd);
    return (long)len;
}
