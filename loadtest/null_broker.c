/* null_broker: the least work a broker can do for nsq's bench programs, to show what a
 * flow allows on this machine (loadtest/bench_io.py, kind "ceiling").
 *
 * One thread, epoll, and per readable connection one recv and at most one send: the
 * fewest system calls a broker can make for a client with one command in flight. It
 * speaks just enough of the V2 protocol for bench_writer, bench_reader, rdy_reader and
 * bench_topic_log's fill: the magic; IDENTIFY, PUB, MPUB, DPUB, SUB and NOP answered OK
 * (NOP not at all, as nsqd); RDY n and FIN keep a subscribed connection at n messages
 * in flight, each the same prebuilt message (id counting up), as if the topic had an
 * endless backlog; what a socket does not take is sent when it is writable, and the
 * connection is not read meanwhile. Nothing is stored, checked or counted beyond that: no real broker
 * can do less per message, so its rate is a ceiling for the flow, not a broker.
 *
 *   null_broker HOST:PORT [BODY_SIZE]    (port 0: a free port; the address is printed)
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
#include <unistd.h>

#include "hostport.h"

#define IN_CAP (1 << 20)
#define OUT_CAP (4 << 20)

typedef struct {
    int fd, magic, subscribed;
    long rdy, in_flight;
    size_t len;
    char *owed;                  /* what a send did not take (then EPOLLOUT, no reads) */
    size_t owed_len, owed_at;
    char in[IN_CAP];
} conn_t;

static const char OK_FRAME[10] = {0, 0, 0, 6, 0, 0, 0, 0, 'O', 'K'};
static char *msg_frame;          /* one message frame, its id rewritten per send */
static size_t msg_len;
static unsigned long long next_id;
static char out[OUT_CAP];

static uint32_t be32(const char *p) {
    const unsigned char *u = (const unsigned char *)p;
    return (uint32_t)u[0] << 24 | (uint32_t)u[1] << 16 | (uint32_t)u[2] << 8 | u[3];
}

static void put32(char *p, uint32_t v) {
    p[0] = (char)(v >> 24);
    p[1] = (char)(v >> 16);
    p[2] = (char)(v >> 8);
    p[3] = (char)v;
}

/* messages up to the connection's RDY, appended to out at *olen */
static void fill(conn_t *c, size_t *olen) {
    static const char hex[] = "0123456789abcdef";
    while (c->subscribed && c->in_flight < c->rdy && *olen + msg_len <= OUT_CAP) {
        char *m = out + *olen;
        memcpy(m, msg_frame, msg_len);
        unsigned long long id = next_id++;
        for (int i = 15; i >= 0; i--, id >>= 4)
            m[8 + 10 + i] = hex[id & 15];
        *olen += msg_len;
        c->in_flight++;
    }
}

/* the commands complete in c->in: replies appended to out; -1: close */
static int run(conn_t *c, size_t *olen) {
    size_t pos = 0;
    if (!c->magic) {
        if (c->len < 4)
            return 0;
        c->magic = 1;
        pos = 4;
    }
    for (;;) {
        char *line = c->in + pos;
        char *nl = memchr(line, '\n', c->len - pos);
        if (!nl)
            break;
        size_t ll = (size_t)(nl - line), next = pos + ll + 1;
        int has_body = (ll >= 4 && !memcmp(line, "PUB ", 4)) ||
                       (ll >= 5 && !memcmp(line, "MPUB ", 5)) ||
                       (ll >= 5 && !memcmp(line, "DPUB ", 5)) ||
                       (ll >= 8 && !memcmp(line, "IDENTIFY", 8));
        if (has_body) {
            if (c->len - next < 4)
                break;
            uint32_t size = be32(c->in + next);
            if (size > IN_CAP - 4 - (ll + 1))
                return -1;
            if (c->len - next - 4 < size)
                break;
            next += 4 + size;
        }
        if (ll >= 4 && !memcmp(line, "FIN ", 4)) {
            if (c->in_flight > 0)
                c->in_flight--;
        } else if (ll >= 4 && !memcmp(line, "RDY ", 4)) {
            c->rdy = strtol(line + 4, NULL, 10);
        } else if (ll >= 4 && !memcmp(line, "SUB ", 4)) {
            c->subscribed = 1;
            memcpy(out + *olen, OK_FRAME, sizeof OK_FRAME);
            *olen += sizeof OK_FRAME;
        } else if (has_body) {
            memcpy(out + *olen, OK_FRAME, sizeof OK_FRAME);
            *olen += sizeof OK_FRAME;
        } else if (ll == 3 && !memcmp(line, "CLS", 3)) {
            return -1;
        }
        pos = next;
        if (*olen > OUT_CAP - 4096)
            break;
    }
    memmove(c->in, c->in + pos, c->len - pos);
    c->len -= pos;
    fill(c, olen);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: null_broker HOST:PORT [BODY_SIZE]\n");
        return 2;
    }
    struct sockaddr_in a;
    if (parse_hostport("null_broker", argv[1], &a) < 0)
        return 2;
    size_t body = argc > 2 ? (size_t)atol(argv[2]) : 200;
    msg_len = 4 + 4 + 8 + 2 + 16 + body;
    msg_frame = calloc(1, msg_len);
    put32(msg_frame, (uint32_t)(msg_len - 4));
    put32(msg_frame + 4, 2);
    msg_frame[8 + 9] = 1;                      /* attempts 1 */
    memset(msg_frame + 8 + 10 + 16, 'x', body);

    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) < 0 || listen(ls, 1024) < 0) {
        perror("null_broker: listen");
        return 1;
    }
    socklen_t alen = sizeof a;
    getsockname(ls, (struct sockaddr *)&a, &alen);
    char host[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a.sin_addr, host, sizeof host);
    printf("null_broker listening on %s:%d\n", host, ntohs(a.sin_port));
    fflush(stdout);

    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        for (int i = 0; i < n; i++) {
            conn_t *c = evs[i].data.ptr;
            if (c == NULL) {
                int fd;
                while ((fd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn_t *nc = calloc(1, sizeof *nc);
                    nc->fd = fd;
                    struct epoll_event e = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
                }
                continue;
            }
            if (c->owed) {             /* writable again: send what is owed, then read */
                ssize_t w = send(c->fd, c->owed + c->owed_at, c->owed_len - c->owed_at,
                                 MSG_NOSIGNAL);
                if (w < 0 && errno != EAGAIN && errno != EINTR)
                    goto gone;
                c->owed_at += w > 0 ? (size_t)w : 0;
                if (c->owed_at < c->owed_len)
                    continue;
                free(c->owed);
                c->owed = NULL;
                struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
                epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e);
                continue;
            }
            ssize_t r = recv(c->fd, c->in + c->len, IN_CAP - c->len, 0);
            if (r < 0 && (errno == EAGAIN || errno == EINTR))
                continue;
            size_t olen = 0;
            if (r <= 0 || (c->len += (size_t)r, run(c, &olen) < 0))
                goto gone;
            if (olen) {                /* one send; the rest owed */
                ssize_t w = send(c->fd, out, olen, MSG_NOSIGNAL);
                if (w < 0 && errno != EAGAIN && errno != EINTR)
                    goto gone;
                size_t took = w > 0 ? (size_t)w : 0;
                if (took < olen) {
                    c->owed = malloc(olen - took);
                    memcpy(c->owed, out + took, olen - took);
                    c->owed_len = olen - took;
                    c->owed_at = 0;
                    struct epoll_event e = {.events = EPOLLOUT, .data.ptr = c};
                    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e);
                }
            }
            continue;
        gone:
            close(c->fd);              /* also leaves the epoll set */
            free(c->owed);
            free(c);
        }
    }
}
