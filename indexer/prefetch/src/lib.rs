//! The index's one use of `unsafe`: a cache prefetch hint.
//!
//! Applying an event probes a (worker, rank)'s block map once per block, at a random place in a
//! table of megabytes, so each probe is a cache miss (~200 ns on the project's machine). Asking
//! for the line a few blocks ahead lets those misses overlap the work on the blocks before:
//! measured ~1.3× the apply rate of the same code reading the lines ahead with plain loads
//! (BENCHMARKS.md, "Radix index v3"). Rust has no safe prefetch; this module is the whole of
//! it, in a crate of its own with no dependencies so that `scripts/test` runs its test under
//! Miri in seconds (`cargo +nightly miri test -p kvroute-prefetch`) instead of compiling the
//! indexer's dependencies for Miri.

/// Hints that `slice[index]` (and the line after it) will be read soon. Does nothing when
/// `index` is out of bounds, and on targets other than x86-64.
#[inline(always)]
pub fn prefetch<T>(slice: &[T], index: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(item) = slice.get(index) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let p = std::ptr::from_ref(item).cast::<i8>();
        // SAFETY: `_mm_prefetch` is `unsafe` only because it is an SSE intrinsic, and SSE is
        // part of every x86-64 target. A prefetch is a hint: it never faults, whatever the
        // address, and has no effect the program can observe; `p` points into `slice`, and the
        // second line is computed with wrapping arithmetic and never dereferenced.
        #[allow(unsafe_code)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, index);
}

#[cfg(test)]
mod tests {
    use super::prefetch;

    #[test]
    fn any_index_is_a_harmless_hint() {
        let v: Vec<u64> = (0..1000).collect();
        for i in [0, 1, 500, 999, 1000, usize::MAX] {
            prefetch(&v, i);
        }
        let empty: [u8; 0] = [];
        prefetch(&empty, 0);
        assert_eq!(v.iter().sum::<u64>(), 499_500);
    }
}
