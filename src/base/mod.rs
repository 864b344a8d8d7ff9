//! Layer 0, below everything: sizes, division by a page size, bit vectors and the facade's lock types.

pub(crate) mod bit_words;
pub(crate) mod bits;
pub(crate) mod divisor;
pub mod size;
pub(crate) mod sync;
