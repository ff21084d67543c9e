//! Where one RESP reply ends in a buffer, without decoding it (the `redis`
//! crate decodes once the frame is whole).

/// Length of the first complete RESP2/RESP3 frame in `buf`: `Ok(None)` when
/// more bytes are needed, `Err` when the bytes are not RESP. Iterative, so a
/// deeply nested reply cannot overflow the stack.
pub(crate) fn frame_len(buf: &[u8]) -> Result<Option<usize>, ()> {
    let mut pos = 0usize;
    let mut remaining: u64 = 1;
    while remaining > 0 {
        remaining -= 1;
        let Some(&kind) = buf.get(pos) else {
            return Ok(None);
        };
        let Some(eol) = find_crlf(buf, pos + 1) else {
            return Ok(None);
        };
        let header = &buf[pos + 1..eol];
        pos = eol + 2;
        match kind {
            b'+' | b'-' | b':' | b'_' | b'#' | b',' | b'(' => {}
            b'$' | b'=' | b'!' => {
                let n = parse_int(header)?;
                if n >= 0 {
                    let n = usize::try_from(n).map_err(|_| ())?;
                    let end = pos
                        .checked_add(n)
                        .and_then(|e| e.checked_add(2))
                        .ok_or(())?;
                    if buf.len() < end {
                        return Ok(None);
                    }
                    if &buf[end - 2..end] != b"\r\n" {
                        return Err(());
                    }
                    pos = end;
                }
            }
            b'*' | b'~' | b'>' => {
                let n = parse_int(header)?;
                if n > 0 {
                    remaining = remaining.checked_add(n as u64).ok_or(())?;
                }
            }
            b'%' | b'|' => {
                let n = parse_int(header)?;
                if n > 0 {
                    let n = (n as u64).checked_mul(2).ok_or(())?;
                    remaining = remaining.checked_add(n).ok_or(())?;
                }
                if kind == b'|' {
                    // An attribute precedes the value it describes.
                    remaining = remaining.checked_add(1).ok_or(())?;
                }
            }
            _ => return Err(()),
        }
    }
    Ok(Some(pos))
}

fn find_crlf(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|i| from + i)
}

fn parse_int(s: &[u8]) -> Result<i64, ()> {
    std::str::from_utf8(s)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_found_only_when_complete() {
        assert_eq!(frame_len(b""), Ok(None));
        assert_eq!(frame_len(b"+OK\r"), Ok(None));
        assert_eq!(frame_len(b"+OK\r\n"), Ok(Some(5)));
        assert_eq!(frame_len(b"+OK\r\n:1\r\n"), Ok(Some(5)));
        assert_eq!(frame_len(b"$-1\r\n"), Ok(Some(5)));
        assert_eq!(frame_len(b"$3\r\nab"), Ok(None));
        assert_eq!(frame_len(b"$3\r\nabc\r\n"), Ok(Some(9)));
        assert_eq!(frame_len(b"*2\r\n:1\r\n"), Ok(None));
        assert_eq!(frame_len(b"*2\r\n:1\r\n:-1\r\n"), Ok(Some(13)));
        assert_eq!(frame_len(b"*2\r\n*1\r\n:1\r\n$1\r\nx\r\n"), Ok(Some(19)));
        assert_eq!(frame_len(b"*0\r\n"), Ok(Some(4)));
        assert_eq!(frame_len(b"-ERR no\r\n"), Ok(Some(9)));
        assert_eq!(frame_len(b"?x\r\n"), Err(()));
        assert_eq!(frame_len(b"$3\r\nabcd\r\n"), Err(()));
        assert_eq!(frame_len(b"*x\r\n"), Err(()));
        // Every prefix of a frame is incomplete, never an error.
        let full = b"*3\r\n:1\r\n$2\r\nab\r\n*1\r\n+OK\r\n";
        for cut in 0..full.len() {
            assert_eq!(frame_len(&full[..cut]), Ok(None), "cut at {cut}");
        }
        assert_eq!(frame_len(full), Ok(Some(full.len())));
    }

    #[test]
    fn deep_nesting_does_not_recurse() {
        let mut deep = Vec::new();
        for _ in 0..100_000 {
            deep.extend_from_slice(b"*1\r\n");
        }
        assert_eq!(frame_len(&deep), Ok(None));
        deep.extend_from_slice(b":1\r\n");
        assert_eq!(frame_len(&deep), Ok(Some(deep.len())));
    }
}
