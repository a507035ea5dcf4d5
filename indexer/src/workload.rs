//! Trace-driven KV event streams for the benches (filled in below).
