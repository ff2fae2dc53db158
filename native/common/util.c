#include "util.h"
#include "sys.h"

#include <errno.h>

size_t ck_strlen(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

size_t ck_strnlen(const char *s, size_t max)
{
    size_t n = 0;
    while (n < max && s[n])
        n++;
    return n;
}

int ck_strcmp(const char *a, const char *b)
{
    while (*a && *a == *b) {
        a++;
        b++;
    }
    return (unsigned char)*a - (unsigned char)*b;
}

int ck_strncmp(const char *a, const char *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (a[i] != b[i] || !a[i])
            return (unsigned char)a[i] - (unsigned char)b[i];
    }
    return 0;
}

int ck_startswith(const char *s, const char *prefix)
{
    return ck_strncmp(s, prefix, ck_strlen(prefix)) == 0;
}

int ck_endswith(const char *s, const char *suffix)
{
    size_t ls = ck_strlen(s), lx = ck_strlen(suffix);
    return ls >= lx && ck_strcmp(s + ls - lx, suffix) == 0;
}

void ck_memcpy(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    while (n >= 8) {
        uint64_t v;
        __builtin_memcpy(&v, s, 8);
        __builtin_memcpy(d, &v, 8);
        d += 8;
        s += 8;
        n -= 8;
    }
    while (n--)
        *d++ = *s++;
}

void ck_memset(void *dst, int c, size_t n)
{
    volatile unsigned char *d = dst; /* volatile: keep gcc from emitting a memset call */
    while (n--)
        *d++ = (unsigned char)c;
}

int ck_memcmp(const void *a, const void *b, size_t n)
{
    const unsigned char *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return x[i] - y[i];
    return 0;
}

size_t ck_strlcpy(char *dst, const char *src, size_t cap)
{
    size_t n = ck_strlen(src);
    if (cap) {
        size_t c = n < cap - 1 ? n : cap - 1;
        ck_memcpy(dst, src, c);
        dst[c] = 0;
    }
    return n;
}

const char *ck_skip_spaces(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    return s;
}

uint64_t ck_parse_u64(const char *s, int base, const char **end)
{
    uint64_t v = 0;
    for (;; s++) {
        int d;
        if (*s >= '0' && *s <= '9')
            d = *s - '0';
        else if (base == 16 && *s >= 'a' && *s <= 'f')
            d = *s - 'a' + 10;
        else if (base == 16 && *s >= 'A' && *s <= 'F')
            d = *s - 'A' + 10;
        else
            break;
        v = v * (uint64_t)base + (uint64_t)d;
    }
    if (end)
        *end = s;
    return v;
}

int64_t ck_parse_i64(const char *s, const char **end)
{
    int neg = 0;
    if (*s == '-') {
        neg = 1;
        s++;
    }
    uint64_t v = ck_parse_u64(s, 10, end);
    return neg ? -(int64_t)v : (int64_t)v;
}

void ck_buf_init(struct ck_buf *b, char *data, size_t cap)
{
    b->data = data;
    b->len = 0;
    b->cap = cap;
    b->overflow = 0;
    if (cap)
        data[0] = 0;
}

void ck_buf_mem(struct ck_buf *b, const char *s, size_t n)
{
    if (b->cap == 0 || b->len + n >= b->cap) {
        b->overflow = 1;
        n = b->cap && b->len < b->cap - 1 ? b->cap - 1 - b->len : 0;
    }
    ck_memcpy(b->data + b->len, s, n);
    b->len += n;
    if (b->cap)
        b->data[b->len] = 0;
}

void ck_buf_str(struct ck_buf *b, const char *s) { ck_buf_mem(b, s, ck_strlen(s)); }

void ck_buf_char(struct ck_buf *b, char c) { ck_buf_mem(b, &c, 1); }

void ck_buf_u64(struct ck_buf *b, uint64_t v)
{
    char tmp[24];
    int i = (int)sizeof(tmp);
    do {
        tmp[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    ck_buf_mem(b, tmp + i, sizeof(tmp) - (size_t)i);
}

void ck_buf_i64(struct ck_buf *b, int64_t v)
{
    if (v < 0) {
        ck_buf_char(b, '-');
        ck_buf_u64(b, (uint64_t)0 - (uint64_t)v);
    } else {
        ck_buf_u64(b, (uint64_t)v);
    }
}

void ck_buf_hex(struct ck_buf *b, uint64_t v)
{
    static const char digits[] = "0123456789abcdef";
    char tmp[16];
    int i = (int)sizeof(tmp);
    do {
        tmp[--i] = digits[v & 15];
        v >>= 4;
    } while (v);
    ck_buf_mem(b, tmp + i, sizeof(tmp) - (size_t)i);
}

void ck_buf_escaped(struct ck_buf *b, const char *s)
{
    static const char digits[] = "0123456789ABCDEF";
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c < 0x20 || c == '%' || c == 0x7f) {
            char e[3] = {'%', digits[c >> 4], digits[c & 15]};
            ck_buf_mem(b, e, 3);
        } else {
            ck_buf_char(b, (char)c);
        }
    }
}

const char *ck_buf_cstr(struct ck_buf *b) { return b->cap ? b->data : ""; }

void ck_buf_error(struct ck_buf *b, const char *what, const char *detail, long rc)
{
    ck_buf_str(b, what);
    if (detail && *detail) {
        ck_buf_str(b, ": ");
        ck_buf_str(b, detail);
    }
    if (rc < 0) {
        ck_buf_str(b, " (errno ");
        ck_buf_i64(b, -rc);
        ck_buf_str(b, ")");
    }
}

/* copy the data ranges of `in` (SEEK_DATA/SEEK_HOLE) below `size` into `out`
 * at the same offsets, leaving holes as holes; both files' offsets move */
long ck_copy_sparse(int in, int out, uint64_t size)
{
    int64_t pos = 0;
    while ((uint64_t)pos < size) {
        int64_t data = ck_lseek(in, pos, SEEK_DATA);
        if (data == -ENXIO)
            break;  /* only a hole is left */
        if (data < 0)
            data = pos;  /* no SEEK_DATA: copy everything */
        int64_t hole = ck_lseek(in, data, SEEK_HOLE);
        if (hole < 0 || (uint64_t)hole > size)
            hole = (int64_t)size;
        if (ck_lseek(in, data, SEEK_SET) < 0 || ck_lseek(out, data, SEEK_SET) < 0)
            return -EIO;
        int64_t left = hole - data;
        while (left > 0) {
            long n = ck_sendfile(out, in, (size_t)(left > (1 << 30) ? (1 << 30) : left));
            if (n == -EINTR)
                continue;
            if (n <= 0)
                return n < 0 ? n : -EIO;
            left -= n;
        }
        pos = hole;
    }
    return 0;
}
