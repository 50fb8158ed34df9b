//! HTTP/1.1 answers as the agents' client reads them: the head parsed within a bound,
//! bodies by length, chunked or to the close, each within a limit; a connection the
//! agent closed before any answer told apart (`Exchange::Stale`) so the request is
//! sent again on a new one.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;

/// Largest response head accepted.
pub(super) const MAX_HEAD: usize = 64 << 10;
/// The media type of an agent's watch stream: one JSON document per line.
pub const NDJSON: &str = "application/x-ndjson";
/// Headers parsed at most.
pub(super) const MAX_HEADERS: usize = 64;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The URL is not `http://host[:port][/prefix]`.
    #[error("{0}")]
    Url(String),
    /// Connecting or the exchange failed.
    #[error("{0}")]
    Io(String),
    /// The answer is not HTTP/1.x as this client reads it.
    #[error("malformed response: {0}")]
    Malformed(String),
    /// The body is larger than the limit.
    #[error("body over {0} bytes")]
    TooLarge(usize),
}

/// An answer.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

/// An exchange's failure: `Stale` when the connection was closed before any answer.
pub(super) enum Exchange {
    Stale,
    Failed(HttpError),
}

impl Exchange {
    /// Past the first byte of an answer, a closed connection is a failure.
    pub(super) fn mid(self) -> Self {
        match self {
            Exchange::Stale => {
                Exchange::Failed(HttpError::Io("connection closed mid-answer".into()))
            }
            e => e,
        }
    }

    pub(super) fn stale_or(e: std::io::Error) -> Self {
        use std::io::ErrorKind::*;
        match e.kind() {
            BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof => Exchange::Stale,
            _ => Exchange::Failed(HttpError::Io(e.to_string())),
        }
    }
}

impl From<HttpError> for Exchange {
    fn from(e: HttpError) -> Self {
        Exchange::Failed(e)
    }
}

impl From<Exchange> for HttpError {
    fn from(e: Exchange) -> Self {
        match e {
            Exchange::Stale => HttpError::Io("connection closed before an answer".into()),
            Exchange::Failed(e) => e,
        }
    }
}

pub(super) async fn connect(authority: &str, within: Duration) -> Result<TcpStream, HttpError> {
    let stream = tokio::time::timeout(within, TcpStream::connect(authority))
        .await
        .map_err(|_| HttpError::Io(format!("connect timed out after {within:?}")))?
        .map_err(|e| HttpError::Io(format!("connect {authority}: {e}")))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// What an answer is read from: the agent's socket (in the tests, bytes in reads cut
/// wherever a property says).
pub(super) trait Wire: AsyncRead + Unpin + Send {
    /// Ready when a read would not wait: nothing is allocated before.
    fn ready(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send;
}

impl Wire for TcpStream {
    fn ready(&self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        self.readable()
    }
}

/// Read more into `buf`, at most `cap` bytes in all. Bytes read (0: end of stream).
pub(super) async fn fill(
    stream: &mut impl Wire,
    buf: &mut Vec<u8>,
    cap: usize,
) -> Result<usize, Exchange> {
    if buf.len() >= cap {
        return Err(HttpError::TooLarge(cap).into());
    }
    buf.reserve((cap - buf.len()).min(4 << 10));
    let room = buf.capacity().min(cap) - buf.len();
    let mut limited = (&mut *stream).take(room as u64);
    limited.read_buf(buf).await.map_err(Exchange::stale_or)
}

/// How a body ends.
pub(super) enum Framing {
    Length(usize),
    Chunked,
    Close,
}

/// A response head, parsed.
pub(super) struct Head {
    pub(super) len: usize,
    pub(super) status: u16,
    pub(super) keep: bool,
    pub(super) framing: Framing,
    /// `Content-Type: application/x-ndjson`: a stream of documents.
    pub(super) ndjson: bool,
}

/// Parse the head at the start of `buf`: `None` while it is incomplete. Synchronous,
/// so that the header array never lives across an await (a follower's future is held
/// for every agent, all the time).
pub(super) fn parse_head(buf: &[u8]) -> Result<Option<Head>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut head = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(len) = head
        .parse(buf)
        .map_err(|e| HttpError::Malformed(e.to_string()))?
    else {
        return Ok(None);
    };
    let status = head.code.unwrap_or(0);
    let mut keep = head.version == Some(1);
    let (mut length, mut chunked, mut ndjson) = (None, false, false);
    for h in head.headers.iter() {
        let value = std::str::from_utf8(h.value).unwrap_or("").trim();
        if h.name.eq_ignore_ascii_case("content-type") {
            ndjson = value
                .split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case(NDJSON));
        } else if h.name.eq_ignore_ascii_case("connection") {
            if value
                .split(',')
                .any(|v| v.trim().eq_ignore_ascii_case("close"))
            {
                keep = false;
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if !value.eq_ignore_ascii_case("chunked") || chunked {
                return Err(HttpError::Malformed(format!("transfer-encoding {value:?}")));
            }
            chunked = true;
        } else if h.name.eq_ignore_ascii_case("content-length") {
            // 1*DIGIT (RFC 9110 §8.6): no sign, no list (`parse` would take "+5").
            let n: usize = Some(value)
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| HttpError::Malformed(format!("content-length {value:?}")))?;
            if length.is_some_and(|m| m != n) {
                return Err(HttpError::Malformed("two content-lengths".into()));
            }
            length = Some(n);
        }
    }
    let framing = match (chunked, length) {
        // Both: a smuggling pattern (RFC 9112 6.3 lets TE win; stricter, refused).
        (true, Some(_)) => {
            return Err(HttpError::Malformed(
                "both transfer-encoding and content-length".into(),
            ))
        }
        // No body on these whatever the headers say.
        _ if status == 204 || status == 304 || (100..200).contains(&status) => Framing::Length(0),
        (true, None) => Framing::Chunked,
        (false, Some(n)) => Framing::Length(n),
        (false, None) => Framing::Close,
    };
    Ok(Some(Head {
        len,
        status,
        keep,
        framing,
        ndjson,
    }))
}

/// Read a response's head (interim answers skipped): the head, and the bytes read
/// past it.
pub(super) async fn read_head(
    stream: &mut impl Wire,
    cap: usize,
) -> Result<(Head, Vec<u8>), Exchange> {
    // Nothing is allocated until the answer starts to arrive: a long-poll waits here.
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let Some(head) = parse_head(&buf)? else {
            if buf.len() > MAX_HEAD {
                return Err(HttpError::Malformed(format!("head over {MAX_HEAD} bytes")).into());
            }
            let first = buf.is_empty();
            if first {
                stream.ready().await.map_err(Exchange::stale_or)?;
            }
            let n = fill(stream, &mut buf, cap)
                .await
                .map_err(|e| if first { e } else { e.mid() })?;
            if n == 0 {
                return Err(if first {
                    Exchange::Stale
                } else {
                    HttpError::Malformed("connection closed in the head".into()).into()
                });
            }
            continue;
        };
        // A whole head over the bound, read at once, is refused as one that came in
        // pieces is.
        if head.len > MAX_HEAD {
            return Err(HttpError::Malformed(format!("head over {MAX_HEAD} bytes")).into());
        }
        buf.drain(..head.len);
        if (100..200).contains(&head.status) {
            // An interim answer: the real one follows.
            continue;
        }
        return Ok((head, buf));
    }
}

/// Read one response: the answer and whether the connection may be kept.
pub(super) async fn read_response(
    stream: &mut impl Wire,
    limit: usize,
) -> Result<(Response, bool), Exchange> {
    let cap = MAX_HEAD + limit + (limit >> 3) + 1024;
    let (head, buf) = read_head(stream, cap).await?;
    read_body(stream, head, buf, limit, cap).await
}

/// Read the body after `head`, whose first bytes are in `buf`.
pub(super) async fn read_body(
    stream: &mut impl Wire,
    head: Head,
    mut buf: Vec<u8>,
    limit: usize,
    cap: usize,
) -> Result<(Response, bool), Exchange> {
    let Head {
        status,
        mut keep,
        framing,
        ..
    } = head;
    let body = match framing {
        Framing::Length(n) => {
            if n > limit {
                return Err(HttpError::TooLarge(limit).into());
            }
            // One read for the whole body when it is all there.
            buf.reserve(n.saturating_sub(buf.len()));
            while buf.len() < n {
                if fill(stream, &mut buf, n).await.map_err(Exchange::mid)? == 0 {
                    return Err(HttpError::Malformed("connection closed in the body".into()).into());
                }
            }
            // Bytes past the body: the connection is out of step; not kept.
            keep &= buf.len() == n;
            buf.truncate(n);
            buf
        }
        Framing::Chunked => dechunk(stream, buf, limit, cap)
            .await
            .map_err(Exchange::mid)?,
        Framing::Close => {
            keep = false;
            // Read up to one byte past the limit: that byte says the body is over it.
            while fill(stream, &mut buf, limit + 1)
                .await
                .map_err(|e| match e {
                    Exchange::Failed(HttpError::TooLarge(_)) => HttpError::TooLarge(limit).into(),
                    e => e.mid(),
                })?
                > 0
            {}
            buf
        }
    };
    if body.len() > limit {
        return Err(HttpError::TooLarge(limit).into());
    }
    Ok((Response { status, body }, keep))
}

/// Decode a chunked body whose first bytes are in `raw`.
pub(super) async fn dechunk(
    stream: &mut impl Wire,
    mut raw: Vec<u8>,
    limit: usize,
    cap: usize,
) -> Result<Vec<u8>, Exchange> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        match httparse::parse_chunk_size(&raw[at..]) {
            Ok(httparse::Status::Complete((used, 0))) => {
                // The last chunk; then trailers (ignored) up to an empty line.
                at += used;
                loop {
                    if let Some(i) = raw[at..].windows(2).position(|w| w == b"\r\n") {
                        at += i + 2;
                        if i == 0 {
                            if at != raw.len() {
                                return Err(HttpError::Malformed(
                                    "bytes after the last chunk".into(),
                                )
                                .into());
                            }
                            return Ok(body);
                        }
                        continue;
                    }
                    if fill(stream, &mut raw, cap).await? == 0 {
                        return Err(HttpError::Malformed("closed in the trailers".into()).into());
                    }
                }
            }
            Ok(httparse::Status::Complete((used, size))) => {
                let size = usize::try_from(size).unwrap_or(usize::MAX);
                if body.len().saturating_add(size) > limit {
                    return Err(HttpError::TooLarge(limit).into());
                }
                let end = at + used + size;
                while raw.len() < end + 2 {
                    if fill(stream, &mut raw, cap).await? == 0 {
                        return Err(HttpError::Malformed("closed in a chunk".into()).into());
                    }
                }
                if &raw[end..end + 2] != b"\r\n" {
                    return Err(HttpError::Malformed("chunk not ended by CRLF".into()).into());
                }
                body.extend_from_slice(&raw[at + used..end]);
                at = end + 2;
            }
            Ok(httparse::Status::Partial) => {
                if fill(stream, &mut raw, cap).await? == 0 {
                    return Err(HttpError::Malformed("closed in a chunk size".into()).into());
                }
            }
            Err(_) => return Err(HttpError::Malformed("bad chunk size".into()).into()),
        }
    }
}

#[cfg(test)]
mod props;
