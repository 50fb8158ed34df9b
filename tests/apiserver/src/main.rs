//! `faultline-test-apiserver`: the in-memory Kubernetes API server as a process, for the
//! demo and for a developer's `kubectl --server http://127.0.0.1:PORT`.

use clap::Parser;
use faultline_test_apiserver::{Bootstrap, Release};

/// An in-memory Kubernetes API server for tests and demos (not for production).
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "FAULTLINE_LISTEN", default_value = "127.0.0.1:6443")]
    listen: std::net::SocketAddr,
    /// The Kubernetes release played (`1.34` to `1.37` matter): `/version`, and which
    /// `resource.k8s.io` versions are served.
    #[arg(long, default_value = "1.34", value_parser = Release::parse)]
    kubernetes_version: Release,
    /// Feature gates as kube-apiserver takes them; only `DRADeviceTaintRules` is
    /// modelled (on: DeviceTaintRules served from 1.35, with their API).
    #[arg(long, value_delimiter = ',')]
    feature_gates: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut release = args.kubernetes_version;
    for gate in &args.feature_gates {
        match gate.split_once('=') {
            Some(("DRADeviceTaintRules", v)) => {
                let on = v.parse::<bool>().map_err(|_| {
                    anyhow::anyhow!("--feature-gates: DRADeviceTaintRules={v}: not true or false")
                })?;
                release = release.with_device_taint_rules(on);
            }
            _ => anyhow::bail!(
                "--feature-gates: {gate:?}: only DRADeviceTaintRules=true|false is modelled"
            ),
        }
    }
    let running = Bootstrap::new()
        .listen(args.listen)
        .release(release)
        .start()
        .await?;
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
