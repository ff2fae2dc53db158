/*
 * Prints the size of every on-disk struct and the offset of every field as
 * JSON; tests compare it with what cffi computes from the same header, so
 * the Python reader and the C writer can never disagree silently.
 */
#include <stddef.h>
#include <stdio.h>

#include "../include/ckptd/image_format.h"

#define S(t) printf("%s\"%s\": %zu", first ? "" : ", ", #t, sizeof(struct t)), first = 0
#define F(t, f) printf(", \"%s.%s\": %zu", #t, #f, offsetof(struct t, f))

int main(void)
{
    int first = 1;
    printf("{");
    S(ck_header); S(ck_section); S(ck_jmpctx); S(ck_thread); S(ck_vma); S(ck_page_run);
    S(ck_fd); S(ck_epoll_target); S(ck_sigaction); S(ck_rlimit); S(ck_pending); S(ck_file);
    S(ck_itimer); S(ck_posix_timer); S(ck_proc); S(ck_page_source); S(ck_sockopt);
    F(ck_thread, ctx); F(ck_thread, comm); F(ck_vma, first_run); F(ck_page_run, src); F(ck_fd, pos); F(ck_fd, nepoll);
    S(ck_file_lock); F(ck_fd, locks_off); F(ck_fd, sockopt_off);
    S(ck_inotify_watch); F(ck_fd, watches_off); F(ck_fd, target_pid); F(ck_fd, sigmask);
    S(ck_mcast_group); F(ck_fd, mcast_off);
    F(ck_fd, pty_index); F(ck_fd, termios); F(ck_fd, winsize); F(ck_proc, ctty_kind); F(ck_proc, ctty_pgrp);
    F(ck_proc, start_code); F(ck_proc, itimers); F(ck_proc, comm); F(ck_header, sections);
    printf("}\n");
    return 0;
}
