/*
 * nsqframe.c -- pybroker's NSQ V2 frame codec (see nsqframe.h for the contract).
 *
 * Pure functions over caller-owned memory: no allocation, no globals, no I/O,
 * no calls into Python. Every read is bounds-checked against the length the
 * caller passed; integers on the wire are big-endian. The pure-Python module
 * pybroker/_native/_pure.py is the executable spec this file must match.
 */
#include "nsqframe.h"
#include "nsqf_crc32_table.h"

#include <string.h>

/* Offsets in nsqf_span and nsqf_stop are uint32_t: never look further. */
#define NSQF_MAX_SCAN ((size_t)UINT32_MAX)

/* Read a big-endian int32 from p[0, 4); the caller has checked the bounds. */
static int32_t get_i32(const uint8_t *p)
{
    uint32_t u = ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) |
                 ((uint32_t)p[2] << 8) | (uint32_t)p[3];
    /* Two's complement conversion without implementation-defined behaviour. */
    if (u <= (uint32_t)INT32_MAX)
        return (int32_t)u;
    return (int32_t)(u - (uint32_t)INT32_MAX - 1u) + INT32_MIN;
}

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    put_u32(p, (uint32_t)(v >> 32));
    put_u32(p + 4, (uint32_t)v);
}

/* Which verbs carry an [int32 size][body] after their line. */
enum body_kind { BODY_NONE = 0, BODY_MSG, BODY_LARGE };

/*
 * Classify the first space-separated token of line[0, n). Only the whole
 * token counts: "PUBX t" carries no body, a bare "PUB" does (as in nsqd,
 * which dispatches on params[0] and reads the size whatever the params).
 */
static enum body_kind body_kind_of(const uint8_t *line, size_t n)
{
    const uint8_t *sp = memchr(line, ' ', n);
    size_t vlen = sp ? (size_t)(sp - line) : n;

    switch (vlen) {
    case 3:
        return memcmp(line, "PUB", 3) == 0 ? BODY_MSG : BODY_NONE;
    case 4:
        if (memcmp(line, "DPUB", 4) == 0)
            return BODY_MSG;
        if (memcmp(line, "MPUB", 4) == 0 || memcmp(line, "AUTH", 4) == 0)
            return BODY_LARGE;
        return BODY_NONE;
    case 8:
        return memcmp(line, "IDENTIFY", 8) == 0 ? BODY_LARGE : BODY_NONE;
    default:
        return BODY_NONE;
    }
}

static void set_stop(nsqf_stop *stop, int32_t status, size_t line_off,
                     size_t line_len, int64_t value)
{
    stop->status = status;
    stop->line_off = (uint32_t)line_off;
    stop->line_len = (uint32_t)line_len;
    stop->value = value;
    stop->index = 0;
}

/*
 * nsqf_scan: see nsqframe.h. Finds every complete command in buf[0, len)
 * (at most cap of them), stores their spans in out, sets *used and *stop.
 * Reads only buf[0, min(len, UINT32_MAX)); writes only out[0, cap), *used
 * and *stop. A cap < 1 stores nothing and reports NSQF_E_CAPACITY.
 */
int nsqf_scan(const uint8_t *buf, size_t len, const nsqf_limits *lim,
              nsqf_span *out, int cap, size_t *used, nsqf_stop *stop)
{
    size_t pos = 0;
    int n = 0;

    if (len > NSQF_MAX_SCAN)
        len = NSQF_MAX_SCAN;
    *used = 0;
    if (cap < 1) {
        set_stop(stop, NSQF_E_CAPACITY, 0, 0, 1);
        return 0;
    }

    for (;;) {
        size_t avail = len - pos;
        /* The '\n' may be at most max_line bytes after the line's start. */
        size_t window = avail;
        const uint8_t *nl;
        size_t line_end, line_len, next;
        enum body_kind kind;

        if (avail == 0) {
            set_stop(stop, NSQF_NEED_MORE, pos, 0, 0);
            break;
        }
        if (n == cap) {
            set_stop(stop, NSQF_FULL, pos, 0, 0);
            break;
        }
        if ((size_t)lim->max_line < window)
            window = (size_t)lim->max_line + 1;
        nl = memchr(buf + pos, '\n', window);
        if (nl == NULL) {
            if (avail > (size_t)lim->max_line)
                set_stop(stop, NSQF_E_LINE_TOO_LONG, pos, 0, 0);
            else
                set_stop(stop, NSQF_NEED_MORE, pos, 0, 0);
            break;
        }
        line_end = (size_t)(nl - buf);
        next = line_end + 1;
        /* Strip one '\r' before the '\n', as nsqd's IOLoop does. */
        if (line_end > pos && buf[line_end - 1] == '\r')
            line_end--;
        line_len = line_end - pos;

        kind = body_kind_of(buf + pos, line_len);
        if (kind == BODY_NONE) {
            out[n].line_off = (uint32_t)pos;
            out[n].line_len = (uint32_t)line_len;
            out[n].body_off = 0;
            out[n].body_len = 0;
            n++;
            pos = next;
            continue;
        }

        /* A body verb: [int32 size][size bytes] follow the line. */
        if (len - next < 4) {
            set_stop(stop, NSQF_NEED_MORE, pos, line_len, 0);
            break;
        }
        {
            int32_t size = get_i32(buf + next);
            uint32_t limit = kind == BODY_MSG ? lim->max_msg_size
                                              : lim->max_body_size;
            size_t body_off = next + 4;

            if (size <= 0 || (uint32_t)size > limit) {
                set_stop(stop, kind == BODY_MSG ? NSQF_E_MSG_SIZE
                                                : NSQF_E_BODY_SIZE,
                         pos, line_len, (int64_t)size);
                break;
            }
            if (len - body_off < (size_t)size) {
                set_stop(stop, NSQF_NEED_MORE, pos, line_len, (int64_t)size);
                break;
            }
            out[n].line_off = (uint32_t)pos;
            out[n].line_len = (uint32_t)line_len;
            out[n].body_off = (uint32_t)body_off;
            out[n].body_len = (uint32_t)size;
            n++;
            pos = body_off + (size_t)size;
        }
    }
    *used = pos;
    return n;
}

static int mpub_fail(nsqf_stop *err, int code, uint32_t index, int64_t value)
{
    err->status = code;
    err->line_off = 0;
    err->line_len = 0;
    err->index = index;
    err->value = value;
    return code;
}

/*
 * nsqf_mpub_split: see nsqframe.h. Validates the whole body in nsqd's order
 * before reporting NSQF_E_CAPACITY, so a caller may size offs/lens from the
 * body length; stores only parts [0, cap). Reads only body[0, len).
 */
int nsqf_mpub_split(const uint8_t *body, size_t len, uint32_t max_msg_size,
                    uint32_t max_count, uint32_t *offs, uint32_t *lens, int cap,
                    nsqf_stop *err)
{
    int32_t count;
    size_t pos = 4;
    int32_t i;

    if (len > NSQF_MAX_SCAN)
        len = NSQF_MAX_SCAN;
    if (len < 4)
        return mpub_fail(err, NSQF_E_MPUB_COUNT_READ, 0, 0);
    count = get_i32(body);
    if (count <= 0 || (uint32_t)count > max_count)
        return mpub_fail(err, NSQF_E_MPUB_COUNT, 0, (int64_t)count);

    for (i = 0; i < count; i++) {
        int32_t size;

        if (len - pos < 4)
            return mpub_fail(err, NSQF_E_MPUB_PART_READ, (uint32_t)i, 0);
        size = get_i32(body + pos);
        pos += 4;
        if (size <= 0)
            return mpub_fail(err, NSQF_E_MPUB_PART_SIZE, (uint32_t)i, size);
        if ((uint32_t)size > max_msg_size)
            return mpub_fail(err, NSQF_E_MPUB_PART_BIG, (uint32_t)i, size);
        if (len - pos < (size_t)size)
            return mpub_fail(err, NSQF_E_MPUB_PART_SHORT, (uint32_t)i, size);
        if (i < cap) {
            offs[i] = (uint32_t)pos;
            lens[i] = (uint32_t)size;
        }
        pos += (size_t)size;
    }
    if (pos != len)
        return mpub_fail(err, NSQF_E_MPUB_TRAILING, (uint32_t)count,
                         (int64_t)(len - pos));
    if (count > cap)
        return mpub_fail(err, NSQF_E_CAPACITY, 0, (int64_t)count);
    return (int)count;
}


/* The value of a lowercase hex digit, or -1. */
static int hex_lower(uint8_t c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/*
 * nsqf_scan_fins: see nsqframe.h. Stops at the first line that is not a
 * complete 21-byte FIN line, so the caller hands the rest to nsqf_scan.
 */
int nsqf_scan_fins(const uint8_t *buf, size_t len, int64_t *offs, int cap,
                   size_t *used)
{
    int n = 0;
    size_t pos = 0;

    while (n < cap && len - pos >= 21) {
        const uint8_t *p = buf + pos;
        uint64_t v = 0;
        int k, ok = 1;

        if (p[0] != 'F' || p[1] != 'I' || p[2] != 'N' || p[3] != ' ' || p[20] != '\n')
            break;
        for (k = 4; k < 20; k++) {
            int d = hex_lower(p[k]);
            if (d < 0) {
                if (p[k] == ' ' || p[k] == '\n')
                    break;        /* not one 16-byte parameter: not this fast path */
                ok = 0;
                continue;
            }
            v = (v << 4) | (uint64_t)d;
        }
        if (k < 20)
            break;
        offs[n++] = ok && v <= (uint64_t)INT64_MAX ? (int64_t)v : -1;
        pos += 21;
    }
    *used = pos;
    return n;
}

/* ---- topic log records ---------------------------------------------------- */

static uint64_t get_u64(const uint8_t *p)
{
    return ((uint64_t)p[0] << 56) | ((uint64_t)p[1] << 48) | ((uint64_t)p[2] << 40) |
           ((uint64_t)p[3] << 32) | ((uint64_t)p[4] << 24) | ((uint64_t)p[5] << 16) |
           ((uint64_t)p[6] << 8) | (uint64_t)p[7];
}

static uint32_t get_u32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) |
           (uint32_t)p[3];
}

/* CRC-32 by carry-less multiplication (x86-64 with PCLMULQDQ and SSE4.1, chosen at
 * run time): the buffer is folded 64 bytes a step into four 128-bit lanes, the lanes
 * into one, then 16 bytes a step, and the 128 bits left are reduced to the 32-bit
 * remainder (Barrett). The method is Intel's "Fast CRC Computation for Generic
 * Polynomials Using PCLMULQDQ Instruction" (2009), in its bit-reflected form. Each
 * constant follows from zlib's polynomial P = 0x104C11DB7 alone: FOLD(e) is x^e mod P,
 * its 32 bits reflected, shifted left by one (so FOLD(544) = 0x154442BD4); P_R is P
 * reflected over 33 bits and MU_R floor(x^64 / P) reflected over 33 bits
 * (tests/unit/test_crc32.py derives them again). About three to four times the
 * sliced tables' speed on a 200-byte record. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define NSQF_CLMUL 1

#define FOLD_512_PLUS_32 0x154442BD4ull   /* fold by four lanes: 4 * 128 + 32 */
#define FOLD_512_MINUS_32 0x1C6E41596ull  /*                     4 * 128 - 32 */
#define FOLD_128_PLUS_32 0x1751997D0ull   /* fold by one lane:   128 + 32 */
#define FOLD_128_MINUS_32 0x0CCAA009Eull  /*                     128 - 32 */
#define FOLD_64 0x163CD6124ull            /* 64 bits to 32: x^64 */
#define P_R 0x1DB710641ull
#define MU_R 0x1F7011641ull

__attribute__((target("pclmul,sse4.1")))
static inline __m128i clmul_fold(__m128i acc, __m128i k, __m128i next)
{
    /* acc's low half times k's low, its high half times k's high, and the next 16
     * bytes: acc moved 128 bits further on, modulo P */
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x00),
                                       _mm_clmulepi64_si128(acc, k, 0x11)), next);
}

/* The CRC register (not inverted) after n bytes of p, n >= 64 and a multiple of 16. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_clmul(const uint8_t *p, size_t n, uint32_t c)
{
    const __m128i by4 = _mm_set_epi64x((long long)FOLD_512_MINUS_32,
                                       (long long)FOLD_512_PLUS_32);
    const __m128i by1 = _mm_set_epi64x((long long)FOLD_128_MINUS_32,
                                       (long long)FOLD_128_PLUS_32);
    const __m128i low32 = _mm_set_epi32(0, -1, 0, -1);
    __m128i a = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)c));
    __m128i b = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i d = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(p + 48));
    size_t at = 64;

    for (; at + 64 <= n; at += 64) {
        a = clmul_fold(a, by4, _mm_loadu_si128((const __m128i *)(p + at)));
        b = clmul_fold(b, by4, _mm_loadu_si128((const __m128i *)(p + at + 16)));
        d = clmul_fold(d, by4, _mm_loadu_si128((const __m128i *)(p + at + 32)));
        e = clmul_fold(e, by4, _mm_loadu_si128((const __m128i *)(p + at + 48)));
    }
    a = clmul_fold(a, by1, b);
    a = clmul_fold(a, by1, d);
    a = clmul_fold(a, by1, e);
    for (; at + 16 <= n; at += 16)
        a = clmul_fold(a, by1, _mm_loadu_si128((const __m128i *)(p + at)));

    /* 128 bits to 64: the low half times x^(128-32), on the high half */
    a = _mm_xor_si128(_mm_srli_si128(a, 8), _mm_clmulepi64_si128(a, by1, 0x10));
    /* 64 to 32: the low 32 bits times x^64, on the rest */
    a = _mm_xor_si128(_mm_srli_si128(a, 4),
                      _mm_clmulepi64_si128(_mm_and_si128(a, low32),
                                           _mm_cvtsi64_si128((long long)FOLD_64), 0x00));
    /* Barrett: q = (low 32 bits * MU) mod x^32, remainder = a ^ q * P */
    {
        const __m128i pm = _mm_set_epi64x((long long)MU_R, (long long)P_R);
        __m128i q = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(a, low32), pm, 0x10),
                                  low32);
        a = _mm_xor_si128(a, _mm_clmulepi64_si128(q, pm, 0x00));
    }
    return (uint32_t)_mm_extract_epi32(a, 1);
}

static int clmul_ok = -1;   /* unknown until the first CRC of 64 bytes or more */
static int crc_use_clmul = 1;

static int have_clmul(void)
{
    if (clmul_ok < 0) {     /* (a race writes the same answer) */
        __builtin_cpu_init();   /* (idempotent; needed where no constructor ran it) */
        clmul_ok = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    }
    return clmul_ok;
}
#endif

/* The CRC register after n bytes of p, the sliced tables (8 bytes a step). */
static uint32_t crc32_tables(const uint8_t *p, size_t n, uint32_t c)
{
    while (n >= 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | ((uint32_t)p[1] << 8) |
                           ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24));
        uint32_t hi = (uint32_t)p[4] | ((uint32_t)p[5] << 8) |
                      ((uint32_t)p[6] << 16) | ((uint32_t)p[7] << 24);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
            crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^
            crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

/* CRC-32 as zlib computes it (crc32(0, p, n)). */
static uint32_t crc32_of(const uint8_t *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
#ifdef NSQF_CLMUL
    if (n >= 64 && crc_use_clmul && have_clmul()) {
        size_t whole = n & ~(size_t)15;
        c = crc32_clmul(p, whole, c);
        p += whole;
        n -= whole;
    }
#endif
    return crc32_tables(p, n, c) ^ 0xFFFFFFFFu;
}

uint32_t nsqf_crc32(const uint8_t *p, size_t n)
{
    return crc32_of(p, n);
}

int nsqf_crc_clmul(int use)
{
#ifdef NSQF_CLMUL
    if (use >= 0)
        crc_use_clmul = use;
    return crc_use_clmul && have_clmul();
#else
    (void)use;
    return 0;
#endif
}

static const char HEX[] = "0123456789abcdef";

/* nsqf_log_build: see nsqframe.h. Checks all lengths, then writes in one pass. */
int64_t nsqf_log_build(uint8_t *out, size_t cap, uint64_t first,
                       int64_t ts_ns, int64_t deliver_at_ns,
                       const uint8_t *src, const uint32_t *offs,
                       const uint32_t *lens, uint32_t n, uint32_t *pos)
{
    uint64_t total = 0;
    uint32_t i;
    uint8_t *p = out;

    for (i = 0; i < n; i++) {
        if (lens[i] > NSQF_MAX_BODY)
            return NSQF_E_FRAME_SIZE;
        total += (uint64_t)(NSQF_REC_HEADER + NSQF_PAYLOAD_HEAD) + lens[i];
    }
    if (total > (uint64_t)cap || total > (uint64_t)INT64_MAX)
        return NSQF_E_CAPACITY;
    for (i = 0; i < n; i++) {
        uint64_t off = first + i;
        uint32_t blen = lens[i];
        uint32_t plen = NSQF_PAYLOAD_HEAD + blen;
        int k;

        if (pos != NULL)
            pos[i] = (uint32_t)(p - out);
        put_u32(p + 4, plen);
        put_u64(p + 8, off);
        put_u64(p + 16, (uint64_t)deliver_at_ns);
        put_u64(p + 24, (uint64_t)ts_ns);
        p[32] = 0;
        p[33] = 0;
        for (k = 15; k >= 0; k--)
            p[34 + (15 - k)] = (uint8_t)HEX[(off >> (4 * k)) & 0xF];
        if (blen > 0)
            memcpy(p + 50, src + offs[i], blen);
        put_u32(p, crc32_of(p + 4, 12 + (size_t)plen));
        p += NSQF_REC_HEADER + (size_t)plen;
    }
    return (int64_t)total;
}

/* nsqf_log_scan: see nsqframe.h. */
int nsqf_log_scan(const uint8_t *buf, size_t len, uint64_t first, int check_crc,
                  uint32_t max_payload, uint32_t *pos, int cap, size_t *used,
                  nsqf_logscan *st)
{
    size_t at = 0;
    int n = 0;

    st->status = NSQF_LOG_END;
    st->deferred = 0;
    st->max_ts_ns = 0;
    while (at < len) {
        const uint8_t *p = buf + at;
        uint32_t plen;
        int64_t ts;

        if (n >= cap) {
            st->status = NSQF_LOG_FULL;
            break;
        }
        if (len - at < NSQF_REC_HEADER) {
            st->status = NSQF_LOG_PARTIAL;
            break;
        }
        plen = get_u32(p + 4);
        if (plen < NSQF_PAYLOAD_HEAD || plen > max_payload) {
            st->status = NSQF_LOG_BAD_LENGTH;
            break;
        }
        if (len - at - NSQF_REC_HEADER < plen) {
            st->status = NSQF_LOG_PARTIAL;
            break;
        }
        if (get_u64(p + 8) != first + (uint64_t)n) {
            st->status = NSQF_LOG_BAD_OFFSET;
            break;
        }
        if (check_crc && crc32_of(p + 4, 12 + (size_t)plen) != get_u32(p)) {
            st->status = NSQF_LOG_BAD_CRC;
            break;
        }
        if (get_u64(p + 16) != 0)
            st->deferred++;
        ts = (int64_t)get_u64(p + 24);
        if (ts > st->max_ts_ns)
            st->max_ts_ns = ts;
        pos[n++] = (uint32_t)at;
        at += NSQF_REC_HEADER + (size_t)plen;
    }
    *used = at;
    return n;
}

/* The frames of nsqf_log_frames and nsqf_log_frames_each: attempts from adds when
 * given (stored + adds[i]), else from attempts (< 0: stored + 1). */
static int64_t log_frames(uint8_t *out, size_t cap, const uint8_t *buf,
                          const uint32_t *pos, uint32_t n, int32_t attempts,
                          const uint32_t *adds)
{
    uint64_t total = 0;
    uint32_t i;
    uint8_t *o = out;

    for (i = 0; i < n; i++)
        total += 8u + (uint64_t)get_u32(buf + pos[i] + 4) - 8u;
    if (total > (uint64_t)cap)
        return NSQF_E_CAPACITY;
    for (i = 0; i < n; i++) {
        const uint8_t *r = buf + pos[i];
        uint32_t plen = get_u32(r + 4);       /* payload: deliver_at + message */
        uint32_t mlen = plen - 8;             /* nsqd's message encoding */
        uint64_t a;

        put_u32(o, mlen + 4);
        put_u32(o + 4, 2u);
        memcpy(o + 8, r + 24, mlen);
        if (adds != NULL)
            a = ((uint32_t)r[32] << 8 | r[33]) + (uint64_t)adds[i];
        else if (attempts < 0)
            a = ((uint32_t)r[32] << 8 | r[33]) + 1u;
        else
            a = (uint32_t)attempts;
        if (a > 65535u)
            a = 65535u;
        o[16] = (uint8_t)(a >> 8);
        o[17] = (uint8_t)a;
        o += 8 + (size_t)mlen;
    }
    return (int64_t)total;
}


/* nsqf_log_frames: see nsqframe.h. */
int64_t nsqf_log_frames(uint8_t *out, size_t cap, const uint8_t *buf,
                        const uint32_t *pos, uint32_t n, int32_t attempts)
{
    return log_frames(out, cap, buf, pos, n, attempts, NULL);
}


/* nsqf_log_frames_each: see nsqframe.h. */
int64_t nsqf_log_frames_each(uint8_t *out, size_t cap, const uint8_t *buf,
                             const uint32_t *pos, const uint32_t *adds, uint32_t n)
{
    return log_frames(out, cap, buf, pos, n, 0, adds);
}


/* A byte a topic name may hold (the caller checks the whole name). */
static int lane_name_byte(uint8_t c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
        || c == '.' || c == '_' || c == '-' || c == '#';
}

/*
 * One connection's bytes p[0, len): FAST (0) with its parts stored from
 * offs/lens[*np] (offsets relative to base), or SLOW (1) with *np unchanged.
 */
static int lane_one(const uint8_t *p, size_t len, uint32_t base, const nsqf_limits *lim,
                    uint32_t max_count, uint32_t *offs, uint32_t *lens, uint32_t cap,
                    uint32_t *np, uint32_t *r)
{
    size_t pos = 0;
    uint32_t got = *np, cmds = 0, name_off = 0, name_len = 0, first_mpub = 0;

    if (len == 0)
        return NSQF_LANE_SLOW;
    while (pos < len) {
        size_t at = pos, name, end;
        int mpub;
        int32_t size;

        if (len - at >= 4 && memcmp(p + at, "PUB ", 4) == 0) {
            mpub = 0;
            name = at + 4;
        } else if (len - at >= 5 && memcmp(p + at, "MPUB ", 5) == 0) {
            mpub = 1;
            name = at + 5;
        } else {
            return NSQF_LANE_SLOW;
        }
        end = name;
        while (end < len && end - at < lim->max_line && lane_name_byte(p[end]))
            end++;
        if (end >= len || p[end] != '\n' || end == name)
            return NSQF_LANE_SLOW;
        if (cmds == 0) {
            name_off = (uint32_t)name;
            name_len = (uint32_t)(end - name);
            first_mpub = (uint32_t)mpub;
        } else if (end - name != name_len || memcmp(p + name, p + name_off, name_len) != 0) {
            return NSQF_LANE_SLOW;
        }
        pos = end + 1;
        if (len - pos < 4)
            return NSQF_LANE_SLOW;
        size = get_i32(p + pos);
        pos += 4;
        if (size <= 0 || (uint32_t)size > (mpub ? lim->max_body_size : lim->max_msg_size)
                || len - pos < (size_t)size)
            return NSQF_LANE_SLOW;
        if (!mpub) {
            if (got >= cap)
                return NSQF_LANE_SLOW;
            offs[got] = base + (uint32_t)pos;
            lens[got] = (uint32_t)size;
            got++;
        } else {
            const uint8_t *b = p + pos;
            size_t blen = (size_t)size, bp = 4;
            int32_t count, i;

            if (blen < 4)
                return NSQF_LANE_SLOW;
            count = get_i32(b);
            if (count <= 0 || (uint32_t)count > max_count || (uint32_t)count > cap - got)
                return NSQF_LANE_SLOW;
            for (i = 0; i < count; i++) {
                int32_t part;

                if (blen - bp < 4)
                    return NSQF_LANE_SLOW;
                part = get_i32(b + bp);
                bp += 4;
                if (part <= 0 || (uint32_t)part > lim->max_msg_size
                        || blen - bp < (size_t)part)
                    return NSQF_LANE_SLOW;
                offs[got] = base + (uint32_t)(pos + bp);
                lens[got] = (uint32_t)part;
                got++;
                bp += (size_t)part;
            }
            if (bp != blen)
                return NSQF_LANE_SLOW;
        }
        pos += (size_t)size;
        cmds++;
    }
    r[1] = base + name_off;
    r[2] = name_len;
    r[3] = cmds;
    r[4] = (got - *np) | (first_mpub << 31);
    *np = got;
    return NSQF_LANE_FAST;
}

/*
 * nsqf_pub_lane: see nsqframe.h. A SLOW connection stores nothing: its parts
 * are rolled back by leaving *np where it was.
 */
int nsqf_pub_lane(const uint8_t *buf, const uint32_t *starts, const uint32_t *lens_in,
                  int n, const nsqf_limits *lim, uint32_t max_count,
                  uint32_t *offs, uint32_t *lens, uint32_t parts_cap, uint32_t *res)
{
    uint32_t np = 0;
    int i, names = 0, j;
    int firsts[NSQF_LANE_NAMES];   /* the first connection of each distinct name */

    for (i = 0; i < n; i++) {
        uint32_t *r = res + (size_t)NSQF_LANE_FIELDS * (size_t)i;

        r[1] = r[2] = r[3] = r[4] = 0;
        r[5] = (uint32_t)i;
        r[0] = (uint32_t)lane_one(buf + starts[i], lens_in[i], starts[i], lim, max_count,
                                  offs, lens, parts_cap, &np, r);
        if (r[0] != NSQF_LANE_FAST)
            continue;
        for (j = 0; j < names; j++) {
            const uint32_t *q = res + (size_t)NSQF_LANE_FIELDS * (size_t)firsts[j];

            if (q[2] == r[2] && memcmp(buf + q[1], buf + r[1], r[2]) == 0) {
                r[5] = (uint32_t)firsts[j];
                break;
            }
        }
        if (j == names && names < NSQF_LANE_NAMES)
            firsts[names++] = i;
    }
    return (int)np;
}


/*
 * One REQ line of the FIN lane at p (left bytes): its length, with *off and *ms,
 * or 0 when it is not one.
 */
static size_t req_line(const uint8_t *p, size_t left, int64_t *off, int64_t *ms)
{
    uint64_t v = 0, t = 0;
    size_t k;

    if (left < 23 || p[0] != 'R' || p[1] != 'E' || p[2] != 'Q' || p[3] != ' '
            || p[20] != ' ')
        return 0;
    for (k = 4; k < 20; k++) {
        int d = hex_lower(p[k]);
        if (d < 0)
            return 0;
        v = (v << 4) | (uint64_t)d;
    }
    if (v > (uint64_t)INT64_MAX)
        return 0;
    for (k = 21; k < left && k < 21 + 18 && p[k] >= '0' && p[k] <= '9'; k++)
        t = t * 10 + (uint64_t)(p[k] - '0');
    if (k == 21 || k >= left || p[k] != '\n')
        return 0;
    *off = (int64_t)v;
    *ms = (int64_t)t;
    return k + 1;
}


/*
 * nsqf_fin_lane: see nsqframe.h.
 */
int nsqf_fin_lane(const uint8_t *buf, const uint32_t *starts, const uint32_t *lens_in,
                  int n, int64_t *offs, int64_t *ms, int cap, uint32_t *res)
{
    int got = 0, i;

    for (i = 0; i < n; i++) {
        const uint8_t *p = buf + starts[i];
        size_t len = lens_in[i], pos = 0;
        int k = 0, slow = len == 0;

        while (!slow && pos < len) {
            size_t used = 0, step;
            int f;

            if (got + k >= cap) {
                slow = 1;
                break;
            }
            f = nsqf_scan_fins(p + pos, len - pos, offs + got + k, cap - got - k, &used);
            if (f > 0) {
                int j;
                for (j = 0; j < f; j++)
                    ms[got + k + j] = -1;
                k += f;
                pos += used;
                continue;
            }
            step = req_line(p + pos, len - pos, offs + got + k, ms + got + k);
            if (step == 0) {
                slow = 1;
                break;
            }
            k++;
            pos += step;
        }
        if (slow) {
            res[i] = NSQF_FIN_LANE_SLOW;
            continue;
        }
        res[i] = (uint32_t)k;
        got += k;
    }
    return got;
}
