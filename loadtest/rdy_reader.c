/* rdy_reader: N consumers at RDY r that FIN every message at once, for any RDY.
 *
 * nsq's bench_reader flushes its FINs only when msgCount % rdy > 0.75 * rdy, which is
 * never true at RDY 1 (its FINs then wait in a 4 KiB bufio.Writer and the messages
 * time out): a RDY 1 flow needs a reader that sends each FIN when it reads the
 * message. One thread, epoll over every connection, the V2 protocol by hand; prints
 * bench_reader's result line so the same parser reads both. Built by
 * loadtest/bench_io.py with the system's C compiler (gcc -O2).
 *
 *   rdy_reader HOST:PORT TOPIC CHANNEL CONNS RDY SECONDS
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "hostport.h"

typedef struct {
    int fd;
    char *buf;
    size_t len, cap;
} conn_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            die("send");
        }
        p += w;
        n -= (size_t)w;
    }
}

static uint32_t be32(const char *p) {
    const unsigned char *u = (const unsigned char *)p;
    return (uint32_t)u[0] << 24 | (uint32_t)u[1] << 16 | (uint32_t)u[2] << 8 | u[3];
}

/* blocking: read one frame into c->buf and expect the response OK */
static void expect_ok(conn_t *c, const char *what) {
    char head[8];
    size_t got = 0;
    while (got < 8) {
        ssize_t r = recv(c->fd, head + got, 8 - got, 0);
        if (r <= 0)
            die(what);
        got += (size_t)r;
    }
    uint32_t size = be32(head);
    char data[256];
    if (size < 4 || size - 4 > sizeof data) {
        fprintf(stderr, "%s: frame of %u bytes\n", what, size);
        exit(1);
    }
    got = 0;
    while (got < size - 4) {
        ssize_t r = recv(c->fd, data + got, size - 4 - got, 0);
        if (r <= 0)
            die(what);
        got += (size_t)r;
    }
    if (be32(head + 4) != 0 || size != 6 || memcmp(data, "OK", 2) != 0) {
        fprintf(stderr, "%s: %.*s\n", what, (int)(size - 4), data);
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: rdy_reader HOST:PORT TOPIC CHANNEL CONNS RDY SECONDS\n");
        return 2;
    }
    struct sockaddr_in addr;
    if (parse_hostport("rdy_reader", argv[1], &addr) < 0)
        return 2;
    int nconn = atoi(argv[4]), rdy = atoi(argv[5]);
    double seconds = atof(argv[6]);
    conn_t *conns = calloc((size_t)nconn, sizeof *conns);
    int ep = epoll_create1(0);
    char cmd[512];
    for (int i = 0; i < nconn; i++) {
        conn_t *c = &conns[i];
        c->fd = socket(AF_INET, SOCK_STREAM, 0);
        if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&addr, sizeof addr) < 0)
            die("connect");
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        int n = snprintf(cmd, sizeof cmd, "  V2SUB %s %s\n", argv[2], argv[3]);
        write_all(c->fd, cmd, (size_t)n);
        expect_ok(c, "SUB");
        c->cap = 1 << 20;
        c->buf = malloc(c->cap);
    }
    /* RDY for all only once every consumer is in: the same start as bench_reader */
    for (int i = 0; i < nconn; i++) {
        int n = snprintf(cmd, sizeof cmd, "RDY %d\n", rdy);
        write_all(conns[i].fd, cmd, (size_t)n);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &conns[i]};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, conns[i].fd, &ev) < 0)
            die("epoll_ctl");
    }
    long long msgs = 0, bytes = 0;
    double start = now_s(), end = start + seconds;
    struct epoll_event evs[256];
    char *out = malloc(1 << 20);
    while (now_s() < end) {
        int n = epoll_wait(ep, evs, 256, 50);
        for (int k = 0; k < n; k++) {
            conn_t *c = evs[k].data.ptr;
            if (c->cap - c->len < 65536) {
                c->cap *= 2;
                c->buf = realloc(c->buf, c->cap);
            }
            ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, MSG_DONTWAIT);
            if (r == 0) {
                fprintf(stderr, "the broker closed a connection\n");
                return 1;
            }
            if (r < 0)
                continue;
            c->len += (size_t)r;
            size_t pos = 0, olen = 0;
            while (c->len - pos >= 8) {
                uint32_t size = be32(c->buf + pos);
                if (c->len - pos < 4 + (size_t)size)
                    break;
                uint32_t type = be32(c->buf + pos + 4);
                const char *data = c->buf + pos + 8;
                if (type == 2) {      /* message: ts 8, attempts 2, id 16, body */
                    memcpy(out + olen, "FIN ", 4);
                    memcpy(out + olen + 4, data + 10, 16);
                    out[olen + 20] = '\n';
                    olen += 21;
                    msgs++;
                    bytes += size - 30;
                } else if (type == 1) {
                    fprintf(stderr, "error frame: %.*s\n", (int)(size - 4), data);
                    return 1;
                } else if (size == 15 && memcmp(data, "_heartbeat_", 11) == 0) {
                    memcpy(out + olen, "NOP\n", 4);
                    olen += 4;
                }
                pos += 4 + (size_t)size;
                if (olen > (1 << 20) - 64) {
                    write_all(c->fd, out, olen);
                    olen = 0;
                }
            }
            memmove(c->buf, c->buf + pos, c->len - pos);
            c->len -= pos;
            if (olen)
                write_all(c->fd, out, olen);
        }
    }
    double dur = now_s() - start;
    printf("[rdy_reader] duration: %.6fs - %.3fmb/s - %.3fops/s - %.3fus/op\n", dur,
           bytes / dur / 1048576.0, msgs / dur, msgs ? dur * 1e6 / msgs : 0.0);
    for (int i = 0; i < nconn; i++)
        close(conns[i].fd);
    return 0;
}
