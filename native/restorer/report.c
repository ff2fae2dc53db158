/* Errors go to the status file the agent reads after a failed restore. */
#include "restorer.h"

static void emit(const char *level, const char *what, const char *detail, long rc)
{
    char line[1024];
    struct ck_buf b;
    ck_buf_init(&b, line, sizeof(line));
    ck_buf_str(&b, level);
    ck_buf_error(&b, what, detail, rc);
    ck_buf_char(&b, '\n');
    int fd = rst.status_fd >= 0 ? rst.status_fd : 2;
    ck_write(fd, b.data, b.len);
}

void rst_fail(const char *what, const char *detail, long rc)
{
    emit("error: ", what, detail, rc);
    ck_exit_group(1);
}

void rst_note(const char *what, const char *detail, long rc)
{
    emit("warning: ", what, detail, rc);
}
