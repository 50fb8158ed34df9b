//! What the test API server's client tests share: a server on loopback, and a `kube`
//! client of it.

use faultline_test_apiserver::ApiServer;
use kube::Client;

/// A server on loopback; its URL; cancel to stop it.
pub async fn start() -> (ApiServer, String, tokio_util::sync::CancellationToken) {
    let server = ApiServer::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let cancel = tokio_util::sync::CancellationToken::new();
    tokio::spawn(faultline_test_apiserver::serve(
        listener,
        server.clone(),
        cancel.clone(),
    ));
    (server, url, cancel)
}

/// A kube client of `url`, without kube's own retries: the tests look at each answer
/// (kube retries a 429 by itself up to 15 times).
pub fn client(url: &str) -> Client {
    let mut cfg = kube::Config::new(url.parse().unwrap());
    cfg.default_retry = false;
    Client::try_from(cfg).unwrap()
}
