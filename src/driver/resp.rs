//! Where one RESP reply ends in a buffer, without decoding it, and the
//! decoding of a whole frame: the replies the lock sends back (integers,
//! bulk strings, arrays of them, `+OK`) here, anything else by the `redis`
//! crate's parser.

use redis::Value;

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

/// Decodes one whole frame (as [`frame_len`] found it), as
/// [`redis::parse_redis_value`] does. The replies the lock's commands get,
/// made of `+`, `:`, `$` and `*` (nested at most [`FAST_DEPTH`] deep), are
/// decoded here, without the general parser's cost (a fifth of the
/// client's own CPU per lock and release, measured); anything else (an
/// error, a RESP3 type, a malformed frame) by that parser.
pub(crate) fn parse(frame: &[u8]) -> redis::RedisResult<Value> {
    match fast(frame, 0, 0) {
        Some((v, end)) if end == frame.len() => Ok(v),
        _ => redis::parse_redis_value(frame),
    }
}

/// How deep [`parse`] decodes arrays itself.
const FAST_DEPTH: usize = 8;

/// The value at `pos` and where it ends, or None where the general parser
/// must decide.
fn fast(buf: &[u8], pos: usize, depth: usize) -> Option<(Value, usize)> {
    let kind = *buf.get(pos)?;
    let eol = find_crlf(buf, pos + 1)?;
    let line = buf.get(pos + 1..eol)?;
    let next = eol + 2;
    match kind {
        b'+' => {
            let text = std::str::from_utf8(line).ok()?;
            let v = if text == "OK" {
                Value::Okay
            } else {
                Value::SimpleString(text.to_owned())
            };
            Some((v, next))
        }
        b':' => Some((Value::Int(int(line)?), next)),
        b'$' => {
            let n = int(line)?;
            if n < 0 {
                return Some((Value::Nil, next));
            }
            let end = next.checked_add(usize::try_from(n).ok()?)?;
            if buf.get(end..end.checked_add(2)?)? != b"\r\n" {
                return None;
            }
            Some((Value::BulkString(buf.get(next..end)?.to_vec()), end + 2))
        }
        b'*' if depth < FAST_DEPTH => {
            let n = int(line)?;
            if n < 0 {
                return Some((Value::Nil, next));
            }
            let n = usize::try_from(n).ok()?;
            // Every element takes at least 3 bytes: a count beyond what is
            // there is the general parser's to refuse.
            let mut items = Vec::with_capacity(n.min(buf.len() / 3));
            let mut at = next;
            for _ in 0..n {
                let (v, end) = fast(buf, at, depth + 1)?;
                items.push(v);
                at = end;
            }
            Some((Value::Array(items), at))
        }
        _ => None,
    }
}

/// An integer line, trimmed as the `redis` crate trims it (a line only
/// Unicode whitespace would trim goes to that parser).
fn int(line: &[u8]) -> Option<i64> {
    parse_int(line.trim_ascii()).ok()
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

    /// Every frame decodes as the `redis` crate decodes it, whether this
    /// module or that parser does the work.
    #[test]
    fn frames_decode_as_the_redis_crate_decodes_them() {
        let frames: &[&[u8]] = &[
            b"+OK\r\n",
            b"+QUEUED\r\n",
            b"+\r\n",
            b":0\r\n",
            b":-1\r\n",
            b":1796228618372\r\n",
            b":9223372036854775807\r\n",
            b": 12 \r\n",
            b"$-1\r\n",
            b"$0\r\n\r\n",
            b"$5\r\nab\r\nc\r\n",
            b"$3\r\n\xff\x00\x01\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*6\r\n:1796228618372\r\n:1153960\r\n:10000\r\n:1\r\n$0\r\n\r\n:1\r\n",
            b"*2\r\n*2\r\n$10\r\n1796228618\r\n$6\r\n372000\r\n*1\r\n$-1\r\n",
            b"*3\r\n+OK\r\n$-1\r\n$2\r\nab\r\n",
            // The general parser's: errors, RESP3, odd nesting.
            b"-ERR no\r\n",
            b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
            b"*2\r\n:1\r\n-ERR inside\r\n",
            b"_\r\n",
            b"#t\r\n",
            b",1.5\r\n",
            b"%1\r\n+a\r\n:1\r\n",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:7\r\n",
            // Malformed: refused by that parser, as before.
            b":x\r\n",
            b"+\xff\r\n",
            b"$3\r\nabcd\r\n",
        ];
        for f in frames {
            let want = redis::parse_redis_value(f);
            let got = parse(f);
            assert_eq!(
                format!("{got:?}"),
                format!("{want:?}"),
                "{}",
                String::from_utf8_lossy(f)
            );
        }
    }

    /// The decoding this module does itself is the common case: the lock's
    /// replies never reach the general parser, up to [`FAST_DEPTH`] arrays
    /// deep.
    #[test]
    fn the_lock_replies_are_decoded_here() {
        let nested = |depth: usize| {
            let mut f = b"*1\r\n".repeat(depth);
            f.extend_from_slice(b":7\r\n");
            f
        };
        let frames: Vec<Vec<u8>> = vec![
            b"*6\r\n:1\r\n:2\r\n:3\r\n:1\r\n$0\r\n\r\n:1\r\n".to_vec(),
            b"*1\r\n:-1\r\n".to_vec(),
            b"+OK\r\n".to_vec(),
            b"+QUEUED\r\n".to_vec(),
            b": 12 \r\n".to_vec(),
            b"$-1\r\n".to_vec(),
            b"*2\r\n*2\r\n$1\r\n1\r\n$1\r\n2\r\n$2\r\nab\r\n".to_vec(),
            nested(FAST_DEPTH),
        ];
        for f in &frames {
            let here = fast(f, 0, 0).map(|(v, end)| (format!("{v:?}"), end));
            let want = redis::parse_redis_value(f).map(|v| format!("{v:?}")).ok();
            assert_eq!(
                here,
                want.map(|v| (v, f.len())),
                "{}",
                String::from_utf8_lossy(f)
            );
        }
        assert!(fast(&nested(FAST_DEPTH + 1), 0, 0).is_none(), "too deep");
        assert!(fast(b"-ERR x\r\n", 0, 0).is_none());
        assert!(fast(b"*2\r\n:1\r\n_\r\n", 0, 0).is_none(), "RESP3 inside");
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
