//! The id of a tag (`sleep.rs`, which names tags and puts them to sleep): a segment key carries it, so it is
//! small and `Copy`.

/// The index of a tag in the allocator's list of tags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct TagId(pub u32);
