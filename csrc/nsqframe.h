/*
 * nsqframe.h -- the whole C API of pybroker's NSQ V2 frame codec.
 *
 * Each function is called once per batch from pybroker/_native:
 *   nsqf_scan            once per recv(): find every complete command in a buffer
 *   nsqf_scan_fins       once per recv() that starts with FINs: their ids as offsets
 *   nsqf_log_build       once per publish: the topic log records of its messages
 *   nsqf_log_scan        once per read from disk (and recovery): find and check records
 *   nsqf_log_frames      once per delivery batch: message frames from log records
 *   nsqf_log_frames_each once per redelivery batch: the same, attempts per record
 *   nsqf_mpub_split      once per MPUB: validate and split the body into parts
 *   nsqf_if_*            the in-flight table: once per flight, per FIN batch, per timeout
 *
 * Rules: the caller owns every buffer (input and output); no function allocates,
 * keeps state between calls (the in-flight table is the caller's arrays), touches
 * globals or calls back into Python. C knows framing (which verbs carry a body,
 * size limits); policy (states, names, what a command means) stays in Python. All
 * integers on the wire are big-endian.
 */
#ifndef NSQFRAME_H
#define NSQFRAME_H

#include <stddef.h>
#include <stdint.h>

/* Scan status codes (nsqf_stop.status). 0 and 1 are not errors. */
#define NSQF_NEED_MORE          0   /* the rest of the buffer is an incomplete command */
#define NSQF_FULL               1   /* out[] filled up: call again from *used */
#define NSQF_E_LINE_TOO_LONG   -1   /* more than max_line bytes and no '\n' yet */
#define NSQF_E_MSG_SIZE        -2   /* PUB/DPUB body size <= 0 or > max_msg_size */
#define NSQF_E_BODY_SIZE       -3   /* MPUB/IDENTIFY/AUTH body size <= 0 or > max_body_size */

/* nsqf_mpub_split error codes (returned; details in nsqf_stop). */
#define NSQF_E_MPUB_COUNT_READ -10  /* body shorter than the 4-byte count */
#define NSQF_E_MPUB_COUNT      -11  /* count <= 0 or > max_count; value = count */
#define NSQF_E_MPUB_PART_READ  -12  /* part size header cut short; index = part */
#define NSQF_E_MPUB_PART_SIZE  -13  /* part size <= 0; index = part, value = size */
#define NSQF_E_MPUB_PART_BIG   -14  /* part size > max_msg_size; index, value = size */
#define NSQF_E_MPUB_PART_SHORT -15  /* part data cut short; index = part, value = size */
#define NSQF_E_MPUB_TRAILING   -16  /* bytes after the last part; index = n, value = how many */
#define NSQF_E_CAPACITY        -20  /* an output array or buffer is too small; value = needed */
#define NSQF_E_FRAME_SIZE      -21  /* a body longer than NSQF_MAX_BODY cannot be framed */

/* Longest message body a frame can carry: the int32 frame size is 30 + len. */
#define NSQF_MAX_BODY   2147483617  /* INT32_MAX - 30 */

/* One complete command, as offsets into the caller's buffer. */
typedef struct {
    uint32_t line_off;  /* first byte of the verb */
    uint32_t line_len;  /* line length without the '\n' and one optional '\r' before it */
    uint32_t body_off;  /* first body byte (after the int32 size); 0 when no body */
    uint32_t body_len;  /* body length; 0 when the verb carries no body */
} nsqf_span;

/* Limits, from the broker's options. */
typedef struct {
    uint32_t max_line;       /* longest command line accepted, '\n' excluded */
    uint32_t max_msg_size;   /* PUB and DPUB bodies */
    uint32_t max_body_size;  /* MPUB, IDENTIFY and AUTH bodies */
} nsqf_limits;

/* Why a scan stopped, and where. */
typedef struct {
    int32_t  status;    /* NSQF_NEED_MORE, NSQF_FULL or a negative NSQF_E_* code */
    uint32_t line_off;  /* the stopping command's line (== *used) ...             */
    uint32_t line_len;  /* ... and its length if the whole line is there, else 0 */
    int64_t  value;     /* the body size read (as int32) for NSQF_E_MSG_SIZE,
                           NSQF_E_BODY_SIZE and a NEED_MORE waiting for a body;
                           otherwise as documented per function, else 0 */
    uint32_t index;     /* for nsqf_mpub_split: the part the error is about */
} nsqf_stop;

/*
 * Scan buf[0, len) for complete commands.
 *
 * A command is a line ending in '\n'. When its first space-separated token is
 * PUB, DPUB, MPUB, IDENTIFY or AUTH, an int32 size and that many body bytes
 * follow the line; the size is checked against lim (PUB/DPUB: 1..max_msg_size,
 * others: 1..max_body_size) as soon as its 4 bytes are there.
 *
 * A line is complete when a '\n' is at most lim->max_line bytes after its
 * first byte (the limit counts a '\r' but not the '\n'); one '\r' before the
 * '\n' is not part of line_len. Empty lines are commands too (line_len 0).
 *
 * Inputs:  buf/len (caller-owned, not modified; only the first UINT32_MAX
 *          bytes are looked at, so offsets fit in 32 bits), lim,
 *          out[0, cap) caller-allocated, cap >= 1.
 * Outputs: out[0, n) spans in order; *used = bytes covered by those n commands;
 *          *stop says why scanning ended at *used:
 *            NSQF_NEED_MORE  the rest of the buffer (possibly nothing) is an
 *                            incomplete command; line_len > 0 when its line is
 *                            complete but its size or body is not yet (the
 *                            caller may validate the line early), and value =
 *                            the body size once its 4 bytes are there;
 *            NSQF_FULL       cap spans stored and bytes remain: call again
 *                            from *used;
 *            NSQF_E_*        input that can never become valid; line_off/line_len
 *                            give the offending command's line (line_len 0 for
 *                            NSQF_E_LINE_TOO_LONG), value the bad size.
 *          cap < 1 stores nothing and sets status NSQF_E_CAPACITY, value 1.
 * Returns: n, the number of spans stored (0..cap). Never reads past buf + len.
 */
int nsqf_scan(const uint8_t *buf, size_t len, const nsqf_limits *lim,
              nsqf_span *out, int cap, size_t *used, nsqf_stop *stop);

/*
 * Validate an MPUB body [int32 n]([int32 size][size bytes])* and split it.
 *
 * Inputs:  body/len (caller-owned), max_msg_size (part limit), max_count (count
 *          limit, nsqd uses (max_body_size - 4) / 5), offs/lens[0, cap).
 * Outputs: offs[i], lens[i] = offset (into body) and length of part i.
 * Returns: n (>= 1) on success; a negative NSQF_E_MPUB_* code, with err->index
 *          and err->value filled as documented above, checked in nsqd's order
 *          (count, then per part: size header, size > 0, size limit, data; then
 *          trailing bytes, with index = n). value is the part's size for
 *          PART_SIZE, PART_BIG and PART_SHORT, 0 for COUNT_READ and PART_READ.
 *          The whole body is validated first; only then is NSQF_E_CAPACITY
 *          returned, with err->value = n, when n > cap (parts [0, cap) are
 *          stored). A valid body has n <= (len - 4) / 5, so offs/lens of that
 *          many entries always suffice. Only body[0, min(len, UINT32_MAX)) is read.
 */
int nsqf_mpub_split(const uint8_t *body, size_t len, uint32_t max_msg_size,
                    uint32_t max_count, uint32_t *offs, uint32_t *lens, int cap,
                    nsqf_stop *err);

/*
 * Parse the run of FIN commands at the start of buf[0, len): each exactly
 * "FIN " + 16 id bytes + "\n" (21 bytes; any other line ends the run, and so
 * does a line that is not complete yet). A consumer's traffic is mostly such
 * runs; the general nsqf_scan handles everything else.
 *
 * Inputs:  buf/len (caller-owned), offs[0, cap) caller-allocated.
 * Outputs: offs[i] = the value of FIN i's id when the id is 16 lowercase hex
 *          digits (the form pybroker's message ids take: a log offset), else -1;
 *          *used = 21 * n.
 * Returns: n, how many FIN lines were parsed (0..cap).
 */
int nsqf_scan_fins(const uint8_t *buf, size_t len, int64_t *offs, int cap,
                   size_t *used);

/* ---- topic log records (docs/storage.md) -------------------------------------
 * A record: [u32 crc32][u32 length][u64 offset] payload, payload =
 * [i64 deliver_at_ns][i64 ts_ns][u16 attempts][16-byte id][body]; crc32 (zlib's)
 * over length, offset and payload; the id is the offset as 16 lowercase hex digits.
 */
#define NSQF_REC_HEADER   16   /* crc, length, offset */
#define NSQF_PAYLOAD_HEAD 34   /* deliver_at, ts, attempts, id */

/* nsqf_log_scan stop reasons (nsqf_logscan.status). */
#define NSQF_LOG_END        0  /* the buffer ended on a record boundary */
#define NSQF_LOG_PARTIAL    1  /* the rest of the buffer is an incomplete record */
#define NSQF_LOG_FULL       2  /* cap records stored; more may follow */
#define NSQF_LOG_BAD_LENGTH -30 /* a length below 34 or above max_payload */
#define NSQF_LOG_BAD_CRC    -31 /* a checksum mismatch */
#define NSQF_LOG_BAD_OFFSET -32 /* an offset out of sequence */

typedef struct {
    int32_t  status;     /* NSQF_LOG_* */
    uint32_t deferred;   /* records among those stored whose deliver_at != 0 */
    int64_t  max_ts_ns;  /* the largest ts_ns among them (0 if none) */
} nsqf_logscan;

/*
 * Build n records with offsets first, first + 1, ... into out[0, cap): body i
 * is src[offs[i], offs[i] + lens[i]); every record gets ts_ns, deliver_at_ns and
 * attempts 0.
 * Inputs:  out/cap, src (caller-owned), offs[n], lens[n].
 * Outputs: pos[i] = where record i starts in out (pos may be NULL).
 * Returns: bytes written, or NSQF_E_CAPACITY if cap < sum(50 + lens[i]),
 *          NSQF_E_FRAME_SIZE if a body is longer than NSQF_MAX_BODY.
 */
int64_t nsqf_log_build(uint8_t *out, size_t cap, uint64_t first,
                       int64_t ts_ns, int64_t deliver_at_ns,
                       const uint8_t *src, const uint32_t *offs,
                       const uint32_t *lens, uint32_t n, uint32_t *pos);

/*
 * Scan records back to back in buf[0, len) (len < 2^32), the first expected to
 * have offset `first`: store each record's start in pos[0, cap). With
 * check_crc, verify checksums. A record's payload may be at most max_payload.
 * Returns: how many records were stored; *used = bytes they cover; st says why
 * the scan stopped, how many of them are deferred and their largest ts.
 */
int nsqf_log_scan(const uint8_t *buf, size_t len, uint64_t first, int check_crc,
                  uint32_t max_payload, uint32_t *pos, int cap, size_t *used,
                  nsqf_logscan *st);

/*
 * NSQ message frames for the n records starting at buf + pos[0..n): each
 * [u32 30 + len(body)][u32 2][ts][attempts][id][body]. attempts < 0: each
 * record's stored attempts + 1; else that value (clamped to 65535) for all.
 * Returns: bytes written to out[0, cap), or NSQF_E_CAPACITY.
 */
int64_t nsqf_log_frames(uint8_t *out, size_t cap, const uint8_t *buf,
                        const uint32_t *pos, uint32_t n, int32_t attempts);

/*
 * The same frames, each record's attempts its stored attempts plus adds[i]
 * (clamped to 65535): one call for a batch of redeliveries, each message with the
 * deliveries its channel counted since it was written.
 * Returns: bytes written to out[0, cap), or NSQF_E_CAPACITY.
 */
int64_t nsqf_log_frames_each(uint8_t *out, size_t cap, const uint8_t *buf,
                             const uint32_t *pos, const uint32_t *adds, uint32_t n);

/* ---- the publish lane (server/lane.py) ------------------------------------------
 * One call per loop turn over the bytes just received from every publishing
 * connection: which of them hold only complete, well-formed PUB/MPUB commands to
 * one topic (answered without a Command object each), and the message parts.
 */
#define NSQF_LANE_FAST 0   /* complete PUB/MPUB commands, one topic, all valid */
#define NSQF_LANE_SLOW 1   /* anything else: the caller runs the general path */
#define NSQF_LANE_FIELDS 6 /* uint32s per connection in res[] */
#define NSQF_LANE_NAMES 16 /* distinct topic names matched per call (field 5) */

/*
 * Connection i's bytes are buf[starts[i], starts[i] + lens_in[i]). FAST when
 * they are one or more whole commands, each exactly "PUB <name>\n" + int32 size
 * + body (0 < size <= max_msg_size) or "MPUB <name>\n" + int32 size + body
 * (0 < size <= max_body_size, a valid MPUB body as nsqf_mpub_split checks it,
 * with at most max_count parts), all naming the same topic (name bytes in
 * [A-Za-z0-9._#-], 1..max_line - 5 of them; the caller checks the name itself),
 * and the parts fit in offs/lens. Anything else (another verb, a '\r', an
 * extra parameter, an incomplete command, a size or body that nsqd refuses) is
 * SLOW, with nothing stored for it, so the general path answers it as ever.
 * Outputs: res[6 i .. 6 i + 5] = status, name offset (in buf), name length,
 *          commands, messages (1 << 31 added when the first command is MPUB),
 *          and the index of the first FAST connection of this call naming the
 *          same topic (i itself for the first; for the first NSQF_LANE_NAMES
 *          distinct names, later ones are always their own);
 *          the messages of FAST connections, in connection order, at
 *          offs/lens[0, returned) (offsets into buf).
 * Returns: the number of parts stored.
 */
int nsqf_pub_lane(const uint8_t *buf, const uint32_t *starts, const uint32_t *lens_in,
                  int n, const nsqf_limits *lim, uint32_t max_count,
                  uint32_t *offs, uint32_t *lens, uint32_t parts_cap, uint32_t *res);

/*
 * The FIN lane (FINs and REQs): connection i's bytes are buf[starts[i], starts[i] +
 * lens_in[i]). When they are nothing but whole FIN lines (as nsqf_scan_fins parses
 * them) and REQ lines ("REQ " + 16 lowercase hex digits of a value up to INT64_MAX
 * + " " + 1 to 18 decimal digits + "\n"), each line's offset is stored at
 * offs[at + k] and its timeout in ms at ms[at + k] (-1 for a FIN), in connection
 * order, and res[i] = how many lines; otherwise res[i] = NSQF_FIN_LANE_SLOW and
 * nothing is stored (a REQ line of any other shape, even one the general path
 * answers with an error, goes that way).
 * Returns: the number of lines stored (at most cap; a connection that would pass
 * cap is SLOW).
 */
#define NSQF_FIN_LANE_SLOW 4294967295
int nsqf_fin_lane(const uint8_t *buf, const uint32_t *starts, const uint32_t *lens_in,
                  int n, int64_t *offs, int64_t *ms, int cap, uint32_t *res);

/*
 * Batched socket I/O (csrc/nsqio.c): a loop turn's many small reads and writes in
 * one call each, so a message's trip costs its system call and not also a Python
 * call around it. Sockets are non-blocking; the GIL is released for the call.
 *
 * nsqf_recv_many: reads socket fds[i] (one recv, at most piece bytes) into buf,
 * the sockets' bytes packed one after another from offset 0; starts[i] is where
 * socket i's bytes begin and got[i] how many were read (0: the peer closed), or
 * -errno (-EAGAIN: nothing to read now). Stops before a socket whose piece could
 * pass cap. Returns how many sockets were read (0..n).
 */
int nsqf_recv_many(const int32_t *fds, int n, uint8_t *buf, uint32_t cap,
                   uint32_t piece, uint32_t *starts, int32_t *got);

/*
 * nsqf_send_many: sends socket fds[i] its lens[i] bytes of buf, the sockets'
 * bytes lying one after another from offset 0 (one send each, MSG_NOSIGNAL,
 * retried on EINTR); sent[i] = bytes the socket took, or -errno (-EAGAIN: none
 * now).
 */
void nsqf_send_many(const int32_t *fds, int n, const uint8_t *buf,
                    const uint32_t *lens, int32_t *sent);

/*
 * A sender: one thread of its own that runs nsqf_send_many for its event loop, so a
 * turn's writes (their system calls, loopback's receive path within them) take
 * another core while the loop goes on. One job at a time; the caller keeps fds, buf,
 * lens and sent alive and unchanged, and writes or closes none of those sockets,
 * until nsqf_sender_wait has returned. The only C in the codec that allocates (the
 * sender) or starts a thread. Linux only (futex); elsewhere nsqf_sender_new is NULL.
 *
 * nsqf_sender_new: a sender with its thread started; NULL when either fails. After a
 * job the thread looks for the next for spin_ns (yielding its core between looks)
 * before it sleeps; a post to a sleeping thread costs a futex wake-up.
 * nsqf_sender_post: hands the thread a job (the one before must have been waited
 * for); returns at once.
 * nsqf_sender_wait: returns once the posted job is done (sent[] filled); at once
 * when none is posted.
 * nsqf_sender_busy: 1 while the posted job runs (wait would sleep), else 0.
 * nsqf_sender_free: stops the thread (after any posted job) and frees the sender.
 */
typedef struct nsqf_sender nsqf_sender;
nsqf_sender *nsqf_sender_new(uint64_t spin_ns);
void nsqf_sender_post(nsqf_sender *s, const int32_t *fds, int n, const uint8_t *buf,
                      const uint32_t *lens, int32_t *sent);
void nsqf_sender_wait(nsqf_sender *s);
int nsqf_sender_busy(nsqf_sender *s);
void nsqf_sender_free(nsqf_sender *s);

/*
 * The in-flight table (csrc/inflight.c): which of a channel's offsets are in flight,
 * and in which flight (a slot number the caller gives each flight; the caller keeps
 * the flight objects). Open addressing with linear probing; a removal shifts the
 * entries behind it back, so lookups never pass tombstones however many messages come
 * and go. One call per flight added, per batch of FINs, per timed-out flight.
 *
 * The caller owns every array: keys and slots (cap entries, cap a power of two, keys
 * -1 where empty), live and tags (nslots entries: how many entries map to each slot,
 * and the client each slot's flight went to). It keeps used + what it adds at most
 * cap / 2 (growing: a larger table, then nsqf_if_rehash) and every slot it names below
 * nslots. No function allocates.
 */
typedef struct {
    int64_t *keys;
    int32_t *slots;
    uint32_t cap;
    uint32_t used;
    int64_t *live;
    uint64_t *tags;
    uint32_t nslots;
} nsqf_inflight;

/* k flights: flight i is offsets firsts[i] .. firsts[i] + ns[i] - 1, in slot slots[i]
 * (its live count set to ns[i], its tag to tags[i]). Returns how many of the offsets
 * were in the table already (moved to the new slot; 0 unless the caller has a bug). */
int nsqf_if_add(nsqf_inflight *t, const int64_t *firsts, const int64_t *ns,
                const int32_t *slots, const uint64_t *tags, int k);

/* n FINs, offset offs[i] from the client tagged tags[i] (a loop turn's FINs of several
 * clients in one call). An offset in the table in a slot of that tag is removed; the
 * others fail: failed[j] = 2 * i + (1: the offset is in flight to another client, 0:
 * it is not in flight) for the i-th offset, in order, and *nfailed their count. Slots
 * whose last entry went are written to emptied (room for n); returns how many. */
int nsqf_if_fin(nsqf_inflight *t, const uint64_t *tags, const int64_t *offs, int n,
                int32_t *failed, int *nfailed, int32_t *emptied);

/* One flight (nsqf_if_add for k = 1, without the arrays); returns as it does. */
int nsqf_if_add1(nsqf_inflight *t, int64_t first, int64_t n, int32_t slot, uint64_t tag);

/* One FIN (nsqf_if_fin for n = 1, without the arrays): 4 * slot + (2 if that slot has
 * nothing left in flight), or -1 (not in flight) or -2 (in flight to another client). */
int64_t nsqf_if_fin1(nsqf_inflight *t, uint64_t tag, int64_t off);

/* The slot of off, or -1. */
int32_t nsqf_if_get(const nsqf_inflight *t, int64_t off);

/* Remove off: its slot (its live count less one), or -1 if it was not in the table. */
int32_t nsqf_if_pop(nsqf_inflight *t, int64_t off);

/* Remove the offsets first .. first + n - 1 that are in slot slot; they are written
 * to out (room for n) in order; returns how many. */
int nsqf_if_take(nsqf_inflight *t, int64_t first, int64_t n, int32_t slot, int64_t *out);

/* Every entry: offs[i], slots[i] (room for t->used); returns how many. */
int nsqf_if_dump(const nsqf_inflight *t, int64_t *offs, int32_t *slots);

/* The lowest offset in the table, or -1 if it is empty. */
int64_t nsqf_if_min(const nsqf_inflight *t);

/* Insert every entry of from into to (empty, its cap at least twice from's used). */
void nsqf_if_rehash(const nsqf_inflight *from, nsqf_inflight *to);

/* The offsets in the table at or after from, in no order, to out (room for t->used);
 * returns how many. */
int nsqf_if_from(const nsqf_inflight *t, int64_t from, int64_t *out);

/* Of the n offsets of a (any order), keep those at or after from (>= 0), sorted
 * ascending, repeats dropped, in a; tmp has room for n; no allocation. A radix sort
 * of each offset less the lowest, 11 bits a pass and only as many passes as the
 * widest difference needs (three for offsets within 2^33 of each other): linear in n
 * (250,000 offsets: about 2 ms). Returns how many are kept. */
int64_t nsqf_sort_from(int64_t *a, int64_t *tmp, int64_t n, int64_t from);

/* The n pairs (keys[i], vals[i]) sorted by key, ascending, in keys and vals (stable:
 * equal keys keep their order); tk and tv have room for n; no allocation. The same
 * radix sort as nsqf_sort_from (a table's dump in offset order, for a channel state's
 * chunks: 250,000 pairs in about 2 ms). */
void nsqf_sort_pairs(int64_t *keys, int32_t *vals, int64_t *tk, int32_t *tv, int64_t n);

/* keys sorted as nsqf_sort_pairs sorts them, and order[i] the index keys[i] had
 * (n < 2^31): the permutation that sorts a list by those keys. Returns 1 when the
 * keys were in order already (order is then 0, 1, ...; nothing was moved), else 0. */
int nsqf_sort_order(int64_t *keys, int32_t *order, int64_t *tk, int32_t *tv, int64_t n);

/* out[i] = table[idx[i]] for each of the n indexes (0 for an index outside the
 * ntable entries): a table's dump of slots turned into a value of each slot's flight
 * (its attempts, for a channel state's entries) without a Python object per entry. */
void nsqf_gather_i32(const int32_t *table, int64_t ntable, const int32_t *idx,
                     int32_t *out, int64_t n);

/* The keys of a (na of them, ascending, each once) that b (nb, ascending, each once)
 * holds too, in out_k, and beside each the value vb has for it in b, in out_v (room
 * for the smaller of na and nb in each): one merge, linear in na + nb (a channel's
 * skipped offsets against its topic's DPUBs). Returns how many. */
int64_t nsqf_intersect_i64(const int64_t *a, int64_t na, const int64_t *b,
                           const int64_t *vb, int64_t nb, int64_t *out_k, int64_t *out_v);

/* CRC-32 as zlib.crc32 computes it: by carry-less multiplication where the CPU has it
 * (x86-64 with PCLMULQDQ and SSE4.1) and the buffer is 64 bytes or more, else by
 * tables sliced by 8; every record's checksum is made and checked this way. */
uint32_t nsqf_crc32(const uint8_t *p, size_t n);

/* Whether CRCs use carry-less multiplication now (1) or the tables (0); use >= 0
 * first turns that way on or off (the tests compare the two), -1 only asks. */
int nsqf_crc_clmul(int use);

#endif /* NSQFRAME_H */
