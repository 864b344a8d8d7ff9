//! The record of a chunk with pages lent (see `lending.rs`, which lends and takes them back).

/// Where a chunk with pages lent is mapped, and how many of its pages are lent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Lender {
    /// The segment of the chunk's home mapping.
    pub slot: usize,
    /// The first page of the chunk's group there.
    pub group: usize,
    /// Pages lent: mapped elsewhere, or on their way to a mapping.
    pub lent: usize,
}
