/*
 * A socket's options (native/common/sockopts.h names them), read with
 * getsockopt into ck_sockopt records in BLOB.  An option the kernel does
 * not answer for this socket is not saved (and is not set again).
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "../common/sockopts.h"

int ck_dump_sockopts(struct ck_image *im, struct ck_fd *f, int fd, unsigned kind)
{
    f->sockopt_off = im->blob.count;
    f->nsockopts = 0;
    for (unsigned i = 0; i < CK_NSOCKOPTS; i++) {
        const struct ck_sockopt_def *d = &ck_sockopt_table[i];
        if (!(d->kinds & kind))
            continue;
        struct ck_sockopt o;
        ck_memset(&o, 0, sizeof(o));
        unsigned len = d->size;
        if (ck_getsockopt(fd, d->level, d->name, o.val, &len) < 0 || len > sizeof(o.val))
            continue;
        o.level = d->level;
        o.name = d->name;
        o.len = len;
        if (ck_table_bytes_append(&im->blob, &o, sizeof(o)) == UINT64_MAX)
            return ck_image_fail(im, "too much socket data", 0, 0);
        f->nsockopts++;
    }
    return 0;
}
