//! Hostile agents for the tests: servers that answer as an agent would,
//! with documents a real agent never sends.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use faultline_common::testing::{self, Device};

/// An agent serving `node` that answers every request at once with 512 devices under
/// ids it never used before (a plain JSON answer: the follower long-polls it, a
/// document a second).
pub async fn churning_agent(node: &'static str) -> SocketAddr {
    let round = Arc::new(AtomicU64::new(0));
    let app = Router::new().route(
        "/v1/health",
        get(move || {
            let r = round.fetch_add(1, Ordering::Relaxed);
            async move {
                let doc = testing::node(node)
                    .generation(r + 1)
                    .npus((0..512).map(|i| {
                        let d = Device::nvml(i)
                            .reading(|d| d.id = format!("x{r}-{i}"))
                            .temperature(40.0);
                        // Every eighth failed: a refused document acts on nothing (with
                        // only healthy devices, "not tainted" could not fail).
                        if i % 8 == 0 { d.failed("xid-79") } else { d }.build()
                    }))
                    .build();
                axum::Json(doc)
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}
