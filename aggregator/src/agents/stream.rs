//! The body of an agent's watch stream, decoded as it arrives: HTTP/1.1 chunked
//! framing (RFC 9112 §7.1) carrying one JSON document per line (NDJSON). Nothing is
//! buffered but a line that a read cut in two; a complete line is handed over straight
//! from the bytes read.
//!
//! Stricter than RFC 9112 where it helps: a chunk-size line is at most
//! [`MAX_SIZE_LINE`] bytes, trailers at most [`MAX_TRAILERS`], and bytes after the last
//! chunk are an error (the connection is out of step and is not kept).

/// Longest chunk-size line (size, extensions, CRLF).
const MAX_SIZE_LINE: usize = 1024;
/// Most trailer bytes after the last chunk.
const MAX_TRAILERS: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// In a chunk-size line: the size so far, digits seen, in the extensions, bytes.
    Size {
        size: u64,
        digits: bool,
        ext: bool,
        len: usize,
    },
    /// The CR of the size line seen.
    SizeLf {
        size: u64,
    },
    /// Inside a chunk's data.
    Data {
        left: u64,
    },
    /// After a chunk's data: its CRLF.
    DataCr,
    DataLf,
    /// After the last chunk: trailer lines up to an empty one.
    Trailer {
        line: usize,
        total: usize,
    },
    /// The stream ended.
    Done,
}

/// The decoder of one stream.
#[derive(Debug)]
pub struct Lines {
    state: State,
    /// A line cut by the end of a read, waiting for its rest.
    partial: Vec<u8>,
    /// Lines ended so far, blank ones (heartbeats) included.
    ended: u64,
}

impl Default for Lines {
    fn default() -> Self {
        Lines {
            state: State::Size {
                size: 0,
                digits: false,
                ext: false,
                len: 0,
            },
            partial: Vec::new(),
            ended: 0,
        }
    }
}

/// Why a stream cannot be read on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The framing is broken.
    #[error("malformed stream: {0}")]
    Malformed(&'static str),
    /// A line is longer than the limit.
    #[error("a document over {0} bytes")]
    TooLarge(usize),
}

impl Lines {
    /// How many lines have ended so far, blank ones (the heartbeat) included: what tells
    /// a live stream from one trickled a byte at a time.
    pub fn ended(&self) -> u64 {
        self.ended
    }

    /// The last chunk and its trailers have been read.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Decode `input`, handing each complete non-empty line (without its newline or a
    /// CR before it) to `each`; a line is at most `limit` bytes. The lines handed over.
    pub fn feed(
        &mut self,
        mut input: &[u8],
        limit: usize,
        each: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, StreamError> {
        use StreamError::Malformed;
        let mut lines = 0;
        while !input.is_empty() {
            match &mut self.state {
                State::Done => return Err(Malformed("bytes after the last chunk")),
                State::Size {
                    size,
                    digits,
                    ext,
                    len,
                } => {
                    let b = input[0];
                    input = &input[1..];
                    *len += 1;
                    if *len > MAX_SIZE_LINE {
                        return Err(Malformed("chunk-size line too long"));
                    }
                    match b {
                        b'\r' if *digits => self.state = State::SizeLf { size: *size },
                        _ if *ext => {}
                        b';' | b' ' | b'\t' if *digits => *ext = true,
                        _ => {
                            let d = (b as char)
                                .to_digit(16)
                                .ok_or(Malformed("bad chunk size"))?;
                            *size = size
                                .checked_mul(16)
                                .and_then(|s| s.checked_add(u64::from(d)))
                                .ok_or(Malformed("chunk size overflows"))?;
                            *digits = true;
                        }
                    }
                }
                State::SizeLf { size } => {
                    if input[0] != b'\n' {
                        return Err(Malformed("chunk-size line not ended by CRLF"));
                    }
                    input = &input[1..];
                    self.state = if *size == 0 {
                        State::Trailer { line: 0, total: 0 }
                    } else {
                        State::Data { left: *size }
                    };
                }
                State::Data { left } => {
                    let n = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(input.len());
                    let (data, rest) = input.split_at(n);
                    *left -= n as u64;
                    if *left == 0 {
                        self.state = State::DataCr;
                    }
                    input = rest;
                    lines += self.split(data, limit, each)?;
                }
                State::DataCr | State::DataLf => {
                    let want = if self.state == State::DataCr {
                        b'\r'
                    } else {
                        b'\n'
                    };
                    if input[0] != want {
                        return Err(Malformed("chunk not ended by CRLF"));
                    }
                    input = &input[1..];
                    self.state = if want == b'\r' {
                        State::DataLf
                    } else {
                        State::Size {
                            size: 0,
                            digits: false,
                            ext: false,
                            len: 0,
                        }
                    };
                }
                State::Trailer { line, total } => {
                    let b = input[0];
                    input = &input[1..];
                    *total += 1;
                    if *total > MAX_TRAILERS {
                        return Err(Malformed("trailers too long"));
                    }
                    match b {
                        b'\n' if *line == 0 => self.state = State::Done,
                        b'\n' => *line = 0,
                        // A CR ends the line with the LF that follows; an empty line is
                        // "\r\n" alone.
                        b'\r' => {}
                        _ => *line += 1,
                    }
                }
            }
        }
        Ok(lines)
    }

    /// Split chunk data into lines; the lines handed over.
    fn split(
        &mut self,
        mut data: &[u8],
        limit: usize,
        each: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, StreamError> {
        let mut lines = 0;
        while let Some(i) = memchr::memchr(b'\n', data) {
            let (head, rest) = (&data[..i], &data[i + 1..]);
            data = rest;
            self.ended += 1;
            if self.partial.is_empty() {
                lines += deliver(head, limit, each)?;
            } else {
                if self.partial.len() + head.len() > limit + 1 {
                    return Err(StreamError::TooLarge(limit));
                }
                self.partial.extend_from_slice(head);
                let line = std::mem::take(&mut self.partial);
                lines += deliver(&line, limit, each)?;
            }
        }
        if !data.is_empty() {
            if self.partial.len() + data.len() > limit + 1 {
                return Err(StreamError::TooLarge(limit));
            }
            self.partial.extend_from_slice(data);
        }
        Ok(lines)
    }
}

fn deliver(line: &[u8], limit: usize, each: &mut dyn FnMut(&[u8])) -> Result<usize, StreamError> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.len() > limit {
        return Err(StreamError::TooLarge(limit));
    }
    if line.is_empty() {
        return Ok(0);
    }
    each(line);
    Ok(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(parts: &[&[u8]], limit: usize) -> (Vec<String>, Result<bool, StreamError>) {
        let mut l = Lines::default();
        let mut got = Vec::new();
        for p in parts {
            if let Err(e) = l.feed(p, limit, &mut |line| {
                got.push(String::from_utf8(line.to_vec()).unwrap())
            }) {
                return (got, Err(e));
            }
        }
        (got, Ok(l.done()))
    }

    /// Lines whole in a chunk, cut across chunks and across reads, CRLF line ends,
    /// empty lines, chunk extensions and trailers; every split of the bytes into two
    /// reads gives the same lines.
    #[test]
    fn lines_across_chunks_and_reads() {
        let body: &[u8] =
            b"6\r\n{\"a\":1\r\n4;x=y\r\n}\n{\"\r\nA\r\nb\":2}\r\n\n{}\r\n1\r\n\n\r\n0\r\nT: 1\r\n\r\n";
        let want = vec![r#"{"a":1}"#.to_string(), r#"{"b":2}"#.into(), "{}".into()];
        let (got, end) = decode(&[body], 100);
        assert_eq!(got, want);
        assert_eq!(end, Ok(true));
        for cut in 0..body.len() {
            let (a, b) = body.split_at(cut);
            let (got, end) = decode(&[a, b], 100);
            assert_eq!((got, end), (want.clone(), Ok(true)), "cut at {cut}");
        }
        // Byte by byte.
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(decode(&bytes, 100), (want, Ok(true)));
        // Not ended yet: no error, not done.
        assert_eq!(
            decode(&[b"3\r\n{}\n\r\n"], 100),
            (vec!["{}".into()], Ok(false))
        );
    }

    /// Documents as an agent streams them (NDJSON in chunks of any
    /// size, LF or CRLF line ends, heartbeat blank lines, extensions, trailers).
    mod props {
        use super::*;
        use proptest::prelude::*;

        /// A document: no byte a chunk-size line could start with (hex digits, CR,
        /// LF), so that a misframed stream cannot resynchronise by chance.
        fn doc() -> impl Strategy<Value = String> {
            r#"[g-zG-Z{}":,\[\] ]{1,60}"#
        }

        /// `docs` as a chunked NDJSON body: blank lines before the documents flagged
        /// in `beats`, CRLF ends when `crlf`, chunks of the sizes in `sizes` (cycled),
        /// upper case hex when `upper`, an extension on every chunk when `ext`.
        fn body(
            docs: &[String],
            beats: &[bool],
            crlf: bool,
            sizes: &[usize],
            upper: bool,
            ext: bool,
        ) -> Vec<u8> {
            let end = if crlf { "\r\n" } else { "\n" };
            let mut text = String::new();
            for (i, d) in docs.iter().enumerate() {
                if beats.get(i).copied().unwrap_or(false) {
                    text.push_str(end);
                }
                text.push_str(d);
                text.push_str(end);
            }
            let text = text.into_bytes();
            let mut out = Vec::new();
            let (mut at, mut i) = (0, 0);
            while at < text.len() {
                let n = sizes[i % sizes.len()].min(text.len() - at);
                let size = if upper {
                    format!("{n:X}")
                } else {
                    format!("{n:x}")
                };
                out.extend(format!("{size}{}\r\n", if ext { ";e=1" } else { "" }).bytes());
                out.extend(&text[at..at + n]);
                out.extend(b"\r\n");
                at += n;
                i += 1;
            }
            out.extend(b"0\r\nX-Trailer: 1\r\n\r\n");
            out
        }

        /// `bytes` cut at `cuts` (modulo its length) into reads.
        fn reads(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
            at.extend([0, bytes.len()]);
            at.sort_unstable();
            at.dedup();
            at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect()
        }

        fn run(reads: &[Vec<u8>], limit: usize) -> (Vec<String>, Result<bool, StreamError>, u64) {
            let parts: Vec<&[u8]> = reads.iter().map(Vec::as_slice).collect();
            let mut l = Lines::default();
            let mut got = Vec::new();
            for p in &parts {
                if let Err(e) = l.feed(p, limit, &mut |line| {
                    got.push(String::from_utf8(line.to_vec()).unwrap())
                }) {
                    return (got, Err(e), l.ended());
                }
            }
            (got, Ok(l.done()), l.ended())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Any chunking, any cut into reads: the same documents, in order, the
            /// stream done, and every line counted (heartbeats too).
            #[test]
            fn any_split_gives_the_same_documents(
                docs in prop::collection::vec(doc(), 0..12),
                beats in prop::collection::vec(any::<bool>(), 12),
                crlf: bool,
                sizes in prop::collection::vec(1usize..50, 1..5),
                upper: bool,
                ext: bool,
                cuts in prop::collection::vec(any::<usize>(), 0..16),
            ) {
                let bytes = body(&docs, &beats, crlf, &sizes, upper, ext);
                let (got, end, ended) = run(&reads(&bytes, &cuts), 60);
                prop_assert_eq!(got, docs.clone());
                prop_assert_eq!(end, Ok(true));
                let blanks = beats.iter().take(docs.len()).filter(|b| **b).count();
                prop_assert_eq!(ended, (docs.len() + blanks) as u64);
            }

            /// A chunk size that says more or less than the chunk holds is never read
            /// as the stream that was sent, wherever the reads cut.
            #[test]
            fn a_wrong_chunk_size_is_refused(
                docs in prop::collection::vec(doc(), 1..8),
                sizes in prop::collection::vec(1usize..50, 1..5),
                which in any::<prop::sample::Index>(),
                delta in prop_oneof![-20i64..=-1, 1i64..=20],
                cuts in prop::collection::vec(any::<usize>(), 0..16),
            ) {
                let bytes = body(&docs, &[], false, &sizes, false, false);
                // Find the size lines (all but the last chunk's) and change one.
                let text = String::from_utf8(bytes.clone()).unwrap();
                let mut lines = Vec::new();
                let mut at = 0;
                while at < text.len() {
                    let nl = text[at..].find("\r\n").unwrap() + at;
                    let n = usize::from_str_radix(&text[at..nl], 16).unwrap();
                    if n == 0 {
                        break;
                    }
                    lines.push((at, nl, n));
                    at = nl + 2 + n + 2;
                }
                let (start, end, n) = lines[which.index(lines.len())];
                let wrong = n as i64 + delta;
                prop_assume!(wrong > 0);
                let broken = format!("{}{:x}{}", &text[..start], wrong, &text[end..]);
                let (lines, got, _) = run(&reads(broken.as_bytes(), &cuts), 60);
                // Mostly an error. Ok(false): the size ran past the end, and the
                // decoder waits for bytes that never come (the connection's end is the
                // error then: `Conn::next_lines`, "the stream closed before its end").
                // Ok(true): a size that lands exactly on a later chunk's end frames
                // other, valid content (the size lines it swallowed become lines); it
                // is never taken for the stream that was sent.
                match got {
                    Err(StreamError::Malformed(_)) | Ok(false) => {}
                    Ok(true) => prop_assert_ne!(lines, docs),
                    other => prop_assert!(false, "{:?}", other),
                }
            }

            /// A document over the limit is refused wherever the reads cut it; those
            /// before it are handed over.
            #[test]
            fn a_document_over_the_limit_is_refused(
                docs in prop::collection::vec(doc(), 1..8),
                limit in 1usize..40,
                sizes in prop::collection::vec(1usize..50, 1..5),
                cuts in prop::collection::vec(any::<usize>(), 0..16),
            ) {
                let first_long = docs.iter().position(|d| d.len() > limit);
                let bytes = body(&docs, &[], false, &sizes, false, false);
                let (got, end, _) = run(&reads(&bytes, &cuts), limit);
                match first_long {
                    Some(i) => {
                        prop_assert_eq!(&got[..], &docs[..i]);
                        prop_assert_eq!(end, Err(StreamError::TooLarge(limit)));
                    }
                    None => prop_assert_eq!((got, end), (docs, Ok(true))),
                }
            }
        }
    }

    #[test]
    fn broken_framing_and_long_lines_are_errors() {
        use StreamError::*;
        for (body, want) in [
            (&b"zz\r\n"[..], Malformed("bad chunk size")),
            (b"\r\n", Malformed("bad chunk size")),
            (b"3\rx", Malformed("chunk-size line not ended by CRLF")),
            (b"3\r\nabcX", Malformed("chunk not ended by CRLF")),
            (b"0\r\n\r\nmore", Malformed("bytes after the last chunk")),
            (b"fffffffffffffffff\r\n", Malformed("chunk size overflows")),
            (b"20\r\n0123456789abcdef0123456789abcdef", TooLarge(16)),
            (b"8\r\n01234567\r\na\r\n89abcdefgh\r\n", TooLarge(16)),
        ] {
            let (_, end) = decode(&[body], 16);
            assert_eq!(end, Err(want), "{:?}", String::from_utf8_lossy(body));
        }
        let long = [b"1".repeat(MAX_SIZE_LINE + 1)].concat();
        assert!(matches!(decode(&[&long], 16).1, Err(Malformed(_))));
        let mut trailers = b"0\r\n".to_vec();
        trailers.extend(b"X: y\r\n".repeat(MAX_TRAILERS));
        assert_eq!(
            decode(&[&trailers], 16).1,
            Err(Malformed("trailers too long"))
        );
        // A line of exactly the limit passes, with or without a CR.
        let (got, _) = decode(&[b"12\r\n0123456789abcdef\r\n\r\n"], 16);
        assert_eq!(got, vec!["0123456789abcdef".to_string()]);
    }
}
