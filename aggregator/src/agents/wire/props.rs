//! What the agent client reads, under any cut of the bytes into
//! reads. An answer (length, chunked or close-delimited, after interim answers) gives
//! the same status, body and keep-alive whatever the reads; a bad length, a smuggling
//! pair and an oversized head are refused whatever the reads.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use proptest::prelude::*;
use tokio::io::ReadBuf;

use super::*;

/// Bytes handed over in the reads given, then the end of the stream.
struct Reads(VecDeque<Vec<u8>>);

impl Reads {
    /// `bytes` cut at `cuts` (each taken modulo the length, in order).
    fn cut(bytes: &[u8], cuts: &[usize]) -> Self {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        at.extend([0, bytes.len()]);
        at.sort_unstable();
        at.dedup();
        Reads(at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect())
    }
}

impl AsyncRead for Reads {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(mut piece) = self.0.pop_front() {
            let n = piece.len().min(buf.remaining());
            buf.put_slice(&piece[..n]);
            if n < piece.len() {
                self.0.push_front(piece.split_off(n));
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Wire for Reads {
    fn ready(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        std::future::ready(Ok(()))
    }
}

fn read(bytes: &[u8], cuts: &[usize], limit: usize) -> Result<(Response, bool), HttpError> {
    let mut reads = Reads::cut(bytes, cuts);
    futures_util::FutureExt::now_or_never(read_response(&mut reads, limit))
        .expect("reads never wait")
        .map_err(HttpError::from)
}

#[derive(Debug, Clone)]
enum Framing {
    Length,
    /// Chunk sizes (cycled), in upper or lower case hex, with an extension or not.
    Chunked(Vec<usize>, bool, bool),
    Close,
}

fn framing() -> impl Strategy<Value = Framing> {
    prop_oneof![
        Just(Framing::Length),
        (
            prop::collection::vec(1usize..40, 1..6),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(s, upper, ext)| Framing::Chunked(s, upper, ext)),
        Just(Framing::Close),
    ]
}

/// An answer with `body` framed as `how`, after `interim` 100s, header names in
/// `upper` case or not: its bytes, and whether the connection may be kept.
fn answer(status: u16, body: &[u8], how: &Framing, interim: usize, upper: bool) -> (Vec<u8>, bool) {
    let name = |n: &str| {
        if upper {
            n.to_ascii_uppercase()
        } else {
            n.to_string()
        }
    };
    let mut out = b"HTTP/1.1 100 Continue\r\n\r\n".repeat(interim);
    out.extend(
        format!(
            "HTTP/1.1 {status} X\r\n{}: text/plain\r\n",
            name("Content-Type")
        )
        .bytes(),
    );
    let keep = match how {
        Framing::Length => {
            out.extend(format!("{}: {}\r\n\r\n", name("Content-Length"), body.len()).bytes());
            out.extend(body);
            true
        }
        Framing::Chunked(sizes, hex_upper, ext) => {
            out.extend(format!("{}: chunked\r\n\r\n", name("Transfer-Encoding")).bytes());
            let (mut at, mut i) = (0, 0);
            while at < body.len() {
                let n = sizes[i % sizes.len()].min(body.len() - at);
                let size = if *hex_upper {
                    format!("{n:X}")
                } else {
                    format!("{n:x}")
                };
                let ext = if *ext { ";name=value" } else { "" };
                out.extend(format!("{size}{ext}\r\n").bytes());
                out.extend(&body[at..at + n]);
                out.extend(b"\r\n");
                at += n;
                i += 1;
            }
            out.extend(b"0\r\nTrailer: t\r\n\r\n");
            true
        }
        Framing::Close => {
            out.extend(b"\r\n");
            out.extend(body);
            false
        }
    };
    (out, keep)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any answer, any cut into reads: the same status, body and keep-alive.
    #[test]
    fn any_cut_into_reads_gives_the_same_answer(
        status in prop::sample::select(vec![200u16, 404, 409, 503]),
        body in prop::collection::vec(any::<u8>(), 0..300),
        how in framing(),
        interim in 0usize..3,
        upper: bool,
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let (bytes, keep) = answer(status, &body, &how, interim, upper);
        let (r, kept) = read(&bytes, &cuts, 1000).unwrap();
        prop_assert_eq!((r.status, r.body, kept), (status, body, keep));
    }

    /// A body over the limit is refused, however framed and cut.
    #[test]
    fn a_body_over_the_limit_is_refused(
        body in prop::collection::vec(any::<u8>(), 1..300),
        how in framing(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let (bytes, _) = answer(200, &body, &how, 0, false);
        let limit = body.len() - 1;
        prop_assert!(matches!(read(&bytes, &cuts, limit), Err(HttpError::TooLarge(l)) if l == limit));
    }

    /// A chunk whose size line says more than comes, or a length the body falls short
    /// of: refused, never a shorter body taken for the whole.
    #[test]
    fn a_length_the_bytes_do_not_fill_is_refused(
        body in prop::collection::vec(any::<u8>(), 1..300),
        more in 1usize..50,
        chunked: bool,
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut bytes = if chunked {
            format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n", body.len() + more).into_bytes()
        } else {
            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len() + more).into_bytes()
        };
        bytes.extend(&body);
        prop_assert!(matches!(read(&bytes, &cuts, 1000), Err(HttpError::Malformed(_))));
    }

    /// A Content-Length that is not 1*DIGIT (RFC 9110 §8.6), two that differ, or one
    /// beside chunked: refused, whatever the reads.
    #[test]
    fn a_bad_or_smuggled_length_is_refused(
        value in prop_oneof![
            "[+-][0-9]{1,3}",
            "[0-9]{1,3}[ ,;][0-9]{1,3}",
            "0x[0-9]{1,2}",
            "[a-z]{1,4}",
            Just(String::new()),
        ],
        case in 0u8..3,
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let headers = match case {
            0 => format!("Content-Length: {value}\r\n"),
            1 => "Content-Length: 3\r\nContent-Length: 4\r\n".to_string(),
            _ => "Transfer-Encoding: chunked\r\nContent-Length: 3\r\n".to_string(),
        };
        let bytes = format!("HTTP/1.1 200 OK\r\n{headers}\r\nabcd").into_bytes();
        let got = read(&bytes, &cuts, 1000);
        prop_assert!(matches!(got, Err(HttpError::Malformed(_))), "{:?}: {:?}", headers, got);
    }

    /// A head over 64 KiB is refused, however it arrives (and the body never read).
    #[test]
    fn an_oversized_head_is_refused(
        extra in 0usize..4096,
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let bytes = format!(
            "HTTP/1.1 200 OK\r\nX-Long: {}\r\nContent-Length: 2\r\n\r\nok",
            "a".repeat(MAX_HEAD + extra)
        )
        .into_bytes();
        let got = read(&bytes, &cuts, 1000);
        prop_assert!(matches!(&got, Err(HttpError::Malformed(m)) if m.contains("head over")), "{:?}", got.map(|r| r.0.status));
    }
}
