//! Reads fuzzer bytes as small numbers. Shared by the fuzz targets and `tests/fuzz_corpus.rs`.
//!
//! A missing byte reads as 0, so every input, however short, decodes to something: the decoders stop
//! when [`Input::is_empty`] says the bytes are used up.

/// The bytes not read yet.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    bytes: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads `bytes` from the first one.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The next byte, or 0 once the input is used up.
    pub fn byte(&mut self) -> u8 {
        match self.bytes.split_first() {
            Some((&b, rest)) => {
                self.bytes = rest;
                b
            }
            None => 0,
        }
    }

    /// The next two bytes, little-endian.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    /// The next byte, reduced to `0 .. n` (`n > 0`).
    pub fn below(&mut self, n: u8) -> u8 {
        self.byte() % n
    }
}
