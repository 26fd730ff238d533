//! Just enough gRPC framing and protobuf wire format to read a few fields.

/// The message inside a single uncompressed gRPC length-prefixed frame.
pub fn unframe(body: &[u8]) -> Option<&[u8]> {
    if body.len() < 5 || body[0] != 0 {
        return None;
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if body.len() != 5 + len {
        return None;
    }
    Some(&body[5..])
}

/// Bytes of the frame header (compressed flag, 4-byte big-endian length).
pub const FRAME_HEADER_LEN: usize = 5;

/// A buffer that starts with room for the frame header and has capacity for a message of
/// `message_len` bytes after it: the message is written straight in (no second copy to frame
/// it), then `close_frame` writes the header.
pub fn frame_buffer(message_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + message_len);
    out.extend_from_slice(&[0; FRAME_HEADER_LEN]);
    out
}

/// Writes the header of an uncompressed frame whose message is everything after the header's
/// room in `framed` (from `frame_buffer`).
pub fn close_frame(framed: &mut [u8]) {
    let len = (framed.len() - FRAME_HEADER_LEN) as u32;
    framed[0] = 0;
    framed[1..FRAME_HEADER_LEN].copy_from_slice(&len.to_be_bytes());
}

/// Frames one uncompressed message.
pub fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = frame_buffer(message.len());
    out.extend_from_slice(message);
    close_frame(&mut out);
    out
}

/// Appends `v` as a protobuf varint.
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Bytes `put_varint` writes for `v`.
pub fn varint_len(v: u64) -> usize {
    let bits = 64 - (v | 1).leading_zeros() as usize;
    (bits + 6) / 7
}

#[derive(Debug, PartialEq)]
pub enum Value<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32,
}

/// Iterates the top-level fields of a protobuf message; yields Err once on malformed input.
pub struct Fields<'a> {
    buf: &'a [u8],
    failed: bool,
}

impl<'a> Fields<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Fields { buf, failed: false }
    }

    /// Bytes not yet read: the caller turns this into offsets of the fields it sees.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn varint(&mut self) -> Option<u64> {
        let mut out: u64 = 0;
        for i in 0..10 {
            let b = *self.buf.get(i)?;
            out |= ((b & 0x7f) as u64) << (7 * i);
            if b & 0x80 == 0 {
                self.buf = &self.buf[i + 1..];
                return Some(out);
            }
        }
        None
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }

    fn next_field(&mut self) -> Option<(u32, Value<'a>)> {
        let tag = self.varint()?;
        let number = (tag >> 3) as u32;
        if number == 0 {
            return None;
        }
        let value = match tag & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed64
            }
            2 => {
                // Compared as u64 first: on wasm32 `as usize` would wrap a huge length.
                let len = self.varint()?;
                if len > self.buf.len() as u64 {
                    return None;
                }
                Value::Bytes(self.take(len as usize)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed32
            }
            _ => return None,
        };
        Some((number, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), ()>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.buf.is_empty() {
            return None;
        }
        match self.next_field() {
            Some(f) => Some(Ok(f)),
            None => {
                self.failed = true;
                Some(Err(()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_roundtrip() {
        let framed = frame(b"abc");
        let mut built = frame_buffer(3);
        built.extend_from_slice(b"abc");
        close_frame(&mut built);
        assert_eq!(built, framed, "built in place: the same frame");
        assert_eq!(framed, vec![0, 0, 0, 0, 3, b'a', b'b', b'c']);
        assert_eq!(unframe(&framed), Some(&b"abc"[..]));
        assert_eq!(unframe(&[1, 0, 0, 0, 0]), None, "compressed frames are not parsed");
        assert_eq!(unframe(&[0, 0, 0, 0, 2, 1]), None);
    }

    #[test]
    fn fields_all_wire_types() {
        let msg = [0x08, 0x96, 0x01, 0x11, 1, 2, 3, 4, 5, 6, 7, 8, 0x1a, 2, b'h', b'i', 0x25, 1, 2, 3, 4];
        let got: Vec<_> = Fields::new(&msg).collect();
        assert_eq!(
            got,
            vec![Ok((1, Value::Varint(150))), Ok((2, Value::Fixed64)), Ok((3, Value::Bytes(b"hi"))), Ok((4, Value::Fixed32))]
        );
        let mut v = vec![];
        put_varint(&mut v, 300);
        assert_eq!(v, vec![0xac, 0x02]);
        for v in [0u64, 1, 127, 128, 16_383, 16_384, (1 << 21) - 1, 1 << 21, u64::MAX] {
            let mut w = vec![];
            put_varint(&mut w, v);
            assert_eq!(varint_len(v), w.len(), "{}", v);
        }
        let truncated: Vec<_> = Fields::new(&[0x1a, 5, b'x']).collect();
        assert_eq!(truncated, vec![Err(())]);
    }
}
