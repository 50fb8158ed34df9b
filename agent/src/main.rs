//! `faultline-agent`: see the library for everything; this only parses the flags and
//! uses the shared process wiring (`faultline_common::runtime`): logging, and stopping
//! on SIGTERM or ctrl-c, or with an error when a part of the agent fails.

use clap::Parser;
use faultline_agent::config::{Args, Config};
use faultline_common::runtime::{init_tracing, shutdown_signal};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let cfg = Config::from_args(Args::parse())?;
    init_tracing(cfg.log_json);
    let agent = faultline_agent::start(cfg).await?;
    let cancel = agent.cancel_token();
    tokio::spawn(async move {
        shutdown_signal().await;
        cancel.cancel();
    });
    // A part that panicked or ended on its own: exit non-zero, Kubernetes restarts us.
    agent.wait().await?;
    Ok(())
}
