//! A peer device reading and writing memory mapped before and after `add_peer`.

use super::*;

#[test]
fn a_peer_device_reads_and_writes_memory_mapped_before_and_after_add_peer() {
    let test = "a_peer_device_reads_and_writes_memory_mapped_before_and_after_add_peer";
    let Some((allocator, cx, k, page)) = open(test, |_| Config::default()) else {
        return;
    };
    let count = cudarc::driver::result::device::get_count().expect("cuDeviceGetCount");
    if count < 2 {
        eprintln!("skipping {test}: one CUDA device only");
        return;
    }
    let peer = if ordinal() == 0 { 1 } else { 0 };
    let s0 = cx.new_stream().expect("stream on the device");
    let bytes = 2 * page;
    let n = elems(bytes);
    let before = allocator
        .alloc_on(bytes, sid(&s0))
        .expect("alloc before add_peer");
    k.iota(&s0, before.ptr(), n, 0x0a00_0000);
    match allocator.add_peer(peer) {
        Ok(()) => {}
        Err(Error::Driver(DriverError::PeerAccess { .. })) => {
            eprintln!(
                "skipping {test}: device {peer} cannot access device {}'s memory",
                ordinal()
            );
            return;
        }
        Err(e) => panic!("add_peer({peer}): {e}"),
    }
    let after = allocator
        .alloc_on(3 * bytes, sid(&s0))
        .expect("alloc after add_peer");
    k.iota(&s0, after.ptr(), 3 * n, 0x0b00_0000);
    s0.synchronize().expect("the fills");

    let cx1 = CudaContext::new(peer).expect("the peer device");
    let k1 = Kernels::load(&cx1);
    let s1 = cx1.new_stream().expect("stream on the peer");
    for (buffer, base, what) in [
        (&before, 0x0a00_0000u32, "mapped before add_peer"),
        (&after, 0x0b00_0000, "mapped after add_peer"),
    ] {
        let m = elems(buffer.len());
        let mut out = s1.alloc_zeros::<u32>(m as usize).expect("peer buffer");
        {
            let (out_ptr, _record) = out.device_ptr_mut(&s1);
            k1.copy_add(&s1, out_ptr, buffer.ptr(), m, 5, 0);
            (s1.synchronize()).unwrap_or_else(|e| {
                panic!("device {peer} reading the memory {what} (an illegal address?): {e}")
            });
            // And the peer writes it: buffer = out + 1.
            k1.copy_add(&s1, buffer.ptr(), out_ptr, m, 1, 0);
            (s1.synchronize()).unwrap_or_else(|e| {
                panic!("device {peer} writing the memory {what} (an illegal address?): {e}")
            });
        }
        let got = s1.clone_dtoh(&out).expect("reading the peer's copy");
        check_iota(
            &got,
            base + 5,
            &format!("device {peer}'s copy of memory {what}"),
        );
        check_iota(
            &read(&s0, buffer.ptr(), m),
            base + 6,
            &format!("memory {what}, written by device {peer}"),
        );
    }
    drop((before, after));
    finish(&allocator);
    assert_all_given_back(&allocator);
}
