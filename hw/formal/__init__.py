"""Formal proofs of the switch's invariants: harnesses around the real stages, with the
properties as Amaranth `Assert`s, the environment's obligations as `Assume`s and the states
that must be reachable as `Cover`s (`hw.formal.aggregate`, `hw.formal.control`), and the
runner that proves them with SymbiYosys (`hw.formal.run`)."""
