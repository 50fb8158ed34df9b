//! The HTTP/1.1 client of one agent's long-poll: one kept-alive connection per agent,
//! owned by its follower, and no buffer kept between answers.
//!
//! A replica holds a connection to every agent it follows (5,000 or more). hyper's
//! pooled client kept about 25 KiB per connection while idle (a read buffer, the
//! connection task and its request channel; measured with heaptrack), more
//! than the whole budget of a followed node. This client keeps the socket alone; a
//! response is read into a buffer that lives as long as the answer does.
//!
//! What it speaks is RFC 9112 as far as an agent's `GET` needs: a `Content-Length`,
//! `chunked` or close-delimited body, keep-alive unless `Connection: close` (or
//! HTTP/1.0), 1xx answers skipped, and a request on a kept connection the server had
//! closed while idle is retried once on a new one (as hyper retries a pooled
//! connection's canceled request). Heads and bodies are bounded.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::net::TcpStream;

use super::stream::{Lines, StreamError};
use super::wire::{connect, read_body, read_head, read_response, Exchange, Framing, MAX_HEAD};
pub use super::wire::{HttpError, Response, NDJSON};

/// A watch stream's decoder, and what came with its head.
#[derive(Debug, Default)]
struct StreamState {
    lines: Lines,
    backlog: Vec<u8>,
}

/// Bytes read at once from a stream, into a buffer each worker thread owns (no
/// follower holds one).
const READ_AT_ONCE: usize = 64 << 10;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; READ_AT_ONCE]);
}
/// Where an agent is: `http://host:port` and the path prefix before `/v1/...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port`, what is connected to and sent as `Host`.
    pub authority: String,
    /// The path before the API's (`""` or `/n/7`), without a trailing slash.
    pub prefix: String,
}

impl Target {
    /// Parse a base URL (`http://10.0.0.7:8081`, `http://127.0.0.1:9000/n/7`).
    pub fn parse(base: &str) -> Result<Self, HttpError> {
        let bad = |why: &str| HttpError::Url(why.to_string());
        let rest = base
            .strip_prefix("http://")
            .ok_or_else(|| bad("only http:// is supported"))?;
        let (authority, prefix) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains(['@', '?', '#', ' ']) {
            return Err(bad("no host"));
        }
        if prefix.contains(['?', '#', ' ']) {
            return Err(bad("a query or fragment in the base"));
        }
        let authority = if authority.rsplit_once(':').is_some_and(|(h, p)| {
            !h.is_empty() && !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())
        }) || authority.ends_with(']')
        {
            authority.to_string()
        } else if authority.contains(':') && !authority.starts_with('[') {
            return Err(bad("bad port"));
        } else {
            format!("{authority}:80")
        };
        Ok(Target {
            authority,
            prefix: prefix.trim_end_matches('/').to_string(),
        })
    }
}

/// One agent's connection (absent until the first request, and after an error).
pub struct Conn {
    target: Target,
    stream: Option<TcpStream>,
    connect_timeout: Duration,
    /// The watch stream being read on the connection, if one is open.
    lines: Option<Box<StreamState>>,
    /// Sent as `Authorization: Bearer` on every GET: the delivery token, which the
    /// agent keeps connections for when its others are taken.
    bearer: Option<std::sync::Arc<str>>,
}

/// What a request for a stream got.
#[derive(Debug)]
pub enum Opened {
    /// A chunked `200` of [`NDJSON`]: read it with [`Conn::next_lines`].
    Stream,
    /// Any other answer, whole (an agent that does not stream answers with one
    /// document, or refuses the parameter).
    Whole(Response),
}

impl Conn {
    /// A connection to `target`, opened on first use.
    pub fn new(target: Target, connect_timeout: Duration) -> Self {
        Conn {
            target,
            stream: None,
            connect_timeout,
            lines: None,
            bearer: None,
        }
    }

    /// `GET prefix + path` expecting a stream. A stream's head is read and the
    /// connection left to [`Conn::next_lines`]; any other answer is read whole (at most
    /// `limit` body bytes). On any error the connection is dropped.
    pub async fn open_stream(&mut self, path: &str, limit: usize) -> Result<Opened, HttpError> {
        self.lines = None;
        let request = self.request(path);
        let reused = self.stream.is_some();
        match self.open(&request, limit).await {
            Err(Exchange::Stale) if reused => self.open(&request, limit).await.map_err(Into::into),
            r => r.map_err(Into::into),
        }
    }

    async fn open(&mut self, request: &str, limit: usize) -> Result<Opened, Exchange> {
        let mut stream = match self.stream.take() {
            Some(s) => s,
            None => connect(&self.target.authority, self.connect_timeout).await?,
        };
        if let Err(e) = stream.write_all(request.as_bytes()).await {
            return Err(Exchange::stale_or(e));
        }
        let cap = MAX_HEAD + limit + (limit >> 3) + 1024;
        let (head, rest) = read_head(&mut stream, cap).await?;
        if head.status == 200 && head.ndjson && matches!(head.framing, Framing::Chunked) {
            let mut lines = Box::<StreamState>::default();
            // What came with the head is decoded at the first read of lines.
            if !rest.is_empty() {
                lines.backlog = rest;
            }
            self.lines = Some(lines);
            self.stream = Some(stream);
            return Ok(Opened::Stream);
        }
        let (response, keep) = read_body(&mut stream, head, rest, limit, cap).await?;
        if keep {
            self.stream = Some(stream);
        }
        Ok(Opened::Whole(response))
    }

    /// One read of the open stream, each complete line handed to `each` (lines of at
    /// most `limit` bytes). `Ok(Some(n))`: the read completed `n` lines (0: bytes
    /// that completed none, such as the agent's heartbeat, a blank line); `Ok(None)`:
    /// the stream ended (the connection is kept for the next request). The bytes go
    /// into the worker thread's buffer and are decoded there, so nothing is held while
    /// the stream waits but a line a read cut in two. The caller bounds it in time; on
    /// any error the connection is dropped.
    pub async fn next_lines(
        &mut self,
        limit: usize,
        each: &mut (dyn FnMut(&[u8]) + Send),
    ) -> Result<Option<usize>, HttpError> {
        let r = self.read_lines(limit, each).await;
        if !matches!(r, Ok(Some(_))) {
            if r.is_err() {
                self.stream = None;
            }
            self.lines = None;
        }
        r
    }

    async fn read_lines(
        &mut self,
        limit: usize,
        each: &mut (dyn FnMut(&[u8]) + Send),
    ) -> Result<Option<usize>, HttpError> {
        let (Some(stream), Some(lines)) = (self.stream.as_mut(), self.lines.as_mut()) else {
            return Err(HttpError::Io("no stream open".into()));
        };
        let malformed = |e: StreamError| match e {
            StreamError::TooLarge(n) => HttpError::TooLarge(n),
            e => HttpError::Malformed(e.to_string()),
        };
        let got = if lines.backlog.is_empty() {
            if lines.lines.done() {
                return Ok(None);
            }
            std::future::poll_fn(|cx| {
                SCRATCH.with_borrow_mut(|buf| {
                    let mut rb = tokio::io::ReadBuf::new(buf);
                    match std::pin::Pin::new(&mut *stream).poll_read(cx, &mut rb) {
                        std::task::Poll::Pending => std::task::Poll::Pending,
                        std::task::Poll::Ready(Err(e)) => {
                            std::task::Poll::Ready(Err(HttpError::Io(e.to_string())))
                        }
                        std::task::Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                            std::task::Poll::Ready(Err(HttpError::Io(
                                "the stream closed before its end".into(),
                            )))
                        }
                        std::task::Poll::Ready(Ok(())) => std::task::Poll::Ready(
                            lines
                                .lines
                                .feed(rb.filled(), limit, each)
                                .map_err(malformed),
                        ),
                    }
                })
            })
            .await?
        } else {
            // What came with the head.
            let backlog = std::mem::take(&mut lines.backlog);
            lines.lines.feed(&backlog, limit, each).map_err(malformed)?
        };
        // At the end, the lines of the last read are delivered first; the end is seen
        // at the next call.
        Ok(Some(got))
    }

    /// Lines ended on the open stream so far, blank heartbeats included (0: none open).
    pub fn lines_ended(&self) -> u64 {
        self.lines.as_ref().map_or(0, |l| l.lines.ended())
    }

    /// The agent.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// `GET prefix + path`, reading at most `limit` body bytes. The caller bounds the
    /// whole exchange in time; on any error the connection is dropped.
    pub async fn get(&mut self, path: &str, limit: usize) -> Result<Response, HttpError> {
        self.lines = None;
        let request = self.request(path);
        let reused = self.stream.is_some();
        match self.exchange(request.as_bytes(), limit).await {
            // The server closed the kept connection while it was idle: once more on a new
            // one (nothing of the answer was read, so the request was not acted on).
            Err(Exchange::Stale) if reused => {
                match self.exchange(request.as_bytes(), limit).await {
                    Ok(r) => Ok(r),
                    Err(e) => Err(e.into()),
                }
            }
            r => r.map_err(Into::into),
        }
    }

    /// The same connection, sending `bearer` with every GET.
    pub fn with_bearer(mut self, bearer: Option<std::sync::Arc<str>>) -> Self {
        self.bearer = bearer;
        self
    }

    fn request(&self, path: &str) -> String {
        let auth = self
            .bearer
            .as_deref()
            .map_or(String::new(), |b| format!("Authorization: Bearer {b}\r\n"));
        format!(
            "GET {}{path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json, {NDJSON}\r\n{auth}User-Agent: faultline-aggregator\r\n\r\n",
            self.target.prefix, self.target.authority
        )
    }

    /// `PUT prefix + path` with a JSON `body` and a bearer token, reading at most `limit`
    /// body bytes of the answer. Sent again once on a kept connection the server had
    /// closed while idle (nothing of the answer was read; a PUT may be repeated).
    pub async fn put_json(
        &mut self,
        path: &str,
        bearer: &str,
        header: Option<(&str, &str)>,
        body: &[u8],
        limit: usize,
    ) -> Result<Response, HttpError> {
        self.lines = None;
        let extra = header.map_or_else(String::new, |(k, v)| format!("{k}: {v}\r\n"));
        let mut request = format!(
            "PUT {}{path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {bearer}\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\nUser-Agent: faultline-aggregator\r\n\r\n",
            self.target.prefix,
            self.target.authority,
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(body);
        let reused = self.stream.is_some();
        match self.exchange(&request, limit).await {
            Err(Exchange::Stale) if reused => match self.exchange(&request, limit).await {
                Ok(r) => Ok(r),
                Err(e) => Err(e.into()),
            },
            r => r.map_err(Into::into),
        }
    }

    async fn exchange(&mut self, request: &[u8], limit: usize) -> Result<Response, Exchange> {
        let mut stream = match self.stream.take() {
            Some(s) => s,
            None => connect(&self.target.authority, self.connect_timeout).await?,
        };
        if let Err(e) = stream.write_all(request).await {
            return Err(Exchange::stale_or(e));
        }
        let (response, keep) = read_response(&mut stream, limit).await?;
        if keep {
            self.stream = Some(stream);
        }
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    #[test]
    fn targets_parse() {
        let t = Target::parse("http://10.0.0.7:8081").unwrap();
        assert_eq!(
            (t.authority.as_str(), t.prefix.as_str()),
            ("10.0.0.7:8081", "")
        );
        let t = Target::parse("http://127.0.0.1:9/n/7/").unwrap();
        assert_eq!(
            (t.authority.as_str(), t.prefix.as_str()),
            ("127.0.0.1:9", "/n/7")
        );
        assert_eq!(
            Target::parse("http://node-a").unwrap().authority,
            "node-a:80"
        );
        assert_eq!(
            Target::parse("http://[::1]:81").unwrap().authority,
            "[::1]:81"
        );
        for bad in [
            "https://a:1",
            "a:1",
            "http://",
            "http://a:x",
            "http://a:1/p?q=1",
            "http://u@a:1",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    /// A server that answers each connection's requests with `answers`, in turn, then
    /// closes; the requests it read come back.
    async fn server(
        answers: Vec<Vec<&'static [u8]>>,
    ) -> (Target, tokio::task::JoinHandle<Vec<String>>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = Target::parse(&format!("http://{}/p", l.local_addr().unwrap())).unwrap();
        let h = tokio::spawn(async move {
            let mut seen = Vec::new();
            for conn in answers {
                let (mut s, _) = l.accept().await.unwrap();
                for answer in conn {
                    let mut req = Vec::new();
                    while !req.ends_with(b"\r\n\r\n") {
                        let mut b = [0u8; 1];
                        if s.read(&mut b).await.unwrap() == 0 {
                            break;
                        }
                        req.push(b[0]);
                    }
                    seen.push(String::from_utf8(req).unwrap());
                    s.write_all(answer).await.unwrap();
                }
            }
            seen
        });
        (target, h)
    }

    #[tokio::test]
    async fn lengths_chunks_keep_alive_and_a_stale_connection_retried() {
        let (target, h) = server(vec![
            vec![
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nT: 1\r\n\r\n",
            ],
            // The kept connection was closed: the third request goes on a new one.
            vec![b"HTTP/1.1 503 No\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno"],
            vec![b"HTTP/1.0 200 OK\r\n\r\nuntil close"],
        ])
        .await;
        let mut c = Conn::new(target, Duration::from_secs(1));
        let r = c.get("/v1/health", 100).await.unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"hello"[..]));
        let r = c.get("/v1/health?wait_generation=3", 100).await.unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"abcde"[..]));
        let r = c.get("/v1/health", 100).await.unwrap();
        assert_eq!((r.status, r.body.as_slice()), (503, &b"no"[..]));
        assert!(c.stream.is_none(), "Connection: close is honoured");
        let r = c.get("/v1/health", 100).await.unwrap();
        assert_eq!(r.body, b"until close");
        let seen = h.await.unwrap();
        assert_eq!(seen.len(), 4);
        assert!(seen[0].starts_with("GET /p/v1/health HTTP/1.1\r\nHost: 127.0.0.1:"));
        assert!(seen[1].starts_with("GET /p/v1/health?wait_generation=3 HTTP/1.1\r\n"));
    }

    /// With the delivery token, every GET carries it (the agent
    /// keeps connections for it); without, none does.
    #[tokio::test]
    async fn a_get_carries_the_bearer_it_is_given() {
        let ok: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
        let (target, h) = server(vec![vec![ok, ok]]).await;
        let mut c = Conn::new(target, Duration::from_secs(1)).with_bearer(Some("t0k".into()));
        c.get("/v1/health", 100).await.unwrap();
        c.bearer = None;
        c.get("/v1/health", 100).await.unwrap();
        let seen = h.await.unwrap();
        assert!(
            seen[0].contains("\r\nAuthorization: Bearer t0k\r\n"),
            "{}",
            seen[0]
        );
        assert!(!seen[1].contains("Authorization"), "{}", seen[1]);
    }

    #[tokio::test]
    async fn oversized_and_malformed_answers_are_errors() {
        let (target, _h) = server(vec![
            vec![b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n"],
            vec![b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n200\r\n"],
            vec![b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"],
            vec![b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"],
            vec![b"garbage\r\n\r\n"],
            vec![b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort"],
        ])
        .await;
        let mut c = Conn::new(target, Duration::from_secs(1));
        // Content-Length over the limit, a chunk over it, gzip, both TE and CL, garbage,
        // a body cut short.
        for too_large in [true, true, false, false, false, false] {
            match c.get("/", 100).await {
                Err(HttpError::TooLarge(100)) if too_large => {}
                Err(HttpError::Malformed(_)) if !too_large => {}
                other => panic!("expected {too_large}: {other:?}"),
            }
        }
        assert!(c.stream.is_none());
    }

    /// A stream's head and first lines in one read (decoded from what came
    /// with the head), then the end; the connection is kept, and the next request on it
    /// is answered whole. An answer that is not a stream comes back whole.
    #[tokio::test]
    async fn a_stream_is_read_line_by_line_and_its_connection_kept() {
        let (target, h) = server(vec![vec![
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{a}\n\r\n1\r\n\n\r\n8\r\n{b}\n{c}\n\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        ]])
        .await;
        let mut c = Conn::new(target, Duration::from_secs(1));
        assert!(matches!(c.open_stream("/w", 100).await, Ok(Opened::Stream)));
        let mut lines = Vec::new();
        let mut reads = Vec::new();
        loop {
            let r = c
                .next_lines(100, &mut |l| {
                    lines.push(String::from_utf8_lossy(l).into_owned())
                })
                .await
                .unwrap();
            reads.push(r);
            if r.is_none() {
                break;
            }
        }
        assert_eq!(lines, ["{a}", "{b}", "{c}"]);
        assert_eq!(reads.last(), Some(&None));
        assert!(c.stream.is_some(), "kept after the stream's end");
        match c.open_stream("/w", 100).await {
            Ok(Opened::Whole(r)) => assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..])),
            other => panic!("{other:?}"),
        }
        let seen = h.await.unwrap();
        assert_eq!(seen.len(), 2, "both on one connection");
        assert!(seen[0].contains("Accept: application/json, application/x-ndjson\r\n"));
    }
}
