//! Placeholder; replaced by the trace-driven benches.
fn main() {}
