// The fast switch's entry points (sim/fast_build.py builds them, sim/fast.py and
// sim/fast_io.py call them): `fast_run`, a run of frames through the switch
// (fast_switch.h), and `fast_serve`, the socket loop around it (fast_io.h).
#include "fast_io.h"
#include "fast_switch.h"

extern "C" int fast_run(State *s, const uint8_t *heads, const uint8_t *body) {
    Switch sw(*s);
    s->stop = sw.run(heads, body);
    return int(s->stop);
}

extern "C" int fast_serve(State *s, Io *io) {
    Serve serve(*io, *s);
    return int(serve.loop());
}
