//! The rule for mapping part of a handle (`Driver::map_from` with an offset), on both sides of
//! `Driver::maps_parts_of_handles`.

use super::*;

/// `cuMemMap` with an offset. CUDA's documentation says the offset must be zero, and an H100 (driver 580)
/// answers one with `CUDA_ERROR_NOT_SUPPORTED`: a driver that says it cannot map part of a handle
/// (`Driver::maps_parts_of_handles`, CUDA's and the simulator's default) must refuse an offset and leave
/// nothing mapped. One that says it can (the simulator with `partial_mappings`, which cuvmm's lending needs):
/// a page of a handle may be mapped on its own while the whole handle is mapped elsewhere; both mappings
/// show the same bytes; an offset past the handle or off the granularity is refused; memory is freed once
/// the handle is released and its last mapping is gone.
pub(super) fn map_from_offset<D: Subject>(d: &mut D) {
    let g = d.granularity();
    if !d.maps_parts_of_handles() {
        let r = d.reserve(2 * g).expect("reserve");
        let h = d.create(2 * g).expect("create two pages");
        rejected(
            "map a handle's second page on its own",
            d.map_from(
                r.start,
                g,
                PhysPage {
                    handle: h,
                    offset: g,
                },
            ),
            |e| matches!(e, DriverError::Unsupported { .. }),
        );
        d.map_from(
            r.start,
            2 * g,
            PhysPage {
                handle: h,
                offset: 0,
            },
        )
        .expect("map the whole handle from offset 0");
        d.set_access(r.start, 2 * g).expect("set_access");
        d.unmap(r.start, 2 * g).expect("unmap");
        teardown(d, r, &[h]);
        return;
    }
    let free0 = free_bytes(d);
    let r = d.reserve(8 * g).expect("reserve");
    let h = d.create(4 * g).expect("create four pages");
    let (whole, part) = (r.start, r.start + 5 * g);
    d.map(whole, 4 * g, h).expect("map the whole handle");
    d.map_from(
        part,
        g,
        PhysPage {
            handle: h,
            offset: 2 * g,
        },
    )
    .expect("map its third page again, on its own");
    d.set_access(whole, 4 * g).expect("set_access on the whole");
    d.set_access(part, g).expect("set_access on the part");
    d.memset_d8(whole, 4 * g, 0x21).expect("memset the whole");
    d.memset_d8(part, g, 0x42).expect("memset through the part");
    expect_bytes(
        d,
        whole + 2 * g,
        g as usize,
        0x42,
        "the third page, written through the part",
    );
    expect_bytes(d, whole + g, g as usize, 0x21, "the second page");
    rejected(
        "map past the handle's end",
        d.map_from(
            part + g,
            2 * g,
            PhysPage {
                handle: h,
                offset: 3 * g,
            },
        ),
        |e| matches!(e, DriverError::OutsideHandle { .. }),
    );
    rejected(
        "map from an unaligned offset",
        d.map_from(
            part + g,
            g,
            PhysPage {
                handle: h,
                offset: g / 2,
            },
        ),
        |e| matches!(e, DriverError::NotAligned { .. }),
    );
    d.unmap(whole, 4 * g).expect("unmap the whole");
    expect_bytes(
        d,
        part,
        g as usize,
        0x42,
        "the part, once the whole is unmapped",
    );
    d.release(h).expect("release while the part is mapped");
    let held = free_bytes(d);
    assert!(
        held + 2 * g <= free0,
        "memory was freed while a part was mapped: {free0} -> {held}"
    );
    d.unmap(part, g).expect("unmap the part");
    let back = free_bytes(d);
    assert!(
        back + g / 2 >= free0,
        "memory was not freed at the last unmap: {free0} -> {back}"
    );
    d.free_reservation(r).expect("free_reservation");
}
