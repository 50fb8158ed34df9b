//! What the test API server's client tests share: a `kube` client of it (the server
//! itself starts with [`faultline_test_apiserver::spawn`]).

use kube::Client;

/// A kube client of `url`, without kube's own retries: the tests look at each answer
/// (kube retries a 429 by itself up to 15 times).
pub fn client(url: &str) -> Client {
    let mut cfg = kube::Config::new(url.parse().unwrap());
    cfg.default_retry = false;
    Client::try_from(cfg).unwrap()
}
