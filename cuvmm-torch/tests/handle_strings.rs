//! Handle strings come from another process (through `torch.multiprocessing`'s pickles): any bytes at all
//! must decode to a handle or to `BadHandle`, never to a panic (which the C ABI would turn into an error
//! too, but only after unwinding through the decoder). Both layouts, cuvmm's own and PyTorch's expandable
//! segments', round-trip, and every cut or changed byte of a valid one is decoded or refused.

use cuvmm::sharing::SharedPart;
use cuvmm_torch::AbiError;
use cuvmm_torch::sharing::HandleString;
use cuvmm_torch::torch_handle::TorchHandle;
use cuvmm_torch::transport::{Address, NAME_PREFIX};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

/// Both decoders on `bytes`: each gives a handle or `BadHandle`.
fn decode_both(bytes: &[u8]) -> (bool, bool) {
    let torch = TorchHandle::decode(bytes);
    let own = HandleString::decode(bytes);
    for err in [torch.as_ref().err(), own.as_ref().err()]
        .into_iter()
        .flatten()
    {
        assert!(
            matches!(err, AbiError::BadHandle { .. }),
            "not a BadHandle: {err:?}"
        );
    }
    (torch.is_ok(), own.is_ok())
}

fn torch_handle() -> impl Strategy<Value = TorchHandle> {
    (
        2u8..=3,
        any::<i32>(),
        1u64..=64,
        prop::collection::vec(any::<i32>(), 1..8),
        prop::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(version, pid, pages, fds, rest)| TorchHandle {
            version,
            pid,
            segment_size: pages * 2 * MIB,
            fds,
            rest,
        })
}

/// A part inside its handle: a handle of 1 to 10 pages, mapped from some page for at least one.
fn part() -> impl Strategy<Value = SharedPart<()>> {
    (1u64..=10)
        .prop_flat_map(|pages| (Just(pages), 0..pages))
        .prop_flat_map(|(pages, from)| (Just(pages), Just(from), 1..=pages - from))
        .prop_map(|(pages, from, mapped)| SharedPart {
            fd: (),
            handle_size: pages * 2 * MIB,
            handle_offset: from * 2 * MIB,
            size: mapped * 2 * MIB,
        })
}

fn handle_string() -> impl Strategy<Value = HandleString> {
    (
        "[0-9a-f]{1,40}",
        any::<u64>(),
        prop::collection::vec(part(), 1..6),
    )
        .prop_map(|(name, id, parts)| HandleString {
            address: Address::from_bytes(format!("{NAME_PREFIX}{name}").as_bytes())
                .expect("a valid name"),
            id,
            parts,
        })
}

/// `bytes` with the byte at `at` (modulo its length) replaced by `with`.
fn changed(mut bytes: Vec<u8>, at: usize, with: u8) -> Vec<u8> {
    let len = bytes.len();
    bytes[at % len] = with;
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_bytes_decode_or_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        decode_both(&bytes);
    }

    #[test]
    fn pytorchs_layout_round_trips_and_survives_any_cut_or_change(
        handle in torch_handle(),
        at in any::<usize>(),
        with in any::<u8>(),
        count in any::<u64>(),
    ) {
        let bytes = handle.encode();
        prop_assert!(TorchHandle::is_torch(&bytes));
        prop_assert_eq!(TorchHandle::decode(&bytes).expect("decodes"), handle.clone());
        for cut in 0..bytes.len() {
            decode_both(&bytes[..cut]);
        }
        decode_both(&changed(bytes.clone(), at, with));
        // Any count of handles, however large, against the bytes that follow.
        let mut counted = bytes;
        counted[18..26].copy_from_slice(&count.to_le_bytes());
        decode_both(&counted);
    }

    #[test]
    fn cuvmms_layout_round_trips_and_survives_any_cut_or_change(
        handle in handle_string(),
        at in any::<usize>(),
        with in any::<u8>(),
    ) {
        let bytes = handle.encode();
        prop_assert!(!TorchHandle::is_torch(&bytes));
        prop_assert_eq!(HandleString::decode(&bytes).expect("decodes"), handle.clone());
        for cut in 0..bytes.len() {
            prop_assert_eq!(decode_both(&bytes[..cut]), (false, false), "cut at {}", cut);
        }
        decode_both(&changed(bytes, at, with));
    }
}
