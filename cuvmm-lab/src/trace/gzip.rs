//! Gzipped trace files: any format [`load`](super::load) reads may come gzipped (`snapshot.pickle.gz`,
//! `*.pt.trace.json.gz`, `log.csv.gz`), recognised by gzip's magic bytes rather than by the file's name.

use std::borrow::Cow;
use std::io::Read;

/// The first bytes of every gzip stream (RFC 1952).
const MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Whether `bytes` start a gzip stream.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&MAGIC)
}

/// `bytes` decompressed when they are gzipped (every member of a multi-member file), else `bytes` as they are.
///
/// # Errors
/// A gzip stream that is corrupt or cut short.
pub fn decompressed(bytes: &[u8]) -> std::io::Result<Cow<'_, [u8]>> {
    if !is_gzip(bytes) {
        return Ok(Cow::Borrowed(bytes));
    }
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes).read_to_end(&mut out)?;
    Ok(Cow::Owned(out))
}

/// Up to `n` bytes from the start of what `reader` holds, decompressed when it is gzipped: enough to tell a
/// file's format from its first bytes. A gzip stream that breaks off after some bytes gives those.
///
/// # Errors
/// The reader's own errors, and a gzip stream that is corrupt or cut short before its first byte.
pub fn head(mut reader: impl Read, n: usize) -> std::io::Result<Vec<u8>> {
    let mut start = Vec::with_capacity(n);
    (&mut reader).take(n as u64).read_to_end(&mut start)?;
    if !is_gzip(&start) {
        return Ok(start);
    }
    let mut decoder = flate2::read::MultiGzDecoder::new(std::io::Cursor::new(start).chain(reader));
    let mut out = vec![0; n];
    let mut filled = 0;
    while filled < n {
        match decoder.read(&mut out[filled..]) {
            Ok(0) => break,
            Ok(read) => filled += read,
            Err(err) if filled == 0 => return Err(err),
            Err(_) => break,
        }
    }
    out.truncate(filled);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::GzEncoder;
    use std::io::Write;

    fn gz(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    #[test]
    fn gzipped_bytes_are_decompressed_and_plain_ones_kept() {
        let text = b"# cuvmm-trace v1\nalloc 1 4096 0\n".repeat(100);
        let zipped = gz(&text);
        assert!(is_gzip(&zipped) && !is_gzip(&text));
        assert_eq!(decompressed(&zipped).unwrap().as_ref(), text.as_slice());
        assert!(matches!(decompressed(&text).unwrap(), Cow::Borrowed(_)));
        // Two members, as `cat a.gz b.gz` makes: both are read.
        let two = [gz(b"ab"), gz(b"cd")].concat();
        assert_eq!(decompressed(&two).unwrap().as_ref(), b"abcd");
        assert!(decompressed(&zipped[..zipped.len() / 2]).is_err());
    }

    #[test]
    fn the_head_is_the_start_of_the_decompressed_bytes() {
        let text = b"Thread,Time,Action,Pointer,Size,Stream\n".repeat(1000);
        let zipped = gz(&text);
        assert_eq!(head(zipped.as_slice(), 16).unwrap(), &text[..16]);
        assert_eq!(head(text.as_slice(), 16).unwrap(), &text[..16]);
        // Cut short, the head is what decodes before the cut.
        let cut = head(&zipped[..zipped.len() / 2], 64).unwrap();
        assert_eq!(cut, &text[..64]);
        assert!(head(&[0x1f, 0x8b, 8][..], 64).is_err());
        assert_eq!(head(gz(b"").as_slice(), 64).unwrap(), b"");
    }
}
