/*
 * Small string and number helpers with no libc dependency.  Names carry a
 * ck_ prefix: the shim is preloaded into every job process and must never
 * export (and so interpose) a libc name by accident.
 */
#ifndef CKPTD_UTIL_H
#define CKPTD_UTIL_H

#include <stddef.h>
#include <stdint.h>

size_t ck_strlen(const char *s);
size_t ck_strnlen(const char *s, size_t max);
int ck_strcmp(const char *a, const char *b);
int ck_strncmp(const char *a, const char *b, size_t n);
int ck_startswith(const char *s, const char *prefix);
int ck_endswith(const char *s, const char *suffix);
void ck_memcpy(void *dst, const void *src, size_t n);
void ck_memset(void *dst, int c, size_t n);
int ck_memcmp(const void *a, const void *b, size_t n);
/* copies at most cap-1 bytes and always terminates; returns strlen(src) */
size_t ck_strlcpy(char *dst, const char *src, size_t cap);
/* data ranges of in into out at the same offsets; 0 or -errno (sys.h calls) */
long ck_copy_sparse(int in, int out, uint64_t size);

/* parse an unsigned number in base 10 or 16; *end points past it */
uint64_t ck_parse_u64(const char *s, int base, const char **end);
int64_t ck_parse_i64(const char *s, const char **end);
const char *ck_skip_spaces(const char *s);

/* A bounded text buffer: appends never overflow, `overflow` records loss. */
struct ck_buf {
    char *data;
    size_t len;
    size_t cap;
    int overflow;
};
void ck_buf_init(struct ck_buf *b, char *data, size_t cap);
void ck_buf_str(struct ck_buf *b, const char *s);
void ck_buf_mem(struct ck_buf *b, const char *s, size_t n);
void ck_buf_char(struct ck_buf *b, char c);
void ck_buf_u64(struct ck_buf *b, uint64_t v);
void ck_buf_i64(struct ck_buf *b, int64_t v);
void ck_buf_hex(struct ck_buf *b, uint64_t v);
/* percent-encode tab, newline, '%' and non-printables (shim protocol values) */
void ck_buf_escaped(struct ck_buf *b, const char *s);
const char *ck_buf_cstr(struct ck_buf *b);
/* "what: detail (errno N)": the one shape of every native error message */
void ck_buf_error(struct ck_buf *b, const char *what, const char *detail, long rc);

#endif
