//! Helpers shared by the aggregator's integration tests: simulated agents in-process,
//! HTTP calls on loopback, waiting with a deadline.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// The Kubernetes API test server on loopback, with the namespace `faultline`; its URL.
pub async fn api_server() -> (faultline_test_apiserver::ApiServer, String) {
    let server = faultline_test_apiserver::ApiServer::new();
    server
        .create(
            "namespaces",
            "",
            serde_json::json!({"metadata": {"name": "faultline"}}),
        )
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(faultline_test_apiserver::serve(
        listener,
        server.clone(),
        tokio_util::sync::CancellationToken::new(),
    ));
    (server, url)
}

/// A simulated agent with 4 GPUs sampling every 100 ms, serving `node`.
pub async fn agent(node: &str) -> faultline_agent::Agent {
    let cfg = faultline_agent::config::Config::parse_from([
        "faultline-agent",
        "--source",
        "sim",
        "--sim-devices",
        "4",
        "--interval",
        "100ms",
        "--listen",
        "127.0.0.1:0",
        "--node-name",
        node,
    ])
    .unwrap();
    faultline_agent::start(cfg).await.unwrap()
}

/// POST a JSON body; the status.
pub async fn post(addr: SocketAddr, path: &str, body: &str) -> u16 {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = hyper::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    client.request(req).await.unwrap().status().as_u16()
}

/// GET a text body.
pub async fn get_text(url: &str) -> String {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = client.get(url.parse().unwrap()).await.unwrap();
    String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

/// Poll `f` until it gives a value or `within` passes; the value and the time it took.
pub async fn until<T>(
    within: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> (T, Duration) {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return (v, start.elapsed());
        }
        assert!(
            start.elapsed() < within,
            "timed out after {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
