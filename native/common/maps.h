/*
 * Parser for /proc/self/maps and /proc/self/smaps, shared by the shim (to
 * dump) and the restorer (to find its own mappings).  Parses in place: path
 * strings point into the caller's buffer.
 */
#ifndef CKPTD_MAPS_H
#define CKPTD_MAPS_H

#include <stdint.h>
#include <stddef.h>

/* VmFlags from smaps that matter for a faithful restore */
#define CK_VMF_GROWSDOWN 0x1   /* gd */
#define CK_VMF_NORESERVE 0x2   /* nr */
#define CK_VMF_HUGEPAGE 0x4    /* hg */
#define CK_VMF_NOHUGEPAGE 0x8  /* nh */
#define CK_VMF_DONTCOPY 0x10   /* dc */
#define CK_VMF_WIPEONFORK 0x20 /* wf */
#define CK_VMF_DONTDUMP 0x40   /* dd */
#define CK_VMF_MERGEABLE 0x80  /* mg */
#define CK_VMF_RANDOM 0x100    /* rr */
#define CK_VMF_SEQ 0x200       /* sr */
#define CK_VMF_LOCKED 0x400    /* lo */
#define CK_VMF_IO 0x800        /* io */
#define CK_VMF_PFNMAP 0x1000   /* pf */
#define CK_VMF_SHADOWSTACK 0x2000 /* ss */
#define CK_VMF_MAYWRITE 0x4000 /* mw */
#define CK_VMF_UFFD_WP 0x8000  /* uw: registered for userfaultfd write-protect */
#define CK_VMF_LOCKONFAULT 0x10000 /* lf: mlock2(MLOCK_ONFAULT) */
#define CK_VMF_DONTEXPAND 0x20000  /* de: a special mapping mremap may not grow */

struct ck_map_entry {
    uint64_t start;
    uint64_t end;
    uint64_t offset;
    uint32_t prot;      /* PROT_READ | PROT_WRITE | PROT_EXEC */
    int shared;         /* 's' in the perms column */
    uint32_t dev_major;
    uint32_t dev_minor;
    uint64_t ino;
    const char *path;   /* "" for anonymous; may end in " (deleted)" */
    uint32_t vmflags;   /* CK_VMF_*, smaps only */
};

/* return non-zero from the callback to stop; that value is returned */
typedef int (*ck_map_cb)(const struct ck_map_entry *e, void *ctx);

int ck_parse_maps(char *text, size_t len, ck_map_cb cb, void *ctx);

/*
 * Read a whole /proc file into buf (cap bytes).  Returns bytes read,
 * -ENOSPC if it did not fit, or -errno.
 */
long ck_read_file(const char *path, char *buf, size_t cap);

/* write all n bytes (retrying short writes and EINTR); 0 or -errno */
int ck_write_all(int fd, const void *p, size_t n);

#endif
