// netagg: the cycle loop of a Python-driven Verilator model (see sim/model.py).
//
// The model is a Verilator --cc build of a top with a clock `clk`, a reset `rst` and, for each
// port i, an AXI-Stream style receive side rx{i}_{tdata,tkeep,tlast,tvalid,tready} (into the
// design) and transmit side tx{i}_{...} (out of it). Byte 0 of a frame is the least significant
// byte of tdata; every beat is full except the last, whose keep is packed from bit 0.
//
// This file runs the clock: per port it holds a queue of frames to send, which it drives on rx
// one beat per cycle while the design is ready, and collects the frames the design sends on tx
// (ready every cycle unless a pattern says otherwise). Python hands over the frames it queued
// as one list (nm_push_list) and takes those that came out as one list of (port, bytes)
// (nm_take_output), so it crosses into C++ a few times per batch of cycles, never per cycle,
// signal or beat. nm_bench runs the same loop with a traffic generator of its own, never
// returning to Python, as the reference speed.
//
// netagg_ports.h is written by sim/model.py from the verilated header: NETAGG_PORTS (count),
// NETAGG_WIDTH (tdata bits), NETAGG_HAS_RST, NETAGG_HAS_TICK (an input `tick`, which nm_tick
// holds high for one cycle), NETAGG_HAS_LINK_DOWN (a leaf's input `link_down`) and NETAGG_FOR_EACH_PORT(X), which expands X(i) for every port
// index i.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include <sys/types.h>

#include "verilated.h"
#include "Vtop.h"
#include "netagg_ports.h"

// The few CPython functions the frame exchange uses, all of the stable ABI (declared here, not
// taken from Python.h, which a Python without its -dev package lacks). They resolve against the
// running interpreter when Python loads this library, as for any extension module, and are
// called only through ctypes.PyDLL, which holds the GIL.
extern "C" {
typedef struct _object PyObject;
typedef ssize_t Py_ssize_t;
PyObject* PyList_New(Py_ssize_t);
Py_ssize_t PyList_Size(PyObject*);
PyObject* PyList_GetItem(PyObject*, Py_ssize_t);
int PyList_SetItem(PyObject*, Py_ssize_t, PyObject*);
PyObject* PyTuple_New(Py_ssize_t);
int PyTuple_SetItem(PyObject*, Py_ssize_t, PyObject*);
PyObject* PyLong_FromLong(long);
long PyLong_AsLong(PyObject*);
PyObject* PyBytes_FromStringAndSize(const char*, Py_ssize_t);
int PyBytes_AsStringAndSize(PyObject*, char**, Py_ssize_t*);
void PyErr_Clear(void);
void Py_DecRef(PyObject*);
}

namespace {

constexpr unsigned kBytes = NETAGG_WIDTH / 8;  // bytes of a beat
static_assert(NETAGG_WIDTH % 8 == 0 && kBytes >= 1 && kBytes <= 64,
              "tdata must be 8..512 bits, a multiple of 8");

// A cycle-by-cycle on/off pattern: a fixed bit pattern of 1..64 cycles, or random with a given
// probability of being on (xorshift64, seeded, so runs repeat).
struct Pattern {
    uint64_t bits = 1;
    uint32_t period = 1;
    uint32_t pos = 0;
    bool random = false;
    uint64_t threshold = 0;  // on when the next 32 random bits are below this
    uint64_t state = 0x9E3779B97F4A7C15ull;

    bool next() {
        if (random) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            return (state >> 32) < threshold;
        }
        if (period == 1) return bits & 1;
        bool on = (bits >> pos) & 1;
        if (++pos == period) pos = 0;
        return on;
    }
};

struct Port {
    // Model signals; data and keep are written and read as little-endian bytes.
    uint8_t* rx_tdata;
    unsigned rx_tdata_size;
    uint8_t* rx_tkeep;
    unsigned rx_tkeep_size;
    CData* rx_tlast;
    CData* rx_tvalid;
    CData* rx_tready;
    uint8_t* tx_tdata;
    uint8_t* tx_tkeep;
    unsigned tx_tkeep_size;
    CData* tx_tlast;
    CData* tx_tvalid;
    CData* tx_tready;

    // Frames to send: their bytes back to back from in_head, their lengths in in_lens.
    std::vector<uint8_t> in_buf;
    size_t in_head = 0;
    std::deque<uint32_t> in_lens;
    uint32_t in_off = 0;      // bytes of the front frame already accepted
    bool holding = false;     // a beat is on rx (valid), waiting for ready
    unsigned beat_bytes = 0;  // bytes of that beat
    bool beat_last = false;

    std::vector<uint8_t> cur;  // the frame arriving on tx
    Pattern rx_valid, tx_ready;
    uint64_t frames_in = 0, frames_out = 0, beats_in = 0, beats_out = 0;
};

template <typename T>
uint8_t* bytes_of(T& sig) { return reinterpret_cast<uint8_t*>(&sig); }

}  // namespace

struct Model {
    VerilatedContext* ctx;
    Vtop* top;
    Port ports[NETAGG_PORTS];
    uint64_t cycles = 0;
    // Frames received, in order of their last beat (by cycle, then port).
    std::vector<int32_t> out_ports;
    std::vector<int64_t> out_lens;
    std::vector<uint8_t> out_data;
    uint64_t errors = 0;
    std::string first_error;
    // nm_bench's traffic: frames per port, replayed in turn, and how many to keep queued.
    std::vector<std::vector<uint8_t>> bench_frames[NETAGG_PORTS];
    size_t bench_keep[NETAGG_PORTS] = {};

    Model() {
        ctx = new VerilatedContext;
        top = new Vtop{ctx, "top"};
#define NETAGG_BIND(i)                                                                   \
        {                                                                                \
            Port& p = ports[i];                                                          \
            p.rx_tdata = bytes_of(top->rx##i##_tdata);                                   \
            p.rx_tdata_size = sizeof(top->rx##i##_tdata);                                \
            p.rx_tkeep = bytes_of(top->rx##i##_tkeep);                                   \
            p.rx_tkeep_size = sizeof(top->rx##i##_tkeep);                                \
            p.rx_tlast = &top->rx##i##_tlast;                                            \
            p.rx_tvalid = &top->rx##i##_tvalid;                                          \
            p.rx_tready = &top->rx##i##_tready;                                          \
            p.tx_tdata = bytes_of(top->tx##i##_tdata);                                   \
            p.tx_tkeep = bytes_of(top->tx##i##_tkeep);                                   \
            p.tx_tkeep_size = sizeof(top->tx##i##_tkeep);                                \
            p.tx_tlast = &top->tx##i##_tlast;                                            \
            p.tx_tvalid = &top->tx##i##_tvalid;                                          \
            p.tx_tready = &top->tx##i##_tready;                                          \
        }
        NETAGG_FOR_EACH_PORT(NETAGG_BIND)
#undef NETAGG_BIND
        reset(4);
    }

    ~Model() {
        top->final();
        delete top;
        delete ctx;
    }

    void error(int port, const char* what) {
        if (errors++ == 0) {
            char text[256];
            std::snprintf(text, sizeof text, "port %d, cycle %llu: %s", port,
                          (unsigned long long)cycles, what);
            first_error = text;
        }
    }

    void clear_queues() {
        for (Port& p : ports) {
            p.in_buf.clear();
            p.in_head = 0;
            p.in_lens.clear();
            p.in_off = 0;
            p.holding = false;
            p.cur.clear();
            p.frames_in = p.frames_out = p.beats_in = p.beats_out = 0;
            *p.rx_tvalid = 0;
            *p.rx_tlast = 0;
            std::memset(p.rx_tdata, 0, p.rx_tdata_size);
            std::memset(p.rx_tkeep, 0, p.rx_tkeep_size);
            *p.tx_tready = 0;
        }
        out_ports.clear();
        out_lens.clear();
        out_data.clear();
        errors = 0;
        first_error.clear();
    }

    // Empty every queue and hold rst high for `n` cycles; the cycle count starts again at 0.
    void reset(unsigned n) {
        clear_queues();
#if NETAGG_HAS_RST
        top->rst = 1;
#endif
        for (unsigned k = 0; k < n; ++k) {
            top->clk = 0;
            top->eval();
            top->clk = 1;
            top->eval();
        }
#if NETAGG_HAS_RST
        top->rst = 0;
#endif
        top->clk = 0;
        top->eval();
        cycles = 0;
    }

    void push(int port, const uint8_t* data, uint32_t len) {
        Port& p = ports[port];
        p.in_buf.insert(p.in_buf.end(), data, data + len);
        p.in_lens.push_back(len);
    }

    bool inputs_done() const {
        for (const Port& p : ports)
            if (!p.in_lens.empty()) return false;
        return true;
    }

    // Put the next beat of `p` on rx, unless one is already waiting for ready.
    void drive(Port& p) {
        bool gap_allows = p.rx_valid.next();
        if (p.holding) return;  // a valid beat stays until it is taken
        if (p.in_lens.empty() || !gap_allows) {
            *p.rx_tvalid = 0;
            return;
        }
        uint32_t rem = p.in_lens.front() - p.in_off;
        unsigned n = rem < kBytes ? rem : kBytes;
        std::memcpy(p.rx_tdata, p.in_buf.data() + p.in_head + p.in_off, n);
        if (n < p.rx_tdata_size) std::memset(p.rx_tdata + n, 0, p.rx_tdata_size - n);
        uint64_t keep = n >= 64 ? ~0ull : (1ull << n) - 1;
        std::memcpy(p.rx_tkeep, &keep, p.rx_tkeep_size);
        p.beat_bytes = n;
        p.beat_last = rem <= kBytes;
        *p.rx_tlast = p.beat_last;
        *p.rx_tvalid = 1;
        p.holding = true;
    }

    // After the inputs settle: take the handshakes of this cycle. Returns whether anything is
    // still going on at this port (a beat offered on either side).
    bool sample(int index, Port& p) {
        bool busy = p.holding || *p.tx_tvalid;
        if (p.holding && *p.rx_tready) {
            p.holding = false;
            p.beats_in++;
            p.in_off += p.beat_bytes;
            if (p.beat_last) {
                p.in_head += p.in_lens.front();
                p.in_lens.pop_front();
                p.in_off = 0;
                p.frames_in++;
                if (p.in_lens.empty()) {
                    p.in_buf.clear();
                    p.in_head = 0;
                } else if (p.in_head >= (1u << 16) && p.in_head * 2 >= p.in_buf.size()) {
                    p.in_buf.erase(p.in_buf.begin(), p.in_buf.begin() + p.in_head);
                    p.in_head = 0;
                }
            }
        }
        if (*p.tx_tvalid && *p.tx_tready) {
            uint64_t keep = 0;
            std::memcpy(&keep, p.tx_tkeep, p.tx_tkeep_size);
            if (kBytes < 64) keep &= (1ull << kBytes) - 1;
            unsigned n = __builtin_popcountll(keep);
            bool last = *p.tx_tlast;
            if (keep & (keep + 1)) error(index, "tx keep is not packed from bit 0");
            else if (n == 0) error(index, "tx beat with no byte kept");
            else if (!last && n != kBytes) error(index, "tx beat before the last is not full");
            p.cur.insert(p.cur.end(), p.tx_tdata, p.tx_tdata + n);
            p.beats_out++;
            if (last) {
                out_ports.push_back(index);
                out_lens.push_back((int64_t)p.cur.size());
                out_data.insert(out_data.end(), p.cur.begin(), p.cur.end());
                p.cur.clear();
                p.frames_out++;
            }
        }
        return busy;
    }

    // One clock cycle: drive, settle, take handshakes, rising edge. Returns whether any port
    // had a beat on offer.
    bool cycle() {
        for (Port& p : ports) {
            drive(p);
            *p.tx_tready = p.tx_ready.next();
        }
        top->clk = 0;
        top->eval();
        bool busy = false;
        for (int i = 0; i < NETAGG_PORTS; ++i) busy |= sample(i, ports[i]);
        top->clk = 1;
        top->eval();
        cycles++;
        return busy;
    }

    void step(uint64_t n) {
        for (uint64_t k = 0; k < n; ++k) cycle();
    }

    bool frames_pending() const {
        for (const Port& p : ports)
            if (!p.in_lens.empty() || !p.cur.empty()) return true;
        return false;
    }

    // Run until every input frame is taken and nothing has moved for `idle` cycles; 0 when it
    // got there, 1 when `max_cycles` ran out first.
    int run_until_idle(uint64_t max_cycles, uint64_t idle) {
        uint64_t quiet = 0;
        for (uint64_t k = 0; k < max_cycles; ++k) {
            bool busy = cycle();
            if (busy || frames_pending()) quiet = 0;
            else if (++quiet >= idle) return 0;
        }
        return 1;
    }

    void drop_output() {
        out_ports.clear();
        out_lens.clear();
        out_data.clear();
    }
};

extern "C" {

int nm_ports() { return NETAGG_PORTS; }
int nm_width() { return NETAGG_WIDTH; }

Model* nm_create() { return new Model; }
void nm_destroy(Model* m) { delete m; }
void nm_reset(Model* m, unsigned cycles) { m->reset(cycles); }
uint64_t nm_cycles(Model* m) { return m->cycles; }

// Queue frames[k] (bytes) on port ports[k] (int) for every k; both are Python lists, checked
// by the caller. Returns 0, or -1 if an item has the wrong type (nothing queued after it).
int nm_push_list(Model* m, PyObject* ports, PyObject* frames) {
    Py_ssize_t n = PyList_Size(ports);
    for (Py_ssize_t k = 0; k < n; ++k) {
        char* data;
        Py_ssize_t len;
        long port = PyLong_AsLong(PyList_GetItem(ports, k));
        if (PyBytes_AsStringAndSize(PyList_GetItem(frames, k), &data, &len) < 0) return -1;
        if (port < 0 || port >= NETAGG_PORTS || len <= 0 || len >= (Py_ssize_t)1 << 31) {
            PyErr_Clear();
            return -1;
        }
        m->push((int)port, reinterpret_cast<const uint8_t*>(data), (uint32_t)len);
    }
    return 0;
}

void nm_step(Model* m, uint64_t cycles) { m->step(cycles); }

// One cycle with `tick` high; 1, or 0 (and no cycle) when the top has no tick input.
int nm_tick(Model* m) {
#if NETAGG_HAS_TICK
    m->top->tick = 1;
    m->step(1);
    m->top->tick = 0;
    return 1;
#else
    (void)m;
    return 0;
#endif
}
// The ports whose link is lost (bit p, port p), on a leaf's `link_down` input; 1, or 0 when
// the top has none.
int nm_link_down(Model* m, uint32_t ports) {
#if NETAGG_HAS_LINK_DOWN
    m->top->link_down = ports;
    return 1;
#else
    (void)m;
    (void)ports;
    return 0;
#endif
}
int nm_run_until_idle(Model* m, uint64_t max_cycles, uint64_t idle) {
    return m->run_until_idle(max_cycles, idle);
}

// The frames received since the last call, as a Python list of (port, bytes) in the order their
// last beats left; NULL (with a Python exception set) if memory runs out.
PyObject* nm_take_output(Model* m) {
    size_t n = m->out_ports.size();
    PyObject* list = PyList_New((Py_ssize_t)n);
    if (!list) return nullptr;
    const char* data = reinterpret_cast<const char*>(m->out_data.data());
    for (size_t k = 0; k < n; ++k) {
        PyObject* item = PyTuple_New(2);
        PyObject* port = PyLong_FromLong(m->out_ports[k]);
        PyObject* frame = PyBytes_FromStringAndSize(data, (Py_ssize_t)m->out_lens[k]);
        if (!item || !port || !frame) {
            Py_DecRef(item);
            Py_DecRef(port);
            Py_DecRef(frame);
            Py_DecRef(list);
            return nullptr;
        }
        PyTuple_SetItem(item, 0, port);
        PyTuple_SetItem(item, 1, frame);
        PyList_SetItem(list, (Py_ssize_t)k, item);
        data += m->out_lens[k];
    }
    m->drop_output();
    return list;
}

// State of one port: [frames queued not yet fully sent, frames sent, beats sent, frames
// received, beats received, bytes of a frame partly received].
void nm_port_state(Model* m, int port, int64_t* state) {
    const Port& p = m->ports[port];
    state[0] = (int64_t)p.in_lens.size();
    state[1] = (int64_t)p.frames_in;
    state[2] = (int64_t)p.beats_in;
    state[3] = (int64_t)p.frames_out;
    state[4] = (int64_t)p.beats_out;
    state[5] = (int64_t)p.cur.size();
}

int64_t nm_queued(Model* m, int port) { return (int64_t)m->ports[port].in_lens.size(); }

// which: 0 = rx valid (gaps between the beats sent), 1 = tx ready (backpressure).
// A fixed pattern of `period` cycles (bit k: cycle k), or, with period 0, random with
// probability `bits` / 2^32 of being on, seeded by `seed`.
void nm_set_pattern(Model* m, int port, int which, uint64_t bits, unsigned period,
                    uint64_t seed) {
    Pattern& pat = which ? m->ports[port].tx_ready : m->ports[port].rx_valid;
    pat = Pattern{};
    if (period == 0) {
        pat.random = true;
        pat.threshold = bits;
        pat.state = seed ? seed : 0x9E3779B97F4A7C15ull;
    } else {
        pat.bits = bits;
        pat.period = period;
    }
}

uint64_t nm_errors(Model* m, char* text, int size) {
    std::snprintf(text, size, "%s", m->first_error.c_str());
    return m->errors;
}

// The traffic of nm_bench: frames[k] (bytes) is a frame of port ports[k], and port p keeps
// keep[p] frames queued (Python lists, checked by the caller). Returns 0, or -1 on a bad item.
int nm_bench_traffic(Model* m, PyObject* ports, PyObject* frames, PyObject* keep) {
    for (auto& t : m->bench_frames) t.clear();
    Py_ssize_t n = PyList_Size(ports);
    for (Py_ssize_t k = 0; k < n; ++k) {
        char* data;
        Py_ssize_t len;
        long port = PyLong_AsLong(PyList_GetItem(ports, k));
        if (PyBytes_AsStringAndSize(PyList_GetItem(frames, k), &data, &len) < 0) return -1;
        if (port < 0 || port >= NETAGG_PORTS || len <= 0 || len >= (Py_ssize_t)1 << 31) {
            PyErr_Clear();
            return -1;
        }
        m->bench_frames[port].emplace_back(data, data + len);
    }
    for (int p = 0; p < NETAGG_PORTS; ++p) {
        long q = PyLong_AsLong(PyList_GetItem(keep, p));
        if (q < 0) {
            PyErr_Clear();
            return -1;
        }
        m->bench_keep[p] = (size_t)q;
    }
    return 0;
}

// The reference loop: the same cycles as nm_step, the frames of nm_bench_traffic sent over and
// over (port p topped up to its keep[p] queued frames before every `chunk` cycles, as a Python
// driver would), the frames received dropped, for at least `cycles` cycles, without returning
// to Python. Fills stats with [cycles, frames received, bytes received, nanoseconds].
void nm_bench(Model* m, uint64_t cycles, uint64_t chunk, int64_t* stats) {
    size_t next[NETAGG_PORTS] = {};
    int64_t frames = 0, bytes = 0;
    uint64_t start = m->cycles;
    auto t0 = std::chrono::steady_clock::now();
    while (m->cycles - start < cycles) {
        for (int i = 0; i < NETAGG_PORTS; ++i) {
            const auto& pool = m->bench_frames[i];
            if (pool.empty()) continue;
            while (m->ports[i].in_lens.size() < m->bench_keep[i]) {
                const auto& f = pool[next[i]++ % pool.size()];
                m->push(i, f.data(), (uint32_t)f.size());
            }
        }
        m->step(chunk);
        frames += (int64_t)m->out_lens.size();
        bytes += (int64_t)m->out_data.size();
        m->drop_output();
    }
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t0).count();
    stats[0] = (int64_t)(m->cycles - start);
    stats[1] = frames;
    stats[2] = bytes;
    stats[3] = ns;
}

}  // extern "C"
