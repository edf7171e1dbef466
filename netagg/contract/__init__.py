"""netagg's contract: the wire (`headers`), the switch's register map (`regmap`), and the
software codecs derived from them (`wire`, `wire_icrc`). Plain Python and numpy: the host, the
gateware, the golden model and the tests all read the format from here."""
