/*
 * ckptd-crypt: the C side of encryption at rest, from the command line.
 *
 *   ckptd-crypt vector KEYHEX IVHEX AADHEX PTHEX   prints "CTHEX TAGHEX" (test vectors)
 *   ckptd-crypt seal KEYFILE IN OUT                 OUT and OUT.gcm: IN sealed
 *   ckptd-crypt open KEYFILE IN OUT                 IN (with IN.gcm) decrypted to OUT
 *   ckptd-crypt speed MIB                           GB/s of the writer's steps
 *
 * KEYFILE holds 32 bytes, raw or as 64 hex digits.  Used by the tests to
 * check the C code against the specification's vectors and against
 * Python's implementation, by scripts/bench.py, and by an operator who
 * wants a file of a checkpoint back in the clear.
 */
#include "aesgcm.h"
#include "sealed.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what)
{
    fprintf(stderr, "ckptd-crypt: %s\n", what);
    exit(2);
}

static size_t unhex(const char *s, uint8_t *out, size_t cap)
{
    size_t n = strlen(s);
    if (n % 2 || n / 2 > cap)
        die("bad hex argument");
    for (size_t i = 0; i < n / 2; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1)
            die("bad hex argument");
        out[i] = (uint8_t)v;
    }
    return n / 2;
}

static void put_hex(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        printf("%02x", p[i]);
}

static void read_key(const char *path, struct ck_gcm_key *k)
{
    uint8_t raw[80], key[32];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("cannot open the key file");
    ssize_t n = read(fd, raw, sizeof(raw));
    close(fd);
    if (n != 32)  /* raw bytes as they are; hex digits may end in a newline */
        while (n > 0 && (raw[n - 1] == '\n' || raw[n - 1] == '\r'))
            n--;
    if (n == 32) {
        memcpy(key, raw, 32);
    } else if (n == 64) {
        char hex[65];
        memcpy(hex, raw, 64);
        hex[64] = 0;
        unhex(hex, key, 32);
    } else {
        die("the key file must hold 32 bytes, raw or as 64 hex digits");
    }
    ck_gcm_init(k, key);
    ck_gcm_wipe(key, sizeof(key));
    ck_gcm_wipe(raw, sizeof(raw));
}

static uint8_t *read_all(int fd, uint64_t *size)
{
    struct stat st;
    if (fstat(fd, &st) < 0)
        die("cannot stat");
    uint8_t *p = malloc((size_t)st.st_size + 1);
    if (!p || pread(fd, p, (size_t)st.st_size, 0) != st.st_size)
        die("cannot read");
    *size = (uint64_t)st.st_size;
    return p;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int speed(uint64_t mib)
{
    struct ck_gcm_key k;
    uint8_t key[32] = {1}, prefix[8] = {2};
    ck_gcm_init(&k, key);
    uint64_t n = mib << 20;
    uint8_t *src = malloc(n), *buf = malloc(1 << 20);
    static struct ck_sealer s;
    memset(src, 7, n);
    int fd = open("/dev/null", O_WRONLY);
    ck_sealer_start(&s, &k, prefix, fd);
    double t0 = now();
    for (uint64_t off = 0; off < n; off += 1 << 20)
        ck_seal_crypt(&k, prefix, off, buf, src + off, 1 << 20);
    double t1 = now();
    for (uint64_t off = 0; off < n; off += 1 << 20)
        ck_sealer_add(&s, off, buf, 1 << 20);
    double t2 = now();
    printf("ctr %.2f GB/s, ghash %.2f GB/s, both %.2f GB/s\n", n / (t1 - t0) / 1e9, n / (t2 - t1) / 1e9,
           n / (t2 - t0) / 1e9);
    return 0;
}

int main(int argc, char **argv)
{
    if (!ck_gcm_supported())
        die("this CPU lacks AES-NI or PCLMULQDQ");
    if (argc == 6 && !strcmp(argv[1], "vector")) {
        uint8_t key[32], iv[12], aad[256], buf[4096], tag[16];
        struct ck_gcm_key k;
        if (unhex(argv[2], key, 32) != 32 || unhex(argv[3], iv, 12) != 12)
            die("the key is 32 bytes, the IV 12");
        size_t na = unhex(argv[4], aad, sizeof(aad)), n = unhex(argv[5], buf, sizeof(buf));
        ck_gcm_init(&k, key);
        ck_gcm_seal(&k, iv, aad, na, buf, n, tag);
        put_hex(buf, n);
        printf(" ");
        put_hex(tag, 16);
        printf("\n");
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "speed"))
        return speed(strtoull(argv[2], 0, 10));
    if (argc != 5 || (strcmp(argv[1], "seal") && strcmp(argv[1], "open")))
        die("usage: ckptd-crypt vector KEYHEX IVHEX AADHEX PTHEX | seal|open KEYFILE IN OUT | speed MIB");
    struct ck_gcm_key k;
    read_key(argv[2], &k);
    char side[4096];
    int in = open(argv[3], O_RDONLY | O_CLOEXEC);
    int out = open(argv[4], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (in < 0 || out < 0)
        die("cannot open IN or OUT");
    static uint8_t buf[CK_GCM_CHUNK];
    if (!strcmp(argv[1], "seal")) {
        snprintf(side, sizeof(side), "%s%s", argv[4], CK_GCM_SUFFIX);
        int tag = open(side, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (tag < 0 || ck_seal_copy(&k, in, out, tag, buf) < 0)
            die("cannot seal");
        return 0;
    }
    snprintf(side, sizeof(side), "%s%s", argv[3], CK_GCM_SUFFIX);
    int tag = open(side, O_RDONLY | O_CLOEXEC);
    if (tag < 0)
        die("cannot open the sidecar");
    uint64_t size, nside;
    uint8_t *plain = read_all(in, &size);
    uint8_t *sc = read_all(tag, &nside);
    struct ck_opened o;
    if (ck_open_check(&o, in, size, sc, nside) < 0)
        die("the sidecar does not belong to this file");
    int rc = ck_open_read(&k, &o, plain, size, 0, buf);
    if (rc == -EBADMSG)
        die("the file does not decrypt with this key, or is damaged");
    if (rc < 0 || write(out, plain, size) != (ssize_t)size)
        die("cannot read or write");
    return 0;
}
