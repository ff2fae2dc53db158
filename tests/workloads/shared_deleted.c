/*
 * MAP_SHARED mappings of a deleted regular file, not on tmpfs, shared by
 * two processes (issue 19, DMTCP's shared-memory1 and shared-memory2;
 * tests/test_shared_deleted.py).  argv: STEPS MODE DIR, MODE:
 *   held    both processes keep a descriptor of the file
 *   mapped  they close it: only the mappings hold the file
 * The parent makes a new directory in DIR and a file in it (mode 0640,
 * three pages, a hole and a tail, of which two pages are mapped), maps it
 * shared, removes the file and the directory and forks.  The child
 * maps it once more, read-only from a read-only descriptor.  At every step
 * the parent writes a word, the child answers through the mapping with a
 * word of its own; each checks every word written so far, that it has no
 * name (the child: that its two mappings map one inode), its mode and size, and that a
 * descriptor of it (or its /proc/self/map_files link) reads the mapping's
 * bytes.  A restart that gave each process its own copy, or anonymous
 * memory, stops the answers.
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#define PAGE 4096
#define MAPPED (2 * PAGE)
#define FILE_SIZE (3 * PAGE + (1 << 20)) /* a hole, then a tail outside the mapping */
#define MAX_STEPS 400  /* struct shared fits in the first page */

/* the file's first page: the parent's words; its second: the child's */
struct shared {
    volatile int64_t req;   /* the step the parent asks about; -1: stop */
    volatile int64_t ack;   /* the step the child answered */
    volatile int64_t parent_word[MAX_STEPS + 1];
};

_Static_assert(sizeof(struct shared) <= PAGE, "the parent's page");

static int nsteps, fd = -1;
static int held;
static char *map, *ro_map;
static struct shared *sh;
static int64_t *child_word;  /* in the second page */
static pid_t child;
static char path[4096];

static int64_t parent_value(int64_t step) { return step * 1000 + 7; }
static int64_t child_value(int64_t step) { return -(step * 1000 + 3); }

/* /proc/self/maps in one read: a checkpoint comes between two system
 * calls, so what one snapshot shows is all from before or all after it */
static const char *maps_snapshot(void)
{
    static char buf[1 << 18];
    int f = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    CHECK(f >= 0, "open maps");
    ssize_t n = read(f, buf, sizeof(buf) - 1);
    close(f);
    CHECK(n > 0 && n < (ssize_t)sizeof(buf) - 1, "read maps: %zd", n);
    buf[n] = 0;
    return buf;
}

/* the inode and name of the mapping at addr in a snapshot */
static uint64_t mapping_ino(const char *maps, void *addr, char *name, size_t cap)
{
    for (const char *line = maps; *line;) {
        const char *eol = strchr(line, '\n');
        size_t len = eol ? (size_t)(eol - line) : strlen(line);
        unsigned long start, end;
        char perms[8], dev[16];
        unsigned long long off, inode;
        int pos = 0;
        if (sscanf(line, "%lx-%lx %7s %llx %15s %llu %n", &start, &end, perms, &off, dev, &inode, &pos) >= 6 &&
            (uintptr_t)addr >= start && (uintptr_t)addr < end) {
            CHECK(perms[3] == 's', "the mapping at %p is not shared: %.*s", addr, (int)len, line);
            CHECK(inode != 0, "no file at %p", addr);
            snprintf(name, cap, "%.*s", (int)len - pos, line + pos);
            return inode;
        }
        line += len + (eol != NULL);
    }
    CHECK(0, "no mapping at %p", addr);
    return 0;
}

/* a descriptor of the mapped file: the one held, or the map_files link */
static int file_of(void *addr)
{
    if (held)
        return fd;
    char link[128];
    snprintf(link, sizeof(link), "/proc/self/map_files/%lx-%lx", (unsigned long)(uintptr_t)addr,
             (unsigned long)(uintptr_t)addr + MAPPED);
    int f = open(link, O_RDONLY | O_CLOEXEC);
    CHECK(f >= 0, "open %s", link);
    return f;
}

/* what both processes check of the file */
static void check_file(void *addr)
{
    char name[4096];
    mapping_ino(maps_snapshot(), addr, name, sizeof(name));
    char want[4200];
    snprintf(want, sizeof(want), "%s (deleted)", path);
    CHECK(!strcmp(name, want), "mapped %s, not %s", name, want);
    int f = file_of(addr);
    struct stat st;
    CHECK(fstat(f, &st) == 0, "fstat");
    CHECK(st.st_nlink == 0, "link count %lu", (unsigned long)st.st_nlink);
    CHECK((st.st_mode & 07777) == 0640 && S_ISREG(st.st_mode), "mode %o", st.st_mode);
    CHECK(st.st_size == FILE_SIZE, "size %lld", (long long)st.st_size);
    static char buf[MAPPED];
    CHECK(pread(f, buf, MAPPED, 0) == MAPPED, "pread");
    CHECK(!memcmp(buf, addr, MAPPED), "the file and its mapping differ");
    char tail[4];
    CHECK(pread(f, tail, 4, FILE_SIZE - 4) == 4 && !memcmp(tail, "tail", 4), "the tail outside the mapping");
    CHECK(pread(f, tail, 4, 3 * PAGE) == 4 && !memcmp(tail, "\0\0\0\0", 4), "the hole");
    if (!held)
        close(f);
}

static void child_main(void)
{
    int64_t seen = 0;
    for (;;) {
        int64_t r = sh->req;
        if (r < 0)
            break;
        if (r > seen) {
            check_file(map);
            for (int64_t s = 1; s <= r; s++) {
                CHECK(sh->parent_word[s] == parent_value(s), "child: parent word %lld is %lld", (long long)s,
                      (long long)sh->parent_word[s]);
                CHECK(s == r || child_word[s] == child_value(s), "child: own word %lld", (long long)s);
            }
            /* the read-only mapping sees the same file and stays read-only */
            CHECK(((volatile int64_t *)ro_map)[offsetof(struct shared, parent_word) / 8 + r] == parent_value(r),
                  "child: the read-only mapping does not see the parent's word %lld", (long long)r);
            CHECK(mprotect(ro_map, MAPPED, PROT_READ | PROT_WRITE) < 0 && errno == EACCES,
                  "child: a read-only shared mapping became writable");
            char name[4096];
            const char *maps = maps_snapshot();
            CHECK(mapping_ino(maps, ro_map, name, sizeof(name)) == mapping_ino(maps, map, name, sizeof(name)),
                  "child: its two mappings map two files");
            child_word[r] = child_value(r);
            __atomic_store_n(&sh->ack, r, __ATOMIC_SEQ_CST);
            seen = r;
        }
        step_sleep_ms(2);
    }
    _exit(0);
}

static void check(int step)
{
    CHECK(step <= MAX_STEPS, "too many steps");
    check_file(map);
    sh->parent_word[step] = parent_value(step);
    __atomic_store_n(&sh->req, step, __ATOMIC_SEQ_CST);
    for (int i = 0; i < 5000 && sh->ack != step; i++)
        step_sleep_ms(1);
    CHECK(sh->ack == step, "the child did not answer step %d through the shared file (ack %lld)", step,
          (long long)sh->ack);
    for (int s = 1; s <= step; s++) {
        CHECK(child_word[s] == child_value(s), "child word %d is %lld", s, (long long)child_word[s]);
        CHECK(sh->parent_word[s] == parent_value(s), "own word %d", s);
    }
    if (step == nsteps) {
        sh->req = -1;
        int status;
        CHECK(waitpid(child, &status, 0) == child, "wait");
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed");
    }
}

int main(int argc, char **argv)
{
    nsteps = steps_of(argc, argv);
    CHECK(argc > 3 && strlen(argv[3]) < 2000, "usage: shared_deleted STEPS held|mapped DIR");
    held = !strcmp(argv[2], "held");
    CHECK(held || !strcmp(argv[2], "mapped"), "mode %s", argv[2]);
    struct statfs sfs;
    CHECK(statfs(argv[3], &sfs) == 0 && sfs.f_type != TMPFS_MAGIC,
          "%s is on tmpfs (a deleted file there is shared memory)", argv[3]);
    char sub[2048];
    snprintf(sub, sizeof(sub), "%s/sdXXXXXX", argv[3]);
    CHECK(mkdtemp(sub) != NULL, "mkdtemp in %s", argv[3]);
    snprintf(path, sizeof(path), "%s/data", sub);
    fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(fd >= 0, "create %s", path);
    CHECK(fchmod(fd, 0640) == 0, "chmod");
    CHECK(ftruncate(fd, FILE_SIZE) == 0, "ftruncate");
    CHECK(pwrite(fd, "tail", 4, FILE_SIZE - 4) == 4, "write the tail");
    int ro = open(path, O_RDONLY);
    CHECK(ro >= 0, "open read-only");
    map = mmap(NULL, MAPPED, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(map != MAP_FAILED, "mmap");
    CHECK(unlink(path) == 0 && rmdir(sub) == 0, "unlink");
    sh = (struct shared *)map;
    child_word = (int64_t *)(map + PAGE);
    if (!held)
        close(fd);
    fflush(stdout);
    child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        ro_map = mmap(NULL, MAPPED, PROT_READ, MAP_SHARED, ro, 0);
        CHECK(ro_map != MAP_FAILED, "child: mmap read-only");
        close(ro);
        child_main();
    }
    close(ro);
    return run_steps(nsteps, check);
}
