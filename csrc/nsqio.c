/*
 * Batched socket I/O for the event loops: see nsqframe.h (nsqf_recv_many,
 * nsqf_send_many). Plain POSIX calls; nothing here keeps state between calls.
 */
#define _GNU_SOURCE
#include "nsqframe.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/types.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

int nsqf_recv_many(const int32_t *fds, int n, uint8_t *buf, uint32_t cap,
                   uint32_t piece, uint32_t *starts, int32_t *got)
{
    uint32_t pos = 0;
    int i;
    for (i = 0; i < n; i++) {
        ssize_t r;
        if (piece > cap - pos)
            break;
        do {
            r = recv(fds[i], buf + pos, piece, 0);
        } while (r < 0 && errno == EINTR);
        starts[i] = pos;
        if (r < 0) {
            got[i] = -errno;
        } else {
            got[i] = (int32_t)r;
            pos += (uint32_t)r;
        }
    }
    return i;
}

void nsqf_send_many(const int32_t *fds, int n, const uint8_t *buf,
                    const uint32_t *lens, int32_t *sent)
{
    size_t at = 0;
    int i;
    for (i = 0; i < n; i++) {
        ssize_t r;
        do {
            r = send(fds[i], buf + at, lens[i], MSG_NOSIGNAL);
        } while (r < 0 && errno == EINTR);
        sent[i] = r < 0 ? -errno : (int32_t)r;
        at += lens[i];
    }
}
