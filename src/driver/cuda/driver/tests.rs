//! What `CudaDriver` reads from CUDA, checked on a real device (skipped without one).

use super::*;
use crate::driver::cuda::errors::says_unknown;
use crate::driver::cuda::give_back::GiveBackCalls;

/// What `give_back.rs` reads from CUDA, on a real device: the two queries' answers before and after a
/// resource is given back, and the driver's answer to a call repeated on a resource that is gone (which
/// must be "invalid", the ledger's sign of "gone"). Skips without a GPU. On the GPU machine:
/// `cargo test --features cuda --lib driver::cuda -- --nocapture`.
#[test]
fn the_answers_give_back_reads_are_cudas() {
    let mut d = match CudaDriver::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let g = d.granularity;
    let r = d.reserve(2 * g).expect("reserve");
    let h = d.create(g).expect("create");
    assert_eq!(d.calls.handle_live(h.0), Ok(true), "a live handle");
    assert_eq!(d.calls.mapped(r.start), Ok(false), "reserved, not mapped");
    d.map(r.start, g, h).expect("map");
    assert_eq!(d.calls.mapped(r.start), Ok(true), "mapped");
    assert_eq!(
        d.calls.mapped(r.start + g / 2),
        Ok(true),
        "inside a mapping"
    );
    assert_eq!(d.calls.mapped(r.start + g), Ok(false), "the next page");
    d.unmap(r.start, g).expect("unmap");
    assert_eq!(d.calls.mapped(r.start), Ok(false), "unmapped");
    // CUDA accepts an unmap of a reserved range with nothing mapped (H100, driver 580): a repeat tells
    // nothing, which is why `give_back.rs` asks `CU_POINTER_ATTRIBUTE_MAPPED` after a failed unmap.
    assert_eq!(d.calls.unmap(r.start, g), Ok(()), "unmap twice");
    assert_eq!(d.calls.mapped(r.start), Ok(false), "still unmapped");
    // The driver validates each of these names: a repeat on a resource that is gone is rejected, as a
    // settle's repeat after a failure that took effect would be (here nothing else could have been given
    // the same name in between).
    d.release(h).expect("release");
    // CUDA still answers the properties of a released handle (H100, driver 580: Ok(true)), so the
    // query cannot tell a release that took effect; the repeat's "invalid" does (`give_back.rs`).
    eprintln!(
        "cuMemGetAllocationPropertiesFromHandle on a released handle: {:?}",
        d.calls.handle_live(h.0)
    );
    let again = d.calls.release(h.0).expect_err("release twice");
    assert!(says_unknown(&again), "release twice: {again}");
    d.free_reservation(r).expect("free_reservation");
    let again = d
        .calls
        .address_free(r.start, r.size)
        .expect_err("free a reservation twice");
    assert!(says_unknown(&again), "free a reservation twice: {again}");
    let p = d.malloc(4096).expect("malloc");
    assert_eq!(d.calls.mapped(p), Ok(true), "a live allocation");
    d.free(p).expect("free");
    assert_eq!(d.calls.mapped(p), Ok(false), "a freed allocation");
    let again = d.calls.free(p).expect_err("free twice");
    assert!(says_unknown(&again), "free twice: {again}");
    assert!(d.leak_report().is_empty());
}
