/*
 * After `restart --lazy`: is the pager still filling this process's memory?
 *
 * The agent says LAZY_DONE when its pager exits.  An agent that restarted
 * meanwhile never will, so the shim can also see for itself: while the
 * pager holds the userfaultfd, the mappings it fills carry the "um" flag
 * (userfaultfd missing) in /proc/self/smaps; when it closes it at the end,
 * the kernel clears the flag everywhere.  fork() and QUIESCE ask this: a
 * child, or the checkpoint's writer, would not inherit the registration
 * and would read the unfilled pages as zeros.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>

static int is_space(char c) { return c == ' ' || c == '\t'; }

/* a "VmFlags:" line that names um */
static int line_has_um(const char *s, size_t n)
{
    static const char key[] = "VmFlags:";
    if (n < sizeof(key) - 1 || ck_memcmp(s, key, sizeof(key) - 1) != 0)
        return 0;
    for (size_t i = sizeof(key) - 1; i + 1 < n; i++)
        if (s[i] == 'u' && s[i + 1] == 'm' && is_space(s[i - 1]) && (i + 2 == n || is_space(s[i + 2])))
            return 1;
    return 0;
}

/* 1: some mapping is still registered for missing pages (or we cannot tell).
 * Read as a stream on the stack, not with ck_parse_maps: that wants the
 * whole file in the arena, which a forking job thread must not touch while
 * the checkpoint thread may be using it. */
static int missing_registered(void)
{
    long fd = ck_open("/proc/self/smaps", O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        return 1;
    char buf[16384];
    size_t keep = 0;
    int found = 0;
    for (;;) {
        long n = ck_read((int)fd, buf + keep, sizeof(buf) - keep);
        if (n == -EINTR)
            continue;
        if (n < 0)
            found = 1;
        if (n <= 0 || found)
            break;
        size_t len = keep + (size_t)n, start = 0;
        for (size_t i = 0; i < len && !found; i++)
            if (buf[i] == '\n') {
                found = line_has_um(buf + start, i - start);
                start = i + 1;
            }
        keep = len - start;
        if (keep == sizeof(buf))
            keep = 0;  /* no line is this long; drop it */
        for (size_t i = 0; i < keep; i++)
            buf[i] = buf[start + i];
    }
    ck_close((int)fd);
    return found;
}

int ck_lazy_filling(void)
{
    if (!__atomic_load_n(&ck_shim.lazy_pending, __ATOMIC_ACQUIRE))
        return 0;
    if (ck_shim.lazy_fd >= 0 || missing_registered())
        return 1;  /* before RESUME the process's own copy keeps the registration */
    __atomic_store_n(&ck_shim.lazy_pending, 0, __ATOMIC_RELEASE);
    ck_futex_wake_all(&ck_shim.lazy_pending);
    return 0;
}
