/* An LD_PRELOAD shim that shifts one process's wall clock, for the clock-jump
 * fault test (tests/integration/fencing.rs, scenario 4).
 *
 * libfaketime (Debian's `faketime`) cannot run redis-server: both it and
 * jemalloc call clock_gettime() during their initialisation and recurse
 * (wolfcw/libfaketime#130). This shim needs no initialisation that allocates:
 * it reads the offset, in microseconds (a signed 64-bit little-endian integer),
 * from the file named by QL_CLOCK_OFFSET_FILE, mapped once with raw system
 * calls, and asks the kernel for the real time with raw system calls too.
 * Only CLOCK_REALTIME (and gettimeofday/time) move: a wall-clock step, as NTP
 * makes; monotonic clocks are untouched. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile int64_t *offset_us;
static volatile int state; /* 0: not tried, 1: mapped, 2: no file */

static int64_t offset(void) {
    if (state == 0) {
        const char *path = getenv("QL_CLOCK_OFFSET_FILE");
        long fd = path ? syscall(SYS_open, path, O_RDONLY) : -1;
        if (fd >= 0) {
            long p = syscall(SYS_mmap, 0, 8, PROT_READ, MAP_SHARED, fd, 0);
            syscall(SYS_close, fd);
            if (p != -1) {
                offset_us = (volatile int64_t *)p;
                state = 1;
            } else {
                state = 2;
            }
        } else {
            state = 2;
        }
    }
    return state == 1 ? *offset_us : 0;
}

static int is_realtime(clockid_t id) {
    return id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long r = syscall(SYS_clock_gettime, id, ts);
    if (r == 0 && is_realtime(id)) {
        int64_t ns = (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec + offset() * 1000;
        ts->tv_sec = ns / 1000000000;
        ts->tv_nsec = ns % 1000000000;
    }
    return (int)r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
