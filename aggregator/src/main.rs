//! `faultline-aggregator`: wiring only; see the library.

use clap::Parser;
use faultline_aggregator::config::{Args, Config};
use faultline_common::runtime::{init_tracing, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = Config::from_args(Args::parse())?;
    init_tracing(cfg.log_json);
    let agg = faultline_aggregator::start(cfg).await?;
    let cancel = agg.cancel_token();
    tokio::spawn(async move {
        shutdown_signal().await;
        cancel.cancel();
    });
    agg.wait().await;
    Ok(())
}
