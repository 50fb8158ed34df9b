//! What the test API server's client tests share: a `kube` client of it (the server
//! itself starts with [`faultline_test_apiserver::spawn`]), and a bare HTTP/1.1 client
//! that sees the bytes on the wire.

#![allow(dead_code)]

use kube::Client;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A kube client of `url`, without kube's own retries: the tests look at each answer
/// (kube retries a 429 by itself up to 15 times).
pub fn client(url: &str) -> Client {
    let mut cfg = kube::Config::new(url.parse().unwrap());
    cfg.default_retry = false;
    Client::try_from(cfg).unwrap()
}

/// One answer as it came over the wire: the status and the body's bytes (a chunked
/// body, as a watch sends, joined from its chunks).
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// The body's lines (a watch's events), each without its newline.
    pub fn lines(&self) -> Vec<&[u8]> {
        self.body
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .collect()
    }
}

/// `METHOD path` against the server at `url` (`http://ADDR`), with a JSON body of
/// `content_type` when given; reads the answer to its end (the connection closes).
pub async fn http(url: &str, method: &str, path: &str, body: Option<(&str, &str)>) -> Answer {
    let addr = url.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some((ct, b)) = body {
        req.push_str(&format!(
            "Content-Type: {ct}\r\nContent-Length: {}\r\n",
            b.len()
        ));
        req.push_str("\r\n");
        req.push_str(b);
    } else {
        req.push_str("\r\n");
    }
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let status = head[9..12].parse().unwrap();
    let rest = &raw[split + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        let mut out = Vec::new();
        let mut at = 0;
        loop {
            let eol = at + rest[at..].windows(2).position(|w| w == b"\r\n").unwrap();
            let size =
                usize::from_str_radix(std::str::from_utf8(&rest[at..eol]).unwrap().trim(), 16)
                    .unwrap();
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            at = eol + 2 + size + 2;
        }
        out
    } else {
        rest.to_vec()
    };
    Answer { status, body }
}
