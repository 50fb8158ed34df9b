//! `faultline-aggregator`: wiring only; see the library.

use clap::Parser;
use faultline_aggregator::config::{Args, Config};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = Config::from_args(Args::parse())?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if cfg.log_json {
        fmt.json().init();
    } else {
        fmt.init();
    }
    let agg = faultline_aggregator::start(cfg).await?;
    let cancel = agg.cancel_token();
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {},
        }
        tracing::info!("shutting down");
        cancel.cancel();
    });
    agg.wait().await;
    Ok(())
}
