// The fast switch's socket loop, compiled (sim/fast_io.py drives it through fast.cpp).
//
// `Serve::loop` does for the fast switch what `sim.serve.SimServer.poll` does in Python, for
// the common datagram: it reads what waits on the server's packet socket (`udp.arrivals_
// socket`: IPv4 packets as received, to the server's address and port 4791 by the socket's
// filter, each after a virtio_net_hdr and the Ethernet header) a batch at a time (recvmmsg), makes each packet the
// frames the switch sees (`sim.udp_runs`): its sender's Ethernet header from the senders'
// table, and a run the sender's kernel sent in one buffer (GSO) cut at the segment size the
// kernel gives in the virtio_net_hdr (a datagram without one is one frame, whatever its
// headers claim), each segment with the IPv4 and UDP headers the kernel gives it
// (`udp_offload.renumbered`); hands the rows to
// `Switch::run`; and sends the results, those of one destination and length as runs of up to
// MAX_SEGMENTS datagrams (UDP_SEGMENT), every destination's in one sendmmsg per socket, after
// each batch. The ICRCs stay as the switch made them (see sim/serve.py).
//
// It hands a packet back (`SERVED_HANDBACK`) where Python decides: a packet from a sender the
// table does not hold, one that is no run of contributions, a row `Switch::run` gives to the
// golden model; from row `hand_row` of packet `hand_packet` of the batch, the rows before it
// taken and their results sent. Python goes on from there and calls again with `resume_at`
// the packet after it. A full socket buffer on sending drops the datagrams (a lost packet);
// a destination without a socket counts them undeliverable.
#pragma once
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include <vector>

#include "fast_abi.h"
#include "fast_switch.h"

namespace {

constexpr int MAX_SENDS = 256;              // messages gathered for one flush

struct Serve {
    Io &io;
    State &s;
    uint8_t *arena;                 // the results since the last flush, one after the other
    int64_t *records;               // per result: its offset in the arena, frame bytes, dest.
    int64_t used = 0, results = 0;  // arena bytes and results in it
    std::vector<int64_t> next, last;
    std::vector<uint8_t> held;
    // the messages of one flush
    mmsghdr msgs[MAX_SENDS];
    iovec iovs[MAX_SENDS * 4];
    sockaddr_in names[MAX_SENDS];
    alignas(cmsghdr) char controls[MAX_SENDS][CMSG_SPACE(sizeof(uint16_t))];
    int64_t datagrams[MAX_SENDS];
    int fds[MAX_SENDS];

    Serve(Io &io_, State &s_)
        : io(io_), s(s_), arena(at<uint8_t>(io_.arena)), records(at<int64_t>(io_.records)) {}

    uint8_t *packet(int64_t i) const { return at<uint8_t>(io.rx) + i * io.rx_bytes; }

    // The senders' table's row for (source address, UDP port), both as on the wire; -1.
    int64_t sender(uint32_t ip, uint32_t port) const {
        const int64_t *row = at<int64_t>(io.senders);
        for (int64_t i = 0; i < io.senders_count; i++, row += SENDER_WORDS)
            if (uint32_t(row[SD_IP]) == ip && uint32_t(row[SD_UDP_PORT]) == port) return i;
        return -1;
    }

    // A run of `rows` datagrams of `size` bytes in at `port` (`heads`: their Ethernet, IPv4
    // and UDP headers, `body` the datagrams) through the switch, row by row; the results go
    // to the arena (flushed when it fills). The row it stopped at, `rows` when it took them
    // all.
    int64_t take(int64_t port, const uint8_t *heads, const uint8_t *body, int64_t size,
                 int64_t rows) {
        const int64_t frame_bytes = BTH_OFFSET + size;
        s.port = port, s.rows = rows, s.size = size, s.first = 0;
        while (true) {
            const int64_t room = (io.arena_bytes - used) / frame_bytes;
            const int64_t slots = io.records_rows - results;
            s.out = io.arena + used;
            s.out_rows = room < slots ? room : slots;
            s.sent = io.sent;
            Switch sw(s);
            const Stop why = sw.run(heads, body);
            const int64_t *sent = at<int64_t>(io.sent);
            for (int64_t r = 0; r < s.results; r++) {
                int64_t *rec = records + 3 * (results + r);
                rec[0] = used + r * frame_bytes, rec[1] = frame_bytes, rec[2] = sent[2 * r + 1];
            }
            used += s.results * frame_bytes;
            results += s.results;
            io.compiled += s.taken - s.first;
            if (why == STOP_DONE || why == STOP_GOLDEN) return s.taken;
            if (!s.results && !results) return s.taken;     // FULL with nothing held: Python's
            flush();
            s.first = s.taken;
        }
    }

    // Every result held, to its destination: runs of one destination and length, each
    // destination's results in order.
    void flush() {
        if (!results) return;
        const int64_t *routes = at<int64_t>(io.routes);
        // per result, the next of its destination (a chain per destination), and whether a
        // message holds it
        next.assign(size_t(results), -1);
        held.assign(size_t(results), 0);
        last.assign(size_t(s.jobs * s.max_workers), -1);
        for (int64_t k = 0; k < results; k++) {
            const int64_t dest = records[3 * k + 2];
            if (last[dest] >= 0) next[last[dest]] = k;
            last[dest] = k;
        }
        int count = 0, iov_used = 0;
        for (int64_t i = 0; i < results; i++) {
            if (held[i]) continue;
            const int64_t dest = records[3 * i + 2], frame_bytes = records[3 * i + 1];
            const int64_t *route = routes + dest * ROUTE_WORDS;
            const int64_t size = frame_bytes - BTH_OFFSET;
            int64_t most = io.gso ? MAX_RUN_BYTES / size : 1;
            if (most > MAX_SEGMENTS) most = MAX_SEGMENTS;
            if (count == MAX_SENDS || iov_used + most > MAX_SENDS * 4) {
                send(count);
                count = iov_used = 0;
            }
            int64_t segments = 0;
            for (int64_t k = i; k >= 0 && segments < most && records[3 * k + 1] == frame_bytes;
                 k = next[k]) {
                held[k] = 1;
                iovs[iov_used + segments].iov_base = arena + records[3 * k] + BTH_OFFSET;
                iovs[iov_used + segments].iov_len = size_t(size);
                segments++;
            }
            if (route[RT_FD] < 0) {             // no socket sends from its source
                io.undeliverable += segments;
                continue;
            }
            mmsghdr &m = msgs[count];
            std::memset(&m, 0, sizeof m);
            sockaddr_in &to = names[count];
            std::memset(&to, 0, sizeof to);
            to.sin_family = AF_INET;
            to.sin_addr.s_addr = htonl(uint32_t(route[RT_IP]));
            to.sin_port = htons(uint16_t(route[RT_UDP_PORT]));
            m.msg_hdr.msg_name = &to;
            m.msg_hdr.msg_namelen = sizeof to;
            m.msg_hdr.msg_iov = iovs + iov_used;
            m.msg_hdr.msg_iovlen = size_t(segments);
            if (segments > 1) {
                m.msg_hdr.msg_control = controls[count];
                m.msg_hdr.msg_controllen = CMSG_SPACE(sizeof(uint16_t));
                cmsghdr *c = CMSG_FIRSTHDR(&m.msg_hdr);
                c->cmsg_level = SOL_UDP;
                c->cmsg_type = UDP_SEGMENT_OPTION;
                c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                const uint16_t segment = uint16_t(size);
                std::memcpy(CMSG_DATA(c), &segment, sizeof segment);
            }
            datagrams[count] = segments;
            fds[count++] = int(route[RT_FD]);
            iov_used += int(segments);
        }
        send(count);
        used = results = 0;
    }

    // The first `count` messages, those of one socket in one sendmmsg; a full socket buffer
    // drops the rest of that socket's, as lost packets.
    void send(int count) {
        for (int first = 0; first < count;) {
            int end = first + 1;
            while (end < count && fds[end] == fds[first]) end++;
            for (int k = first; k < end;) {
                const int sent = sendmmsg(fds[first], msgs + k, unsigned(end - k), MSG_DONTWAIT);
                if (sent > 0) {
                    for (int d = k; d < k + sent; d++) io.datagrams_out += datagrams[d];
                    k += sent;
                    continue;
                }
                const bool no_gso = sent < 0 && io.gso && (errno == EINVAL || errno == EIO ||
                                    errno == ENOPROTOOPT || errno == EOPNOTSUPP);
                if (no_gso) io.gso = 0;         // a kernel without it: one datagram a call
                for (int d = k; d < end; d++) {
                    if (no_gso)
                        one_by_one(msgs[d], fds[first]);
                    else
                        io.dropped += datagrams[d];
                }
                break;
            }
            first = end;
        }
    }

    void one_by_one(const mmsghdr &m, int fd) {
        for (size_t k = 0; k < m.msg_hdr.msg_iovlen; k++) {
            const iovec &v = m.msg_hdr.msg_iov[k];
            if (sendto(fd, v.iov_base, v.iov_len, MSG_DONTWAIT,
                       static_cast<const sockaddr *>(m.msg_hdr.msg_name), m.msg_hdr.msg_namelen) ==
                ssize_t(v.iov_len))
                io.datagrams_out++;
            else
                io.dropped++;
        }
    }

    // Packet `i` of the batch through the switch; false where it is handed back from
    // `io.hand_row` (-1: the whole packet, which the C++ did not cut).
    bool packet_taken(int64_t i) {
        const uint8_t *vnet = packet(i);        // virtio_net_hdr: gso_type, gso_size
        const uint8_t *p = vnet + ARRIVAL_HEAD;  // the IPv4 packet, after the Ethernet header
        const int64_t len = at<int64_t>(io.rx_lengths)[i] - ARRIVAL_HEAD;
        io.hand_row = -1;
        const int64_t head = IP_LEN + UDP_LEN;
        if (len < head + WRITE_IMM_HEAD_LEN || p[0] != IPV4_FIRST_BYTE ||
            p[head] != OP_CONTRIBUTION)
            return false;
        uint16_t segment;
        std::memcpy(&segment, vnet + 4, 2);     // (host order, as the kernel wrote it)
        if (vnet[1] == VNET_GSO_NONE) segment = 0;
        const int64_t row = sender(get_be32(p + 12), get_be16(p + 20));
        if (row < 0) return false;
        const int64_t *entry = at<int64_t>(io.senders) + row * SENDER_WORDS;
        const uint8_t *body = p + head;
        const int64_t body_bytes = len - head;
        const int64_t size = segment;
        uint8_t heads[MAX_SEGMENTS * BTH_OFFSET];
        uint8_t eth[ETH_LEN] = {0, 0, 0, 0, 0, 0};
        const uint64_t mac = uint64_t(entry[SD_MAC]);
        for (int b = 0; b < 6; b++) eth[6 + b] = uint8_t(mac >> (40 - 8 * b));
        put_be16(eth + 12, ETHERTYPE_IPV4);
        if (size == 0 || body_bytes <= size) {  // one datagram: its headers as received
            io.datagrams_in++;
            std::memcpy(heads, eth, ETH_LEN);
            std::memcpy(heads + ETH_LEN, p, head);
            const int64_t stop = take(entry[SD_PORT], heads, body, body_bytes, 1);
            io.hand_row = stop;
            return stop == 1;
        }
        const int64_t rows = (body_bytes + size - 1) / size;
        if (rows > MAX_SEGMENTS) return false;
        io.datagrams_in += rows;
        for (int64_t r = 0; r < rows; r++) {    // the headers the kernel gives each segment
            uint8_t *h = heads + r * BTH_OFFSET;
            const int64_t length = r + 1 < rows ? size : body_bytes - r * size;
            std::memcpy(h, eth, ETH_LEN);
            std::memcpy(h + ETH_LEN, p, head);
            uint8_t *ip = h + IP_OFFSET;
            put_be16(ip + 2, uint32_t(head + length));
            put_be16(ip + 4, (get_be16(ip + 4) + uint32_t(r)) & 0xFFFF);
            put_be16(ip + 10, 0);
            put_be16(ip + 10, ~ip_sum(ip) & 0xFFFF);
            put_be16(ip + IP_LEN + 4, uint32_t(UDP_LEN + length));
            put_be16(ip + IP_LEN + 6, 0);
        }
        const int64_t full = body_bytes / size;
        int64_t stop = take(entry[SD_PORT], heads, body, size, full);
        if (stop == full && full < rows)
            stop = full + take(entry[SD_PORT], heads + full * BTH_OFFSET, body + full * size,
                               body_bytes - full * size, 1);
        io.hand_row = stop;
        return stop == rows;
    }

    // Batches until nothing comes for `io.wait_us` (`SERVED_IDLE`), `io.wait_us` have
    // passed since the call (`SERVED_BUDGET`: the clock's and the control path's turn) or a
    // packet is handed back (`SERVED_HANDBACK`).
    Served loop() {
        const int64_t start = now_us();
        while (true) {
            if (io.resume_at >= io.batch) {
                flush();                            // a batch's results leave before the next
                const int got = receive();
                if (got < 0) return done(SERVED_IDLE);
                if (got == 0) {
                    const int64_t left = io.wait_us - (now_us() - start);
                    if (left <= 0) return done(SERVED_IDLE);
                    pollfd p = {int(io.raw_fd), POLLIN, 0};
                    const timespec wait = {time_t(left / 1000000), long(left % 1000000) * 1000};
                    if (ppoll(&p, 1, &wait, nullptr) <= 0) return done(SERVED_IDLE);
                    continue;
                }
                if (now_us() - start >= io.wait_us) {
                    io.batch = got;                 // taken at the next call
                    return done(SERVED_BUDGET);
                }
            }
            for (; io.resume_at < io.batch; io.resume_at++) {
                if (!packet_taken(io.resume_at)) {
                    io.hand_packet = io.resume_at++;
                    return done(SERVED_HANDBACK);
                }
            }
        }
    }

    // A batch into the packet buffers: how many, 0 when nothing waits, -1 on an error
    // (`io.error`).
    int receive() {
        mmsghdr msgs[RX_BATCH];
        iovec iovs[RX_BATCH];
        const int64_t want = io.rx_count < RX_BATCH ? io.rx_count : RX_BATCH;
        for (int64_t i = 0; i < want; i++) {
            iovs[i].iov_base = packet(i);
            iovs[i].iov_len = size_t(io.rx_bytes);
            std::memset(&msgs[i], 0, sizeof msgs[i]);
            msgs[i].msg_hdr.msg_iov = &iovs[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        io.batch = io.resume_at = 0;
        const int got = recvmmsg(int(io.raw_fd), msgs, unsigned(want), MSG_DONTWAIT, nullptr);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
            io.error = errno;
            return -1;
        }
        for (int i = 0; i < got; i++) at<int64_t>(io.rx_lengths)[i] = msgs[i].msg_len;
        io.batch = got;
        return got;
    }

    static int64_t now_us() {
        timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return int64_t(t.tv_sec) * 1000000 + t.tv_nsec / 1000;
    }

    Served done(Served why) {
        flush();
        io.served = why;
        return why;
    }
};

}  // namespace
