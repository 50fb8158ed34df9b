//! `faultline-test-apiserver`: the in-memory Kubernetes API server as a process, for the
//! demo and for a developer's `kubectl --server http://127.0.0.1:PORT`.

use clap::Parser;
use faultline_test_apiserver::Bootstrap;

/// An in-memory Kubernetes API server for tests and demos (not for production).
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "FAULTLINE_LISTEN", default_value = "127.0.0.1:6443")]
    listen: std::net::SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let running = Bootstrap::new().listen(args.listen).start().await?;
    eprintln!(
        "faultline test API server on {} (kubectl --server {} get nodes)",
        running.url, running.url
    );
    let c = running.cancel_token();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        c.cancel();
    });
    running.wait().await
}
