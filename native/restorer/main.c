/*
 * ckptd-restore --build PLAN --status-dir DIR [--agent-socket PATH] [--checkpoint ID]
 *   as pid 2 of a fresh pid namespace: create the shared objects and the
 *   process tree the plan describes (plan.c); every process then runs
 * ckptd-restore IMAGE_DIR --status-file PATH [--plan PLAN] [--agent-socket PATH] [--checkpoint ID]
 *   as the would-be process, with its old pid, and rebuilds it from its
 *   image.  See restorer.h for the two phases.
 */
#include "restorer.h"

#include <errno.h>

struct rst_state rst;
struct rst_range rst_cur_maps[64];
int rst_ncur_maps;

extern char __ehdr_start[];
extern char _end[];

#define PARK_SIZE (1u << 20)

static uint64_t page_up(uint64_t v) { return (v + 4095) & ~4095ull; }

static void copy_arg(char *dst, size_t cap, const char *src, const char *name)
{
    if (!src || ck_strlcpy(dst, src, cap) >= cap)
        rst_fail("argument missing or too long", name, 0);
}

#define USAGE "usage: ckptd-restore IMAGE_DIR --status-file PATH [--plan PLAN] [--agent-socket PATH] " \
              "[--checkpoint ID] [--lazy] | ckptd-restore --build PLAN --status-dir DIR ... | " \
              "ckptd-restore --serve-lazy IMAGE_DIR --uffd FD [--status-file PATH]"

static int parse_args(long argc, char **argv, char *status_path, size_t cap)
{
    int build = 0;
    status_path[0] = 0;
    for (long i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!ck_strcmp(a, "--status-file") && i + 1 < argc)
            copy_arg(status_path, cap, argv[++i], a);
        else if (!ck_strcmp(a, "--build") && i + 1 < argc) {
            copy_arg(rst.plan_path, sizeof(rst.plan_path), argv[++i], a);
            build = 1;
        } else if (!ck_strcmp(a, "--plan") && i + 1 < argc)
            copy_arg(rst.plan_path, sizeof(rst.plan_path), argv[++i], a);
        else if (!ck_strcmp(a, "--status-dir") && i + 1 < argc)
            copy_arg(rst.status_dir, sizeof(rst.status_dir), argv[++i], a);
        else if (!ck_strcmp(a, "--agent-socket") && i + 1 < argc)
            copy_arg(rst.agent_socket, sizeof(rst.agent_socket), argv[++i], a);
        else if (!ck_strcmp(a, "--checkpoint") && i + 1 < argc)
            copy_arg(rst.checkpoint_id, sizeof(rst.checkpoint_id), argv[++i], a);
        else if (!ck_strcmp(a, "--lazy"))
            rst.lazy = 1;
        else if (!ck_strcmp(a, "--eager"))
            rst.lazy = 0;
        else if (!ck_strcmp(a, "--key-fd") && i + 1 < argc)
            rst.key_fd = (int)ck_parse_u64(argv[++i], 10, 0);  /* encryption at rest: the key, never in argv */
        else if (!ck_strcmp(a, "--serve-lazy"))
            rst.serve_lazy = 1;
        else if (!ck_strcmp(a, "--fill-delay-ms") && i + 1 < argc)
            rst.fill_delay_ms = (long)ck_parse_u64(argv[++i], 10, 0);
        else if (!ck_strcmp(a, "--uffd") && i + 1 < argc) {
            const char *end;
            rst.lazy_uffd = (int)ck_parse_u64(argv[++i], 10, &end);
            if (*end)
                rst_fail(USAGE, a, 0);
        }
        else if (a[0] != '-' && !rst.image_dir[0])
            copy_arg(rst.image_dir, sizeof(rst.image_dir), a, "image directory");
        else
            rst_fail(USAGE, a, 0);
    }
    if (build) {
        if (!rst.status_dir[0] || rst.image_dir[0])
            rst_fail(USAGE, 0, 0);
        copy_arg(rst.self_path, sizeof(rst.self_path), argv[0], "program path");
        struct ck_buf b;
        ck_buf_init(&b, status_path, cap);
        ck_buf_str(&b, rst.status_dir);
        ck_buf_str(&b, "/restore-build.status");
    } else if (!rst.image_dir[0] || (rst.serve_lazy && rst.lazy_uffd < 0)) {
        rst_fail(USAGE, 0, 0);
    }
    return build;
}

static int move_high(int fd)
{
    long high = ck_fcntl(fd, F_DUPFD_CLOEXEC, rst.maxfd + 16);
    if (high < 0)
        rst_fail("cannot move a descriptor out of the image's range", 0, high);
    ck_close(fd);
    return (int)high;
}

static int collect_map(const struct ck_map_entry *e, void *ctx)
{
    (void)ctx;
    if (e->start >= 0x800000000000ull)
        return 0;  /* [vsyscall] */
    if (rst_ncur_maps >= (int)(sizeof(rst_cur_maps) / sizeof(rst_cur_maps[0])))
        rst_fail("the restorer has too many mappings", 0, 0);
    rst_cur_maps[rst_ncur_maps].start = e->start;
    rst_cur_maps[rst_ncur_maps].end = e->end;
    rst_ncur_maps++;
    if (e->path[0] == '[' && (ck_startswith(e->path, "[vdso]") || ck_startswith(e->path, "[vvar"))) {
        if (rst.ncur_special >= RST_MAX_SPECIAL)
            rst_fail("unexpected vdso/vvar layout on this kernel", e->path, 0);
        struct rst_special *s = &rst.cur_special[rst.ncur_special++];
        ck_strlcpy(s->name, e->path, sizeof(s->name));
        s->start = e->start;
        s->end = e->end;
    }
    return 0;
}

static uint64_t cpu_xcr0(void)
{
    uint32_t eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
    if (!(ecx & (1u << 27)))
        return 0;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static void phase2(uint64_t core_addr);

/* An incremental image reads its unchanged pages from earlier checkpoints'
 * pages.img, named relative to the job's directory, job_depth levels up. */
static void open_sources(const struct rst_image *im)
{
    char path[2048];
    for (uint64_t i = 0; i < im->nsources; i++) {
        struct ck_buf b;
        ck_buf_init(&b, path, sizeof(path));
        ck_buf_str(&b, rst.image_dir);
        for (uint32_t d = 0; d < im->proc->job_depth; d++)
            ck_buf_str(&b, "/..");
        ck_buf_str(&b, "/");
        ck_buf_str(&b, rst_str(im, im->sources[i].path));
        long fd = ck_open(path, O_RDONLY | O_CLOEXEC, 0);
        if (fd < 0)
            rst_fail("an earlier checkpoint this one builds on is missing (deleted by hand?)", path, fd);
        struct stat st;
        long rc = ck_fstat((int)fd, &st);
        if (rc < 0 || (uint64_t)st.st_size != im->sources[i].size)
            rst_fail("an earlier checkpoint this one builds on has changed (wrong size)", path, rc);
        rst.source_fd[i] = move_high((int)fd);
    }
}

void rst_open_pages(const struct rst_image *im)
{
    char path[1200];
    struct ck_buf b;
    ck_buf_init(&b, path, sizeof(path));
    ck_buf_str(&b, rst.image_dir);
    ck_buf_str(&b, "/pages.img");
    long pfd = ck_open(path, O_RDONLY | O_CLOEXEC, 0);
    if (pfd < 0)
        rst_fail("cannot open pages.img", path, pfd);
    rst.pages_fd = move_high((int)pfd);
    struct stat st;
    long rc = ck_fstat(rst.pages_fd, &st);
    if (rc < 0 || (uint64_t)st.st_size != im->hdr->pages_size)
        rst_fail("pages.img has the wrong size (truncated image?)", path, rc);
    open_sources(im);
    rst_seal_open(im);
}

void rst_main(long *sp)
{
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char status_path[1024], path[1200];
    struct rst_image im;
    struct ck_buf b;
    uint64_t all = ~0ull;

    rst.status_fd = -1;
    rst.lazy_uffd = -1;
    rst.key_fd = -1;
    ck_sigprocmask(SIG_SETMASK, &all, 0);  /* nothing interrupts a restore */
    int build = parse_args(argc, argv, status_path, sizeof(status_path));
    if (status_path[0]) {
        long fd = ck_open(status_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0)
            rst_fail("cannot create the status file", status_path, fd);
        rst.status_fd = (int)fd;
    }
    if (!build)
        rst_seal_key();  /* --build passes the descriptor on to the restorer of every process */
    if (build)
        rst_build();
    if (rst.serve_lazy)
        rst_serve_lazy();
    if (rst.plan_path[0])
        rst_load_plan_keys(rst.plan_path);

    ck_buf_init(&b, path, sizeof(path));
    ck_buf_str(&b, rst.image_dir);
    ck_buf_str(&b, "/core.img");
    uint8_t *core = rst_read_file(path, &rst.core_size);
    rst_parse_image(&im, core, rst.core_size);

    if (ck_getpid() != im.proc->pid)
        rst_fail("the restorer does not run with the checkpointed process id (not started by ckptd-init in a fresh pid namespace?)", 0, 0);
    uint64_t xcr0 = cpu_xcr0();
    if (im.proc->xcr0 & ~xcr0)
        rst_fail("this CPU lacks register state the checkpointed process used (XSAVE features differ); restart on a compatible node", 0, 0);

    rst.maxfd = 2;
    for (uint32_t i = 0; i < im.nfds; i++)
        if (im.fds[i].fd > rst.maxfd)
            rst.maxfd = im.fds[i].fd;
    if (rst.nslots && rst.maxfd >= rst.slot_base)
        rst_fail("corrupt restore plan: its shared objects overlap the process's descriptors", 0, 0);
    struct rlimit nofile;
    if (ck_prlimit(RLIMIT_NOFILE, 0, &nofile) == 0 && nofile.rlim_cur < (uint64_t)rst.maxfd + 64) {
        nofile.rlim_cur = nofile.rlim_max < (uint64_t)rst.maxfd + 64 ? nofile.rlim_max : (uint64_t)rst.maxfd + 64;
        ck_prlimit(RLIMIT_NOFILE, &nofile, 0);
    }
    if (rst.status_fd >= 0)
        rst.status_fd = move_high(rst.status_fd);
    for (int i = 0; i < 3; i++) {
        long dup = ck_fcntl(i, F_DUPFD_CLOEXEC, rst.maxfd + 16);
        rst.stdio_fd[i] = dup >= 0 ? (int)dup : -1;
        ck_close(i);
    }

    rst_open_pages(&im);
    for (uint32_t i = 0; rst.lazy && i < im.nvmas; i++)
        if (rst_vma_lazy(&im, &im.vmas[i])) {
            rst_lazy_open();  /* only when something is large enough to fill lazily */
            break;
        }

    /* where this process's own mappings are, vdso and vvar included */
    size_t maps_cap = 1u << 20;
    char *maps = ck_mmap(0, maps_cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ck_mmap_failed(maps))
        rst_fail("out of memory", 0, (long)maps);
    long n = ck_read_file("/proc/self/maps", maps, maps_cap);
    if (n < 0)
        rst_fail("cannot read /proc/self/maps", 0, n);
    ck_parse_maps(maps, (size_t)n, collect_map, 0);
    rst_check_layout(&im);

    /* the hole: [restorer copy][core.img][stacks][vdso parking][scratch] */
    uint64_t self_start = (uint64_t)__ehdr_start & ~4095ull, self_end = page_up((uint64_t)_end);
    uint64_t off = page_up(self_end - self_start);
    rst.core_off = off;
    off += page_up(rst.core_size);
    rst.stacks_off = off;
    off += RST_MAIN_STACK + (uint64_t)im.nthreads * RST_THREAD_STACK;
    rst.park_off = off;
    off += PARK_SIZE;
    rst.scratch_off = off;
    off += page_up(RST_SCRATCH + (uint64_t)im.nfds * 16);
    rst.seal_off = off;
    off += page_up(rst_seal_space());
    rst.hole_len = off;
    rst.hole_start = rst_find_hole(&im, rst.hole_len);

    void *hole = ck_mmap((void *)rst.hole_start, rst.hole_len, PROT_READ | PROT_WRITE | PROT_EXEC,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (ck_mmap_failed(hole) || (uint64_t)hole != rst.hole_start)
        rst_fail("cannot map the restorer's working area", 0, ck_mmap_failed(hole) ? (long)hole : -EEXIST);
    rst_seal_load((uint8_t *)(rst.hole_start + rst.seal_off));  /* before rst is copied: it points there */

    /* every field of rst is final now: copy the program (mapped parts
     * only), then the image metadata, and continue in the copy */
    for (int i = 0; i < rst_ncur_maps; i++) {
        uint64_t s = rst_cur_maps[i].start > self_start ? rst_cur_maps[i].start : self_start;
        uint64_t e = rst_cur_maps[i].end < self_end ? rst_cur_maps[i].end : self_end;
        if (s < e)
            ck_memcpy((void *)(rst.hole_start + (s - self_start)), (void *)s, e - s);
    }
    ck_memcpy((void *)(rst.hole_start + rst.core_off), core, rst.core_size);
    uint64_t delta = rst.hole_start - self_start;
    void (*moved)(uint64_t) = (void (*)(uint64_t))((uint64_t)phase2 + delta);
    rst_switch_stack(rst.hole_start + rst.stacks_off + RST_MAIN_STACK, moved, rst.hole_start + rst.core_off);
}

/* Runs inside the hole: nothing outside it may be touched until rebuilt. */
static void phase2(uint64_t core_addr)
{
    struct rst_image im;
    rst_parse_image(&im, (const uint8_t *)core_addr, rst.core_size);
    rst_park_specials();
    rst_unmap_all_but_hole();
    rst_restore_thp(&im);
    rst_map_image(&im);
    /* before anything else runs in the restored memory */
    rst.track_uffd = rst_track_arm(&im);
    ck_close(rst.pages_fd);
    for (uint64_t i = 0; i < im.nsources; i++)
        ck_close(rst.source_fd[i]);
    rst_place_specials(&im);
    rst_set_mm(&im);
    rst_restore_process(&im);
    rst_restore_fds(&im);
    rst_restore_sem_undo(&im);
    rst_restore_threads(&im);
}
